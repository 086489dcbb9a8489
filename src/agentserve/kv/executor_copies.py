"""The KV manager's side of the copies between tiers (kv/copies.py,
kv/disk_tier.py): handing each step's copies to the executor as a batch,
counting them once it reports how they went, and cutting back a request whose
reload failed to the KV it really has. Part of `KVCacheManager`
(kv/manager.py), whose pool, index, copy queues and window parts it uses."""

from __future__ import annotations

from collections.abc import Iterable

from agentserve.kv.block import Block
from agentserve.kv.block_pool import BlockPool
from agentserve.kv.block_table import BlockTable
from agentserve.kv.copies import CopyQueue
from agentserve.kv.disk_tier import DiskCopies
from agentserve.kv.prefix_index import PrefixIndex
from agentserve.kv.stage_copies import StageCopies
from agentserve.kv.window_parts import WindowParts


class ExecutorCopies:
    block_size: int
    pool: BlockPool
    index: PrefixIndex
    copies: CopyQueue
    disk_copies: DiskCopies
    stages: StageCopies
    parts: WindowParts | None

    def take_copies(self, ticket: int | None = None) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(offloads, loads) queued since the last call, as the batch `ticket`
        (kv/copies.py); offloads run first. They count once `finish_copies`
        reports how they went."""
        return self.copies.take(ticket)

    def take_disk_copies(self, ticket: int | None = None) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(spills, disk reloads) queued since the last call (kv/disk_tier.py)."""
        return self.disk_copies.take(ticket)

    def take_stages(self, ticket: int | None = None) -> list[tuple[int, int]]:
        """(disk slot, host slot) of the disk -> host stages queued since the last
        call (kv/stage_copies.py); the disk link runs them after its disk reloads."""
        return self.stages.take(ticket)

    def finish_copies(self, failed_offloads: Iterable[int] = (), failed_loads: Iterable[int] = (),
                      failed_spills: Iterable[int] = (), failed_disk_loads: Iterable[int] = (),
                      ticket: int | None = None, now: float = 0.0, tier: str | None = None,
                      failed_stages: Iterable[int] = ()) -> set[int]:
        """The copies `take_copies`, `take_disk_copies` and `take_stages` handed out under
        `ticket` (None: the oldest batch in flight) ran; those at the positions
        given (in their lists) failed. `tier` "host" or "disk": only that tier's
        copies ran (an executor that reports the two links apart); None: both.
        Returns the ids of the device blocks whose reload failed: the request
        holding one must be cut back (`cut_unloaded`)."""
        bad: set[int] = set()
        if tier != "host":
            bad |= self.disk_copies.finish(failed_spills, failed_disk_loads, ticket, now)
            self.stages.finish(failed_stages, ticket)
        if tier != "disk":
            bad |= self.copies.finish(failed_offloads, failed_loads, ticket, now)
        return bad

    @property
    def copies_in_flight(self) -> bool:
        """Batches of copies taken and not finished yet."""
        return bool(self.copies.num_inflight or self.disk_copies.num_inflight or self.stages.num_inflight)

    def is_loading(self, block: Block) -> bool:
        """A reload into `block` is queued or in flight: it holds no KV yet."""
        node = block.node
        return node is not None and (node in self.copies.loading or node in self.disk_copies.loading
                                     or (self.window_tier is not None and block in self.window_tier.filling))

    def loads_pending(self, st: BlockTable) -> bool:
        """`st` holds blocks whose reload has not landed yet (its request must
        not compute: it waits for its own reloads, no one else's)."""
        if st.loads:
            st.loads = [b for b in st.loads if self.is_loading(b)]
        return bool(st.loads)

    def cut_unloaded(self, st: BlockTable, bad: set[int], now: float) -> int | None:
        """If `st` holds a block of `bad` (a reload that failed), keep that block
        as a private one to recompute into and give back every block after it
        (the hybrid cache: give back from where the window before it is whole);
        returns the tokens still backed by KV (the request recomputes from there).
        None: `st` holds none of them."""
        for i, b in enumerate(st.blocks):
            if b.block_id in bad:
                break
        else:
            return None
        keep = i + 1
        if self.parts is not None:
            # back to where the window before it is all there, into blocks allocated afresh
            i = keep = self.parts.valid_hit(st.blocks[:i])
        tail = st.blocks[keep:]
        if st.window:
            self.parts.release_from(st, keep, now)
        del st.blocks[keep:]
        self.pool.release(tail, now)
        st.num_indexed = min(st.num_indexed, i)
        st.last_node = st.blocks[i - 1].node if i else self.index.root
        assert st.last_node is not None
        if self.parts is not None:
            st.computed = i * self.block_size
            self.parts.sync(st, len(st.blocks), now)
        return i * self.block_size
