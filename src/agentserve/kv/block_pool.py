"""The device block pool: reference counts, the free set, and the link between
blocks and prefix-index nodes.

Free blocks come in two kinds. Empty ones (no cached content) sit on a stack
and are reused first. Cached ones (their KV is still indexed) are handed to
the eviction strategy, which picks the victim when an empty block is lacking;
a prefix hit on a cached free block revives it without copying anything.

Cached blocks known to be dead (a program's superseded history, see
KVCacheManager.supersede) are demoted: they wait on a cold list that is
evicted before anything the strategy holds, whatever the strategy, and leave
it like any free block when a prefix hit revives them. Blocks of multi-turn
programs between turns may be protected instead (kv/protected_zone.py): they
are evicted after everything the strategy holds."""

from __future__ import annotations

from collections.abc import Callable

from agentserve.kv.block import Block
from agentserve.kv.eviction import EvictionStrategy, LinkedList
from agentserve.kv.prefix_index import Node, PrefixIndex
from agentserve.kv.protected_zone import ProtectedZone
from agentserve.kv.window_parts import WindowParts


class BlockPool:
    def __init__(self, num_blocks: int, index: PrefixIndex, strategy: EvictionStrategy,
                 on_evict: Callable[[Block], None] | None = None, protected_blocks: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.index = index
        self.strategy = strategy
        # called with a cached block just before its content is dropped; not for a
        # demoted one: no turn will read it again, so no tier below keeps it
        self.on_evict = on_evict
        self._empty: list[Block] = list(reversed(self.blocks))
        self._cold = LinkedList()  # demoted cached free blocks, next evicted first
        self.zone = ProtectedZone(protected_blocks)  # evicted last
        self.num_evictions = 0
        self.num_demoted = 0
        self.parts: WindowParts | None = None  # the hybrid cache's window parts (`enable_window_parts`)
        # the strategy's on_hit does something (lfu, arc): lru and leaf-lru keep the base's no-op
        self._strategy_sees_hits = type(strategy).on_hit is not EvictionStrategy.on_hit

    def enable_window_parts(self, window: int, pages: int, block_size: int) -> WindowParts:
        """Blocks also hold window parts (kv/window_parts.py) drawn from this pool."""
        self.parts = WindowParts(self, window, pages, block_size)
        return self.parts

    @property
    def num_free(self) -> int:
        n = len(self._empty) + len(self._cold) + len(self.strategy) + len(self.zone)
        return n if self.parts is None else n + self.parts.num_free_pages

    @property
    def num_cached_free(self) -> int:
        return len(self._cold) + len(self.strategy) + len(self.zone)

    def allocate(self, n: int) -> list[Block] | None:
        """`n` blocks with ref_cnt 1, or None (and nothing changed) if fewer are free."""
        if n > self.num_free:
            return None
        out = []
        parts = self.parts
        for _ in range(n):
            while parts is not None and not self._empty and parts.num_free_pages and not self._cold:
                victim = self.strategy.peek()  # a part freed before the next block goes first
                if victim is not None and victim.last_access < parts.oldest_free_time():
                    break
                parts.evict_one()
            if self._empty:
                b = self._empty.pop()
            else:
                dead = bool(len(self._cold))
                if dead:
                    b = self._cold.popleft()
                elif len(self.strategy) or not len(self.zone):
                    b = self.strategy.pop()
                else:
                    b = self.zone.pop()
                self._evict(b, dead)
            b.ref_cnt = 1
            out.append(b)
        return out

    def ref(self, block: Block) -> None:
        """Take one more reference on `block` (a reload in flight holds the block
        it writes: kv/copies.py); a free block leaves the free set."""
        if block.ref_cnt == 0:
            self._leave_free(block)
        block.ref_cnt += 1

    def _leave_free(self, block: Block) -> None:
        """A free cached block leaves whichever list holds it."""
        if block.strategy_data is self._cold:
            self._cold.unlink(block)
        elif block in self.zone:
            self.zone.remove(block)
        else:
            self.strategy.remove(block)

    def hit(self, blocks: list[Block], now: float) -> None:
        """A prefix match hit `blocks`: take a reference on each (a free one leaves
        the free set), count the hit and tell the strategy, in one loop (an
        admitted turn hits every block of its history, 150 and more)."""
        on_hit = self.strategy.on_hit if self._strategy_sees_hits else None
        cold, strategy = self._cold, self.strategy
        for b in blocks:
            if b.ref_cnt == 0:
                if b.strategy_data is cold:
                    cold.unlink(b)
                elif b in strategy:
                    strategy.remove(b)
                else:
                    self.zone.remove(b)
            b.ref_cnt += 1
            b.hits += 1
            b.last_access = now
            if on_hit is not None:
                on_hit(b)

    def demote(self, blocks) -> int:
        """Move the free cached ones of `blocks` to the cold list, to be evicted
        before any other cached block, in the order given. Returns how many moved."""
        n = 0
        for b in blocks:
            if b.ref_cnt == 0 and (b in self.strategy or b in self.zone):
                self._leave_free(b)
                self._cold.append(b)
                n += 1
        self.num_demoted += n
        return n

    def release(self, blocks, now: float, protect: str | None = None) -> None:
        """Drop one reference on each block, last block first, so a request's
        tail becomes evictable before its prefix (which others may share).
        `protect`: the live multi-turn program whose blocks these are, between
        its turns: freed cached blocks go to the protected zone while it has room."""
        zone = self.zone if protect is not None and self.zone.enabled else None
        for b in reversed(blocks):
            b.ref_cnt -= 1
            if b.ref_cnt < 0:
                raise RuntimeError(f"{b} released more often than referenced")
            if b.ref_cnt == 0:
                b.last_access = now
                if b.node is None:
                    if b.wpart is not None:
                        self.parts.drop(b, now)
                    self._empty.append(b)
                elif zone is None or not zone.admit(b, protect):
                    self.strategy.add(b, now)

    def unprotect(self, program_id: str) -> int:
        """`program_id` ended or was released: its protected blocks become plain
        free cached blocks. Returns how many left the zone."""
        blocks = self.zone.release_program(program_id)
        for b in blocks:
            self.strategy.add(b, b.last_access)
        return len(blocks)

    # --- the block <-> node link ---

    def attach(self, block: Block, node: Node) -> None:
        """`block` now holds the KV of `node` (a block that was just computed)."""
        assert node.block is None and block.node is None
        node.block = block
        block.node = node
        block.key = node.key
        block.tokens = node.tokens
        block.hits = 0
        parent = node.parent.block if node.parent is not None else None
        block.parent = parent
        nc = 0
        for c in node.children.values():
            if c.block is not None:
                c.block.parent = block
                nc += 1
        block.num_children = nc
        self.strategy.on_insert(block)
        if parent is not None:
            parent.num_children += 1
            self.strategy.on_children_changed(parent)

    def _evict(self, block: Block, dead: bool = False) -> None:
        """Drop a free cached block's content so the block can be reused."""
        assert block.node is not None and block.ref_cnt == 0
        if self.on_evict is not None and not dead:
            self.on_evict(block)
        self.num_evictions += 1
        self._unlink(block)

    def detach(self, block: Block) -> None:
        """`block` does not hold its node's KV after all (a reload into it
        failed): the node loses it, the block keeps its holders as a private
        block (or, free, becomes empty), and nothing is copied anywhere."""
        if block.node is None:
            return
        if block.ref_cnt == 0:
            self._leave_free(block)
            self._empty.append(block)
        self._unlink(block)

    def hand_over(self, cached: Block, block: Block) -> None:
        """`block` (just computed, held) takes the place of `cached` (free) at its
        node: the same tokens' KV; `cached` becomes empty (the manager's
        `_takes_over` says when)."""
        assert cached.ref_cnt == 0 and cached.node is not None
        node = cached.node
        self._leave_free(cached)
        self._empty.append(cached)
        self._unlink(cached, prune=False)
        self.attach(block, node)

    def _unlink(self, block: Block, prune: bool = True) -> None:
        node = block.node
        node.block = None
        for c in node.children.values():
            if c.block is not None:
                c.block.parent = None
        parent = block.parent
        if parent is not None:
            parent.num_children -= 1
            self.strategy.on_children_changed(parent)
        block.node = block.key = block.tokens = block.parent = None
        block.num_children = 0
        block.hits = 0
        if block.wpart is not None:
            self.parts.drop(block, block.last_access)
        if prune:
            self.index.prune(node)

    def check_integrity(self, holders: dict[int, int]) -> None:
        """`holders`: block id -> number of references the manager knows of."""
        empty_ids = {b.block_id for b in self._empty}
        assert len(empty_ids) == len(self._empty), "a block is twice on the empty stack"
        for b in self.blocks:
            want = holders.get(b.block_id, 0)
            assert b.ref_cnt == want, f"{b}: ref_cnt {b.ref_cnt}, holders {want}"
            where = (b in self.strategy) + (b.strategy_data is self._cold) + (b in self.zone)
            if b.ref_cnt > 0:
                assert not where and b.block_id not in empty_ids, f"{b} in use but free"
            elif b.node is not None:
                assert where == 1 and b.block_id not in empty_ids, f"{b} cached free block not evictable once"
            else:
                assert b.block_id in empty_ids and not where, f"{b} empty free block lost"
            if b.node is not None:
                node = b.node
                assert node.block is b, f"{b} and its node disagree"
                assert b.key == node.key and b.tokens == node.tokens
                pb = node.parent.block if node.parent is not None else None
                assert b.parent is pb, f"{b} parent link stale"
                nc = sum(1 for c in node.children.values() if c.block is not None)
                assert b.num_children == nc, f"{b} num_children {b.num_children} != {nc}"
        assert sum(1 for _ in self._cold) == len(self._cold)
        self.zone.check_integrity()
        free = len(self.strategy) + len(self._cold) + len(self.zone) + len(self._empty)
        assert free == self.num_free - (self.parts.num_free_pages if self.parts is not None else 0)
