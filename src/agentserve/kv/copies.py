"""The copies between KV tiers the executor is asked to run, and what their
outcome does to the accounting.

The manager queues an offload (a device block into a host slot) when a cached
block is evicted or a finished request is swapped out, and a reload (a host
slot into a fresh device block) when an admission matches a host copy. The
scheduler hands each step's queue to the executor (`take`), which reports
which copies failed; only then do they count (`finish`): a written host slot
holds KV from then on, a failed one is freed, and a failed reload's device
block leaves its node (and its host copy is dropped, not trusted again), so
the prefix index never points at KV that was not written. Until `finish`, a
node whose host copy or reload is in flight is not matched.

`TierCopies` is that mechanism for any tier of slots (kv/slot_tier.py): writes
into the tier's slots, reloads from them into device blocks. `CopyQueue` is the
host tier's (its writes: offloads of device blocks); kv/disk_tier.py's
`DiskCopies` is the disk tier's (its writes: spills of host slots)."""

from __future__ import annotations

from collections.abc import Iterable

from agentserve.kv.block import Block
from agentserve.kv.block_pool import BlockPool
from agentserve.kv.host_tier import HostTier
from agentserve.kv.prefix_index import Node
from agentserve.kv.slot_tier import SlotTier


class TierCopies:
    what: str = "copy"  # for messages

    def __init__(self, pool: BlockPool, tier: SlotTier) -> None:
        self.pool = pool
        self.tier = tier
        self.writes: list[tuple[int, int]] = []  # (source, tier slot)
        self.loads: list[tuple[int, int]] = []  # (tier slot, device block)
        self._write_nodes: list[Node] = []  # the node of each queued write
        self._load_nodes: list[tuple[Node, Block]] = []  # the node and device block of each queued load
        self._inflight: tuple[list[Node], list[tuple[Node, Block]]] | None = None  # taken, not finished
        self.loading: set[Node] = set()  # nodes whose reload is queued or in flight
        self._slot_pos: dict[int, int] = {}  # tier slot -> position of its queued write
        self._void: set[int] = set()  # positions of queued writes whose slot was taken back
        self.num_written = 0  # writes confirmed
        self.num_failed = 0

    def write(self, source: int, slot: int, node: Node) -> None:
        """Queue a copy of `source` into tier slot `slot`, just given to `node`. A
        queued copy into the same slot is dropped: the tier took the slot back
        from its node (a full tier evicts its oldest entry, pending or not), and
        two writes of one slot in one batch would race."""
        i = self._slot_pos.get(slot)
        if i is not None:
            self._void.add(i)
        self._slot_pos[slot] = len(self.writes)
        self.writes.append((source, slot))
        self._write_nodes.append(node)

    def load(self, node: Node, block: Block) -> None:
        """Queue a reload of `node`'s copy in this tier into device `block`."""
        self.loads.append((self.tier.slot(node), block.block_id))
        self._load_nodes.append((node, block))
        self.loading.add(node)
        self.tier.touch(node)

    def take(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(writes, loads) queued since the last call."""
        if self._inflight is not None:
            raise RuntimeError(f"{self.what} copies handed out earlier were never finished (finish_copies)")
        wr, ld, nodes = self.writes, self.loads, self._write_nodes
        if self._void:
            keep = [i for i in range(len(wr)) if i not in self._void]
            wr, nodes = [wr[i] for i in keep], [nodes[i] for i in keep]
            self._void.clear()
        self._slot_pos.clear()
        if wr or ld:
            self._inflight = (nodes, self._load_nodes)
        self.writes, self.loads, self._write_nodes, self._load_nodes = [], [], [], []
        return wr, ld

    def finish(self, failed_writes: Iterable[int], failed_loads: Iterable[int]) -> set[int]:
        """The copies `take` handed out ran; those at the positions given
        failed. Returns the ids of the device blocks whose reload failed."""
        if self._inflight is None:
            return set()
        writes, loads = self._inflight
        self._inflight = None
        fw, fl = set(failed_writes), set(failed_loads)
        self.num_failed += len(fw) + len(fl)
        tier = self.tier
        for i, node in enumerate(writes):
            if node in tier.pending:  # (else the tier took the slot back meanwhile)
                if i in fw:
                    tier.drop(node)
                else:
                    tier.confirm(node)
                    self.num_written += 1
        bad = set()
        for i, (node, block) in enumerate(loads):
            self.loading.discard(node)
            if i in fl:
                bad.add(block.block_id)
                if node.block is block:
                    self.pool.detach(block)
                tier.drop(node)  # not trusted again; prunes the node too if nothing else holds it
        return bad

    def check_integrity(self) -> None:
        if self._inflight is None and not self.loads:
            assert not self.loading, f"a {self.what} reload neither queued nor in flight"
        if self._inflight is None and not self.writes:
            assert not self.tier.pending, f"a {self.what} copy neither queued nor in flight"


class CopyQueue(TierCopies):
    """The host tier's copies: offloads (device block -> host slot) and reloads."""

    what = "host"

    def __init__(self, pool: BlockPool, host: HostTier) -> None:
        super().__init__(pool, host)
        self.host = host

    @property
    def offloads(self) -> list[tuple[int, int]]:
        return self.writes

    def offload(self, block: Block, slot: int, node: Node) -> None:
        self.write(block.block_id, slot, node)
