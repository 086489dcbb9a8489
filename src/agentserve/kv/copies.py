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
node whose host copy or reload is in flight is not matched."""

from __future__ import annotations

from collections.abc import Iterable

from agentserve.kv.block import Block
from agentserve.kv.block_pool import BlockPool
from agentserve.kv.host_tier import HostTier
from agentserve.kv.prefix_index import Node


class CopyQueue:
    def __init__(self, pool: BlockPool, host: HostTier) -> None:
        self.pool = pool
        self.host = host
        self.offloads: list[tuple[int, int]] = []  # (device block, host slot)
        self.loads: list[tuple[int, int]] = []  # (host slot, device block)
        self._offload_nodes: list[Node] = []  # the node of each queued offload
        self._load_nodes: list[tuple[Node, Block]] = []  # the node and device block of each queued load
        self._inflight: tuple[list[Node], list[tuple[Node, Block]]] | None = None  # taken, not finished
        self.loading: set[Node] = set()  # nodes whose reload is queued or in flight
        self._slot_pos: dict[int, int] = {}  # host slot -> position of its queued offload
        self._void: set[int] = set()  # positions of queued offloads whose slot was taken back
        self.num_failed = 0

    def offload(self, block: Block, slot: int, node: Node) -> None:
        """Queue a copy of `block` into host slot `slot`, just given to `node`. A
        queued copy into the same slot is dropped: the tier took the slot back
        from its node (a full tier evicts its oldest entry, pending or not), and
        two writes of one slot in one batch would race."""
        i = self._slot_pos.get(slot)
        if i is not None:
            self._void.add(i)
        self._slot_pos[slot] = len(self.offloads)
        self.offloads.append((block.block_id, slot))
        self._offload_nodes.append(node)

    def load(self, node: Node, block: Block) -> None:
        self.loads.append((node.host_slot, block.block_id))
        self._load_nodes.append((node, block))
        self.loading.add(node)

    def take(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(offloads, loads) queued since the last call; offloads run first."""
        if self._inflight is not None:
            raise RuntimeError("copies handed out earlier were never finished (finish_copies)")
        off, ld, nodes = self.offloads, self.loads, self._offload_nodes
        if self._void:
            keep = [i for i in range(len(off)) if i not in self._void]
            off, nodes = [off[i] for i in keep], [nodes[i] for i in keep]
            self._void.clear()
        self._slot_pos.clear()
        if off or ld:
            self._inflight = (nodes, self._load_nodes)
        self.offloads, self.loads, self._offload_nodes, self._load_nodes = [], [], [], []
        return off, ld

    def finish(self, failed_offloads: Iterable[int], failed_loads: Iterable[int]) -> set[int]:
        """The copies `take` handed out ran; those at the positions given
        failed. Returns the ids of the device blocks whose reload failed."""
        if self._inflight is None:
            return set()
        offs, loads = self._inflight
        self._inflight = None
        fo, fl = set(failed_offloads), set(failed_loads)
        self.num_failed += len(fo) + len(fl)
        host = self.host
        for i, node in enumerate(offs):
            if node in host.pending:  # (else the tier took the slot back meanwhile)
                (host.drop if i in fo else host.confirm)(node)
        bad = set()
        for i, (node, block) in enumerate(loads):
            self.loading.discard(node)
            if i in fl:
                bad.add(block.block_id)
                if node.block is block:
                    self.pool.detach(block)
                host.drop(node)  # prunes the node too if nothing else holds it
        return bad

    def check_integrity(self) -> None:
        if self._inflight is None and not self.loads:
            assert not self.loading, "a reload neither queued nor in flight"
        if self._inflight is None and not self.offloads:
            assert not self.host.pending, "a host copy neither queued nor in flight"
