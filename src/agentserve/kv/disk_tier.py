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

from collections.abc import Iterable

from agentserve.kv.block import Block
from agentserve.kv.block_pool import BlockPool
from agentserve.kv.prefix_index import Node
from agentserve.kv.slot_tier import SlotTier


class DiskTier(SlotTier):
    name = "disk"
    slot_attr = "disk_slot"


class DiskCopies:
    """The spills (host slot -> disk slot) and disk reloads (disk slot -> device
    block) queued for the executor, and what their outcome does. Spills run
    before the step's host offloads (which may overwrite the host slot a spill
    reads), disk reloads after them."""

    def __init__(self, pool: BlockPool, disk: DiskTier) -> None:
        self.pool = pool
        self.disk = disk
        self.spills: list[tuple[int, int]] = []  # (host slot, disk slot)
        self.loads: list[tuple[int, int]] = []  # (disk slot, device block)
        self._spill_nodes: list[Node] = []
        self._load_nodes: list[tuple[Node, Block]] = []
        self._inflight: tuple[list[Node], list[tuple[Node, Block]]] | None = None
        self.loading: set[Node] = set()  # nodes whose disk reload is queued or in flight
        self._slot_pos: dict[int, int] = {}  # disk slot -> position of its queued spill
        self._void: set[int] = set()
        self.num_spilled = 0
        self.num_failed = 0

    def spill(self, node: Node, host_slot: int) -> None:
        """The host tier evicts `node`'s confirmed copy in `host_slot`: keep it on
        disk if the tier has room (an existing disk copy is just touched)."""
        if node.disk_slot is not None:
            self.disk.touch(node)
            return
        slot = self.disk.store(node, self.loading)
        if slot is None:
            return
        i = self._slot_pos.get(slot)
        if i is not None:  # the slot was taken back from a node whose spill is queued
            self._void.add(i)
        self._slot_pos[slot] = len(self.spills)
        self.spills.append((host_slot, slot))
        self._spill_nodes.append(node)

    def load(self, node: Node, block: Block) -> None:
        self.loads.append((node.disk_slot, block.block_id))
        self._load_nodes.append((node, block))
        self.loading.add(node)
        self.disk.touch(node)

    def take(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(spills, disk reloads) queued since the last call."""
        if self._inflight is not None:
            raise RuntimeError("disk copies handed out earlier were never finished (finish_copies)")
        sp, ld, nodes = self.spills, self.loads, self._spill_nodes
        if self._void:
            keep = [i for i in range(len(sp)) if i not in self._void]
            sp, nodes = [sp[i] for i in keep], [nodes[i] for i in keep]
            self._void.clear()
        self._slot_pos.clear()
        if sp or ld:
            self._inflight = (nodes, self._load_nodes)
        self.spills, self.loads, self._spill_nodes, self._load_nodes = [], [], [], []
        return sp, ld

    def finish(self, failed_spills: Iterable[int], failed_loads: Iterable[int]) -> set[int]:
        """Returns the ids of the device blocks whose disk reload failed."""
        if self._inflight is None:
            return set()
        spills, loads = self._inflight
        self._inflight = None
        fs, fl = set(failed_spills), set(failed_loads)
        self.num_failed += len(fs) + len(fl)
        disk = self.disk
        for i, node in enumerate(spills):
            if node in disk.pending:  # (else the tier took the slot back meanwhile)
                if i in fs:
                    disk.drop(node)
                else:
                    disk.confirm(node)
                    self.num_spilled += 1
        bad = set()
        for i, (node, block) in enumerate(loads):
            self.loading.discard(node)
            if i in fl:
                bad.add(block.block_id)
                if node.block is block:
                    self.pool.detach(block)
                disk.drop(node)
        return bad

    def check_integrity(self) -> None:
        if self._inflight is None and not self.loads:
            assert not self.loading, "a disk reload neither queued nor in flight"
        if self._inflight is None and not self.spills:
            assert not self.disk.pending, "a spill neither queued nor in flight"
        if self.disk.enabled:
            self.disk.check_integrity()
