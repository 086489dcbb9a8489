"""The disk tier: a third level of KV below the host tier, in files.

When the host tier evicts a copy whose write was confirmed, the block is
*spilled*: the tier gives its node a disk slot (a file the runner writes from
the host slot, `runner/disk_store.py`), evicting its least recently used entry
if all slots are taken. A later match that reaches a node whose KV is only on
disk reloads it straight into a device block. This module only keeps the
accounting (slots, LRU, what is pending); the executor moves the bytes and
reports which copies failed, with the same rule as the host tier's copies
(kv/copies.py): a spill counts once confirmed, a failed spill frees its slot,
a failed or rejected read (a torn, foreign or corrupt file) takes the block
off its node and drops the disk copy, and until a copy is confirmed its node
is not matched through it. A slot is a file name the runner reuses, so the
budget in slots is the byte budget over one file's size."""

from __future__ import annotations

from agentserve.kv.block_pool import BlockPool
from agentserve.kv.copies import TierCopies
from agentserve.kv.prefix_index import Node
from agentserve.kv.slot_tier import SlotTier


class DiskTier(SlotTier):
    name = "disk"
    slot_attr = "disk_slot"


class DiskCopies(TierCopies):
    """The spills (host slot -> disk slot) and disk reloads (disk slot -> device
    block) queued for the executor, and what their outcome does (kv/copies.py).
    Spills run before the step's host offloads (which may overwrite the host slot
    a spill reads), disk reloads after them."""

    what = "disk"

    def __init__(self, pool: BlockPool, disk: DiskTier) -> None:
        super().__init__(pool, disk)
        self.disk = disk

    @property
    def spills(self) -> list[tuple[int, int]]:
        return self.writes

    @property
    def num_spilled(self) -> int:
        return self.num_written

    def spill(self, node: Node, host_slot: int) -> None:
        """The host tier evicts `node`'s confirmed copy in `host_slot`: keep it on
        disk if the tier has room (an existing disk copy is just touched)."""
        if node.disk_slot is not None:
            self.disk.touch(node)
            return
        slot = self.disk.store(node, self.loading)
        if slot is not None:
            self.write(host_slot, slot, node)

    def check_integrity(self) -> None:
        super().check_integrity()
        if self.disk.enabled:
            self.disk.check_integrity()


# Spilled blocks waiting in memory for the disk, at most (the host tier's
# quarter, within this many bytes): enough to ride out a burst of evictions,
# small beside a host tier of tens to hundreds of GB.
SPILL_STAGING_BYTES = 4 << 30


class SpillBacklog:
    """The spills an overlapping executor has copied out of the host tier
    (their slots are free for the step's offloads at once) and not yet written
    to disk. The disk link writes them behind the host link's copies, so a
    reload never waits for a spill; the backlog bounds the memory that takes:
    a batch whose spills do not fit waits for the disk link to catch up (the
    host link then runs at the disk's pace, as one link would). The runner's
    copy engine and the simulator's executor keep it alike."""

    def __init__(self, host_blocks: int, block_bytes: int, budget_bytes: int = SPILL_STAGING_BYTES) -> None:
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
        self.cap = max(1, min(host_blocks // 4, budget_bytes // block_bytes))
        self.blocks = 0  # staged, not yet written
        self.peak = 0
        self.num_waits = 0  # batches that waited for room

    def fits(self, n: int) -> bool:
        """`n` more staged blocks fit (a batch never waits on an empty backlog)."""
        return self.blocks == 0 or self.blocks + n <= self.cap

    def add(self, n: int) -> None:
        self.blocks += n
        self.peak = max(self.peak, self.blocks)

    def written(self, n: int) -> None:
        if n > self.blocks:
            raise ValueError(f"{n} staged blocks written, {self.blocks} were staged")
        self.blocks -= n
