"""The copies between KV tiers the executor is asked to run, and what their
outcome does to the accounting.

The manager queues an offload (a device block into a host slot) when a cached
block is evicted or a finished request is swapped out, and a reload (a host
slot into a fresh device block) when an admission matches a host copy. The
scheduler hands each step's queue to the executor as one batch under a ticket
(`take`); the executor reports, in that step or any later one, which copies of
the batch failed; only then do they count (`finish`): a written host slot
holds KV from then on, a failed one is freed, and a failed reload's device
block leaves its node (and its host copy is dropped, not trusted again), so
the prefix index never points at KV that was not written. Until `finish`, a
node whose host copy or reload is in flight is not matched.

Several batches may be in flight at once (an executor that overlaps copies
with compute, engine/executor.py): it runs them in the order taken, and a
batch's outcome only concerns its own copies. A node written again by a later
batch counts by its latest write; a reload's device block stays referenced by
the reload until it finishes, so a request preempted or aborted meanwhile
cannot hand the block to anyone else while the copy still writes it.

Under the hybrid cache (kv/window_tier.py) a node's host copy may carry its
block's window part: more writes, keyed by the part's copy (which settles once
all its pages ran: one failed page drops the part's copy, not the block's), and
more reloads into the pages of a fresh part, which succeed or fail with their
node's reload (`load_page`).

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
        # the key of each queued write: its node, or a window part's copy (`settle(failed)`)
        self._write_nodes: list = []
        # the node and device block of each queued load, and whether it loads a page of the block's part
        self._load_nodes: list[tuple[Node, Block, bool]] = []
        # taken, not finished, in the order taken: ticket -> (write keys, (node, block, page) of each load)
        self._inflight: dict[int, tuple[list, list[tuple[Node, Block, bool]]]] = {}
        self._writer: dict = {}  # write key -> ticket of its latest write in flight
        self.on_part_loaded = None  # called with a block and `now` once its part's pages' reloads ran
        self._auto = 0  # tickets of batches taken without one: -1, -2, ...
        self.loading: set[Node] = set()  # nodes whose reload is queued or in flight
        self._slot_pos: dict[int, int] = {}  # tier slot -> position of its queued write
        self._void: set[int] = set()  # positions of queued writes whose slot was taken back
        self.num_written = 0  # writes confirmed
        self.num_failed = 0

    @property
    def num_inflight(self) -> int:
        """Batches taken and not finished yet."""
        return len(self._inflight)

    def write(self, source: int, slot: int, node) -> None:
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
        """Queue a reload of `node`'s copy in this tier into device `block`; the
        reload holds a reference on `block` until it finishes."""
        self.loads.append((self.tier.slot(node), block.block_id))
        self._load_nodes.append((node, block, False))
        self.loading.add(node)
        self.pool.ref(block)
        self.tier.touch(node)

    def load_page(self, node: Node, block: Block, slot: int, page: Block) -> None:
        """Queue a reload of tier slot `slot` into `page`, a page of the window
        part of `block` (whose own reload from `node` is queued): it counts with
        that reload, and the part's holder is told when it ran (`on_part_loaded`)."""
        self.loads.append((slot, page.block_id))
        self._load_nodes.append((node, block, True))

    def take(self, ticket: int | None = None) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(writes, loads) queued since the last call: a batch under `ticket`
        (unique among the batches in flight; None: one is made up)."""
        if ticket is None:
            self._auto -= 1
            ticket = self._auto
        if ticket in self._inflight:
            raise RuntimeError(f"{self.what} copies under ticket {ticket} are still in flight")
        wr, ld, nodes = self.writes, self.loads, self._write_nodes
        if self._void:
            keep = [i for i in range(len(wr)) if i not in self._void]
            wr, nodes = [wr[i] for i in keep], [nodes[i] for i in keep]
            self._void.clear()
        self._slot_pos.clear()
        if wr or ld:
            self._inflight[ticket] = (nodes, self._load_nodes)
            for node in nodes:
                self._writer[node] = ticket
        self.writes, self.loads, self._write_nodes, self._load_nodes = [], [], [], []
        return wr, ld

    def finish(self, failed_writes: Iterable[int], failed_loads: Iterable[int], ticket: int | None = None,
               now: float = 0.0) -> set[int]:
        """The copies `take` handed out under `ticket` (None: the oldest batch in
        flight) ran; those at the positions given failed. Returns the ids of the
        device blocks whose reload failed (an unknown ticket: nothing happens)."""
        if ticket is None:
            ticket = next(iter(self._inflight), None)
        batch = self._inflight.pop(ticket, None)
        if batch is None:
            return set()
        writes, loads = batch
        fw, fl = set(failed_writes), set(failed_loads)
        self.num_failed += len(fw) + len(fl)
        tier = self.tier
        outcome: dict = {}  # write key -> whether one of its writes failed (a part's copy has several)
        for i, key in enumerate(writes):
            outcome[key] = outcome.get(key, False) or i in fw
        for key, failed in outcome.items():
            if self._writer.get(key) != ticket:
                continue  # a later batch writes the node again: that write counts
            del self._writer[key]
            if not isinstance(key, Node):
                key.settle(failed)
            elif key in tier.pending:  # (else the tier took the slot back meanwhile)
                if failed:
                    tier.drop(key)
                else:
                    tier.confirm(key)
                    self.num_written += 1
        bad = set()
        for i, (node, block, page) in enumerate(loads):
            if not page:
                self.loading.discard(node)
            if i in fl:
                bad.add(block.block_id)
                if node.block is block:
                    self.pool.detach(block)
                tier.drop(node)  # not trusted again; prunes the node too if nothing else holds it
        for block in dict.fromkeys(b for _, b, page in loads if page):
            self.on_part_loaded(block, now)
        blocks = [b for _, b, page in loads if not page]
        if blocks:
            self.pool.release(blocks, now)
        return bad

    def held_blocks(self) -> list[int]:
        """Ids of the device blocks the queued and in-flight reloads hold."""
        held = [b.block_id for _, b, page in self._load_nodes if not page]
        for _, loads in self._inflight.values():
            held.extend(b.block_id for _, b, page in loads if not page)
        return held

    @property
    def writers(self) -> set:
        """The keys of the writes queued or in flight."""
        return set(self._write_nodes) | set(self._writer)

    def check_integrity(self, staging: set[Node] = frozenset()) -> None:
        """`staging`: nodes whose pending slot a disk -> host stage writes (kv/stage_copies.py)."""
        queued = [n for n, _, page in self._load_nodes if not page]
        inflight = [n for _, loads in self._inflight.values() for n, _, page in loads if not page]
        assert self.loading == set(queued) | set(inflight), f"a {self.what} reload neither queued nor in flight"
        assert len(queued) + len(inflight) == len(self.loading), f"two {self.what} reloads of one node at once"
        assert self.tier.pending <= self.writers | staging, f"a {self.what} copy neither queued nor in flight"


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
