"""The sliding-window layers' share of the KV (the hybrid cache).

In a model whose layers are of two kinds (Gemma 3: a few global layers, most
with a sliding window of W positions), a token's KV in a window layer is read
only by the W - 1 tokens after it. Keeping it for a whole conversation, as for
the global layers, spends most of the cache on KV no token will read again.

So a block of the pool holds one block of tokens for the global layers, and a
block's *window part* (`Block.wpart`: `pages` more blocks of the same pool,
each the same bytes) holds its tokens for the window layers. A block table
(or a pin) holds the parts it may still read (`Block.wrefs` counts them): the
blocks of its current window, the blocks its next chunk writes, the window
before its prompt's end (the *checkpoint*: a program's next turn often
re-renders the last reply differently and so matches only up to there), and
the window before its *branch*, where its prompt left a chain that another
prompt continued (`PrefixMatch.branch`): an agent that rewrites its history
(Claude Code compacting its conversation: the system prompt and tool
definitions, then a summary) or programs that share a system prompt send
their next prompts through that point again, and a hit there needs its
window, which the running request's own window left behind long before. When
no holder is left, the part of an indexed block stays, free and evictable
(it serves a prefix hit whose window ends there). Unheld parts are evicted in
the order they were freed, interleaved with the cached blocks by recency (the
pool compares the oldest part with the strategy's next victim, where the
strategy tells it); the parts a running request's window moved past count as
freed at time 0, so they go first: such a part serves a hit only at a few
positions. Evicting every unheld part before any block instead lost the
window a preempted or unpinned turn needs for its next hit (in the simulator,
0.85x the full cache's mean JCT under pressure, against 1.12x this way). The
part of a block that is not indexed is freed at once.

A prefix hit of k blocks needs the global blocks of all k and the window
parts of the blocks its first new token can see (`first_needed`): the match
stops where both are present (`valid_hit`), never answering from KV that is
gone. With a host tier, a block's part may also have a host copy beside the
block's (kv/window_tier.py): a block reloaded from the host counts as having
its part when that copy is readable (`host_part`), and comes back with it."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

from agentserve.kv.block import Block
from agentserve.kv.block_table import BlockTable


class KVInconsistency(RuntimeError):
    """The KV a request was to be answered from is not what the accounting says
    (`kind`: the layer kind, "global" or "window"): its admission is undone and
    it recomputes."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind} layers: {message}")
        self.kind = kind


class WindowParts:
    def __init__(self, pool, window: int, pages: int, block_size: int) -> None:
        # pool: the BlockPool the parts' pages come from (which holds this object)
        if window < 1 or pages < 1:
            raise ValueError(f"a window part needs a window >= 1 and pages >= 1, got {window}, {pages}")
        self.pool = pool
        self.window = window
        self.pages = pages
        self.block_size = block_size
        # owner id -> (owner, when freed): unheld parts, oldest first
        self._free: OrderedDict[int, tuple[Block, float]] = OrderedDict()
        self.num_parts = 0
        self.num_evicted = 0
        # node -> whether its block, not on the device, can be reloaded with its part (kv/window_tier.py)
        self.host_part = lambda node: False
        self.on_evict = None  # called with an indexed block whose unheld part is evicted, before it goes

    @property
    def num_free_pages(self) -> int:
        """Pages of unheld parts: free for the pool to take back."""
        return len(self._free) * self.pages

    def first_needed(self, position: int) -> int:
        """The first block a token at `position` attends to in a window layer."""
        return max(0, position - self.window + 1) // self.block_size

    def window_blocks(self) -> int:
        """Blocks one position's window spans at most."""
        return -(-(self.window - 1) // self.block_size) + 1

    # --- holding parts ---

    def acquire(self, owner: Block) -> bool:
        """Hold `owner`'s part, allocating it if it has none. False (nothing
        changed) if the pool lacks the pages."""
        if owner.wpart is None:
            pages = self.pool.allocate(self.pages)
            if pages is None:
                return False
            owner.wpart = pages
            self.num_parts += 1
        elif owner.wrefs == 0:
            del self._free[owner.block_id]
        owner.wrefs += 1
        return True

    def adopt(self, owner: Block, pages: list[Block]) -> None:
        """`pages` (just allocated) become `owner`'s part, held once by whoever
        fills them (a reload from the host tier), who releases it after."""
        assert owner.wpart is None and len(pages) == self.pages
        owner.wpart = pages
        owner.wrefs = 1
        self.num_parts += 1

    def release(self, owner: Block, now: float) -> None:
        owner.wrefs -= 1
        if owner.wrefs < 0:
            raise RuntimeError(f"{owner}: window part released more often than held")
        if owner.wrefs == 0:
            if owner.node is None:
                self._free_part(owner, now)  # not indexed: no hit will ever want it
            else:
                self._free[owner.block_id] = (owner, now)

    def drop(self, owner: Block, now: float = 0.0) -> None:
        """`owner` loses its content (evicted) or became an empty block: its unheld part goes too."""
        if owner.wpart is not None and owner.wrefs == 0:
            self._free.pop(owner.block_id, None)
            self._free_part(owner, now)

    def oldest_free_time(self) -> float:
        return next(iter(self._free.values()))[1]

    def evict_one(self) -> None:
        """Free the oldest unheld part (the pool needs its pages)."""
        _, (owner, t) = self._free.popitem(last=False)
        self.num_evicted += 1
        if self.on_evict is not None:
            self.on_evict(owner)
        self._free_part(owner, t)

    def _free_part(self, owner: Block, now: float) -> None:
        pages, owner.wpart = owner.wpart, None
        self.num_parts -= 1
        self.pool.release(pages, now)

    def check_match(self, nodes: Sequence) -> None:
        """A match about to be admitted still has its window (`valid_nodes`): else
        KVInconsistency, before anything changed (the caller recomputes)."""
        if self.valid_nodes(nodes) != len(nodes):
            raise KVInconsistency("window", f"a prefix match of {len(nodes)} blocks lost a window part "
                                            "before its admission")

    def sync(self, st: BlockTable, upto: int, now: float) -> None:
        """Hold the parts of `st`'s first `upto` blocks that a token from
        `st.computed` on can read (allocating those of blocks not computed
        yet); keep holding those of its checkpoint's window; release the rest.
        The caller made sure the pool has the pages for the new ones."""
        bs, held = self.block_size, st.window
        want = range(self.first_needed(st.computed), upto)
        kc = min(st.checkpoint // bs, upto)
        keep = range(self.first_needed(kc * bs), kc) if st.checkpoint else range(0)
        kb = min(st.branch // bs, upto)
        keep_branch = range(self.first_needed(kb * bs), kb) if st.branch else range(0)
        for i in [i for i in held if i not in want and i not in keep and i not in keep_branch]:
            self.release(held.pop(i), now)
        for i in want:
            if i not in held:
                b = st.blocks[i]
                if b.wpart is None and i * bs < st.computed:
                    # computed KV whose part is gone: a part allocated now would hold no KV
                    raise RuntimeError(f"the window KV of block {i} of a table is gone")
                if not self.acquire(b):
                    raise RuntimeError(f"no pages for the window part of block {i} of a table")
                held[i] = b

    def release_all(self, owners: Iterable[Block], now: float) -> None:
        for b in owners:
            self.release(b, now)

    def release_from(self, st: BlockTable, start: int, now: float) -> None:
        """`st` gives up its blocks from `start` on: first the parts it holds of them."""
        self.release_all([st.window.pop(i) for i in sorted(st.window) if i >= start], now)

    def branch_of(self, path: Sequence, walkable: int) -> int:
        """`PrefixMatch.branch` of a walk that went `walkable` blocks at most:
        where it stopped short at a node another prompt went on from (a child
        made of prompt tokens; one made of a reply's tokens is the program's
        last turn, re-rendered: its prompt end is already a checkpoint)."""
        if not path or len(path) >= walkable:
            return 0
        return len(path) if any(c.prompt for c in path[-1].children.values()) else 0

    @staticmethod
    def takes_over(cached: Block, ours: Block) -> bool:
        """A request that recomputed a cached block because the block's part was
        gone (a hit stops where a part is missing) has the part: its block serves
        the hits from then on, and the cached one, free, is dropped
        (BlockPool.hand_over). Else every later turn would stop short there too."""
        return cached.wpart is None and ours.wpart is not None and cached.ref_cnt == 0

    # --- what a hit or a step needs ---

    def valid_hit(self, blocks: Sequence[Block | None]) -> int:
        """The longest prefix of `blocks` (a match's blocks in order, None where
        not on the device) on the device whose window is all present: k such
        that the blocks [first_needed(k * block_size), k) have their parts."""
        k = next((i for i, b in enumerate(blocks) if b is None), len(blocks))
        return self._valid(k, lambda i: blocks[i].wpart is not None)

    def all_present(self, blocks: Sequence[Block], position: int) -> bool:
        """Whether the blocks a token at `position` reads in its window all have their parts."""
        return all(b.wpart is not None for b in blocks[self.first_needed(position):])

    def valid_nodes(self, nodes: Sequence) -> int:
        """`valid_hit` of a match's nodes, each on the device or with a
        readable copy in a tier below: a node has its part on the device, or
        where `host_part` says so (a block on the device whose part was evicted
        gets it back from the copy alone)."""
        return self._valid(len(nodes), lambda i: ((nodes[i].block is not None and nodes[i].block.wpart is not None)
                                                  or self.host_part(nodes[i])))

    def _valid(self, k: int, has_part) -> int:
        bs = self.block_size
        while k > 0:
            lo = self.first_needed(k * bs)
            missing = next((i for i in range(k - 1, lo - 1, -1) if not has_part(i)), None)
            if missing is None:
                return k
            k = missing  # any hit reaching past `missing` would see it
        return 0

    def admit_need(self, match, num_new_blocks: int, chunk_blocks: int | None = None) -> int:
        """Pages admitting `match` (a PrefixMatch) with `num_new_blocks` more
        takes for parts: the new blocks', and the matched window's unheld ones
        (holding them takes them from the free count). With `chunk_blocks` (the
        most a step writes), the new blocks' parts are counted only as many as
        the sequence holds at once (`most_pages`): what its prompt and reserved
        output will take, not what its first chunk takes; with the window of
        the match's branch kept too where the hit stops short of it (else that
        window is the matched one, counted here already)."""
        self.check_match(match.nodes)
        lo = self.first_needed(match.num_tokens)
        # unheld parts it holds, and parts it reloads from the host (fresh pages)
        revived = sum(1 for n in match.nodes[lo:] if n.block is None or n.block.wpart is None or n.block.wrefs == 0)
        new = (self.pages * num_new_blocks if chunk_blocks is None
               else self.most_pages(num_new_blocks, chunk_blocks, branch=match.branch > len(match.nodes)))
        return new + self.pages * revived

    def most_pages(self, num_blocks: int, chunk_blocks: int = 1, branch: bool = False) -> int:
        """Pages of parts a sequence of `num_blocks` holds at most at once:
        while prefilling, the window before a chunk and the chunk's blocks
        (`chunk_blocks`); while decoding, two windows (its current one and its
        prompt's) and the block it writes; one window more with a `branch`."""
        wb = self.window_blocks()
        return self.pages * min(num_blocks, max(wb + chunk_blocks, 2 * wb + 1) + (wb if branch else 0))

    def check_integrity(self, tables: Iterable[BlockTable], pins: Iterable,
                        filling: Iterable[Block] = ()) -> Counter[int]:
        """Every part's holds equal its holders (`tables`, the live block tables;
        `pins`, the pins; `filling`, the blocks whose part a reload fills). Returns
        the references the parts' pages account for."""
        holders: Counter[int] = Counter(b.block_id for b in filling)
        for st in tables:
            for i, b in st.window.items():
                assert st.blocks[i] is b, f"window part held for block {i} of a table that holds another"
                holders[b.block_id] += 1
        for p in pins:
            holders.update(b.block_id for b in p.window)
        pages: Counter[int] = Counter()
        parts = 0
        for b in self.pool.blocks:
            want = holders.get(b.block_id, 0)
            assert b.wrefs == want, f"{b}: window holds {b.wrefs}, holders {want}"
            if b.wpart is None:
                assert b.wrefs == 0, f"{b} held for a window part it lacks"
                assert b.block_id not in self._free
                continue
            parts += 1
            pages.update(p.block_id for p in b.wpart)
            assert len(b.wpart) == self.pages
            for p in b.wpart:
                assert p.ref_cnt == 1 and p.node is None and p.wpart is None, f"{p} of {b}'s part is shared"
            if b.wrefs == 0:
                assert self._free.get(b.block_id, (None,))[0] is b, f"{b}'s unheld part is not evictable"
                assert b.node is not None, f"{b}'s unheld part outlived its index entry"
            else:
                assert b.block_id not in self._free
        assert parts == self.num_parts, f"{self.num_parts} parts counted, {parts} found"
        return pages
