"""The KV cache manager: the only KV API the scheduler sees.

match -> admit (a new block table for the request) -> allocate_slots as it
grows -> commit after each step -> free, pin, or swap out at the end of a
turn. A block table lives on its request (kv/block_table.py); the manager keeps
no map of requests, only the block pool, the prefix index, the host tier and
the pins. Pins hold a finished request's blocks for its program until they are
released, expire or are reclaimed; the manager never decides when, the
scheduler and its policy do. Copies between tiers count only once the
executor confirms them (kv/copies.py); `cut_unloaded` shrinks a request whose
reload failed to what really holds KV. Chains no turn will match again go to
the cold end of eviction (kv/dead_chains.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence

from agentserve.kv.block import Block
from agentserve.kv.block_pool import BlockPool
from agentserve.kv.block_table import BlockTable
from agentserve.kv.copies import CopyQueue
from agentserve.kv.dead_chains import DeadChains
from agentserve.kv.disk_tier import DiskCopies, DiskTier
from agentserve.kv.eviction import make_strategy
from agentserve.kv.executor_copies import ExecutorCopies
from agentserve.kv.host_tier import HostTier
from agentserve.kv.pins import PinTable
from agentserve.kv.prefix_index import ChainHint, PrefixIndex
from agentserve.kv.prefix_match import PrefixMatch
from agentserve.kv.stage_copies import StageCopies
from agentserve.kv.window_tier import WindowTier


class KVCacheManager(DeadChains, ExecutorCopies):
    def __init__(self, num_blocks: int, block_size: int = 16, eviction: str = "lru",
                 host_blocks: int = 0, disk_blocks: int = 0,
                 key_fn: Callable[[tuple[int, ...]], Hashable] | None = None, protected_blocks: int = 0,
                 window: int | None = None, window_pages: int = 0) -> None:
        """`window`: the hybrid cache's (kv/window_parts.py) sliding window, whose
        layers' KV of a block takes `window_pages` more blocks (None: none)."""
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.index = PrefixIndex(block_size, key_fn)
        kwargs = {"capacity": num_blocks} if eviction == "arc" else {}
        if not 0 <= protected_blocks < num_blocks:
            raise ValueError(f"the protected zone must be 0 to {num_blocks - 1} blocks, got {protected_blocks}")
        self.pool = BlockPool(num_blocks, self.index, make_strategy(eviction, **kwargs), self._on_evict,
                              protected_blocks)
        self.host = HostTier(host_blocks, self.index)
        self.pins = PinTable()
        self.copies = CopyQueue(self.pool, self.host)
        self._loading = self.copies.loading
        self.disk = DiskTier(disk_blocks, self.index)  # below the host tier (kv/disk_tier.py)
        self.disk_copies = DiskCopies(self.pool, self.disk)
        if self.disk.enabled:
            self.host.on_evict = self.disk_copies.spill
        self.stages = StageCopies(self.host, self.disk, self.copies, self.disk_copies)  # disk -> host
        if window is not None and disk_blocks:
            raise ValueError("the hybrid KV cache (sliding-window layers) has no disk tier (a host tier it has): "
                             "use the full cache to have one")
        self.parts = None if window is None else self.pool.enable_window_parts(window, window_pages, block_size)
        # the host copies of window parts (kv/window_tier.py)
        self.window_tier = WindowTier(self.parts, self.host, self.copies) if window and host_blocks else None

    # --- sizes ---

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks held by pins (a block two pins share, or one pin holds
        twice, counts once)."""
        return self.pins.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def pages_for(self, num_tokens: int) -> int:
        """Pool blocks one sequence of `num_tokens` takes at most (with the hybrid cache's parts)."""
        n = self.blocks_for(num_tokens)
        return n if self.parts is None else n + self.parts.most_pages(n)

    # --- prefix match and admission ---

    def match(self, token_ids: Sequence[int], salt: Hashable = None, hint: ChainHint | None = None) -> PrefixMatch:
        """The reusable prefix of `token_ids` among blocks indexed under `salt`.
        At least one token is always left to compute: its logits give the first
        output token. `hint`: see `chain_hint` (the same match, found faster)."""
        max_blocks = (len(token_ids) - 1) // self.block_size
        path = self.index.walk(token_ids, max_blocks, salt, hint)
        branch = 0 if self.parts is None else self.parts.branch_of(path, min(max_blocks, len(token_ids) // self.block_size))
        loading, pending, dloading = self._loading, self.host.pending, self.disk_copies.loading
        staging = self.stages.staging
        filling = self.window_tier.filling if self.window_tier is not None else ()
        if not loading and not dloading and not staging and not filling and None not in [node.block for node in path]:
            if self.parts is not None:  # the hybrid cache: as far as the window is there too
                path = path[:self.parts.valid_nodes(path)]
            return PrefixMatch(path, self.block_size, salt, branch=branch)  # all on the device, none reloading: the common case
        nodes = []
        host = disk = 0
        for node in path:
            if ((loading and node in loading) or (dloading and node in dloading) or (staging and node in staging)
                    or (filling and node.block in filling)):
                break  # its reload (or stage, or its part's reload) is not confirmed yet (one copy out of a node at a time)
            if node.block is None:
                if node.host_slot is None or node in pending:
                    if not self.disk.readable(node):
                        break
                    disk += 1
                host += 1
            nodes.append(node)
        if self.parts is not None:
            nodes = nodes[:self.parts.valid_nodes(nodes)]
            host = sum(1 for n in nodes if n.block is None)
        return PrefixMatch(nodes, self.block_size, salt, host, disk, branch)

    def can_admit(self, match: PrefixMatch, num_new_tokens: int) -> bool:
        return self.admit_need(match, num_new_tokens) <= self.pool.num_free

    def admit_need(self, match: PrefixMatch, num_new_tokens: int, chunk_tokens: int | None = None) -> int:
        """Free blocks admitting `match` takes: new ones, and matched ones free now (window_parts.admit_need)."""
        total = self.blocks_for(match.num_tokens + num_new_tokens)
        new = total - len(match.nodes) + match.num_host_blocks
        revived = sum(1 for n in match.nodes if n.block is not None and n.block.ref_cnt == 0)
        if self.parts is not None:
            chunk = None if chunk_tokens is None else self.blocks_for(chunk_tokens) + 1
            new += self.parts.admit_need(match, total - len(match.nodes), chunk)
        return new + revived

    def admit(self, match: PrefixMatch, num_new_tokens: int, now: float, checkpoint: int = 0) -> BlockTable | None:
        """A block table for a waiting request: its matched blocks plus room
        for `num_new_tokens` more. None, with nothing changed, if it does not fit.
        `checkpoint`: the prompt's length (the hybrid cache keeps its window)."""
        if self.admit_need(match, num_new_tokens) > self.pool.num_free:
            return None
        st = BlockTable(salt=match.salt, computed=match.num_tokens, checkpoint=checkpoint,
                        branch=match.branch * self.block_size)
        held = [n.block for n in match.nodes]
        if None not in held and (self.parts is None or self.parts.all_present(held, match.num_tokens)):
            # every matched block is on the device, and the window's parts (no reload): the common case
            self.pool.hit(held, now)
            if self.parts is not None:
                st.blocks = held
                self.parts.sync(st, len(held), now)  # before allocating, which evicts unheld parts
            fresh = self.pool.allocate(self.blocks_for(match.num_tokens + num_new_tokens) - len(held))
            assert fresh is not None  # checked above
            held.extend(fresh)
            st.blocks = held
            st.num_indexed = len(match.nodes)
            st.last_node = match.nodes[-1] if match.nodes else self.index.root
            if self.parts is not None:
                self.parts.sync(st, len(held), now)
            return st
        self.pool.hit([b for b in held if b is not None], now)
        loads = [n for n in match.nodes if n.block is None]
        n_new = self.blocks_for(match.num_tokens + num_new_tokens) - len(match.nodes)
        self._loading.update(n for n in loads if self.host.readable(n))  # not evicted by this allocation
        self.disk_copies.loading.update(n for n in loads if not self.host.readable(n))
        parts = None if self.parts is None else self.window_tier.hold(st, match)  # before allocating
        fresh = self.pool.allocate(len(loads) + n_new)
        assert fresh is not None  # checked above
        it = iter(fresh)
        for n in match.nodes:
            if n.block is None:
                b = next(it)
                self.pool.attach(b, n)
                if self.host.readable(n):
                    self.copies.load(n, b)
                    self.host.touch(n)
                else:
                    self.disk_copies.load(n, b)
            st.blocks.append(n.block)
        st.blocks.extend(it)
        st.loads = [n.block for n in loads]
        st.num_indexed = len(match.nodes)
        st.last_node = match.nodes[-1] if match.nodes else self.index.root
        if parts is not None:
            self.window_tier.fill(st, parts)
            self.parts.sync(st, len(st.blocks), now)
        return st

    def chain_hint(self, token_ids: Sequence[int], st: BlockTable) -> ChainHint | None:
        """What a later `match` of a sequence that extends `token_ids` (a program's
        next turn) needs to take the shared blocks without looking each up: the
        chain `st` indexed them along. Taken before the table is released."""
        node = st.last_node
        if node is None or node is self.index.root:
            return None
        return ChainHint(token_ids, node, st.salt)

    def allocate_slots(self, st: BlockTable, num_tokens_total: int) -> bool:
        """Grow a running request's table to hold `num_tokens_total` tokens."""
        need = self.blocks_for(num_tokens_total) - len(st.blocks)
        if need <= 0:
            return True
        if self.parts is not None and need * (1 + self.parts.pages) > self.pool.num_free:
            return False  # the new blocks with their parts (growing never revives a part)
        fresh = self.pool.allocate(need)
        if fresh is None:
            return False
        st.blocks.extend(fresh)
        if self.parts is not None:
            self.parts.sync(st, len(st.blocks), 0.0)
        return True

    def trim_slots(self, st: BlockTable, num_tokens_total: int, now: float = 0.0) -> int:
        """Shrink a running request's table to `num_tokens_total` tokens (a
        speculative draft's rejected tail). Returns the blocks freed."""
        keep = max(self.blocks_for(num_tokens_total), st.num_indexed)
        extra = st.blocks[keep:]
        if extra:
            if st.window:
                self.parts.release_from(st, keep, now)
            del st.blocks[keep:]
            self.pool.release(extra, now)
        return len(extra)

    def commit(self, st: BlockTable, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Index the request's blocks that became full with computed KV, so
        later requests (this program's next turn, first of all) can hit them.
        Generated tokens are indexed like prompt tokens."""
        bs = self.block_size
        full = min(num_computed_tokens // bs, len(st.blocks))
        if self.parts is not None and not st.released:
            st.computed = num_computed_tokens
            self.parts.sync(st, len(st.blocks), 0.0)  # only releases: the blocks' parts are held
        if full <= st.num_indexed or st.index_stopped or st.released:
            return
        node = st.last_node
        if node is not self.index.root and node.parent is None:
            # The chain ended on another request's block (ours stayed private),
            # which was since evicted and its node pruned: find the chain again,
            # re-creating the missing nodes and giving them our blocks.
            node = self.index.root
            for i in range(st.num_indexed):
                child = self.index.get_or_create(node, tuple(token_ids[i * bs:(i + 1) * bs]), st.salt)
                if child is None:
                    st.index_stopped = True
                    st.last_node = node
                    return
                b = st.blocks[i]
                if child.block is None and b.node is None:
                    self.pool.attach(b, child)
                node = child
        for i in range(st.num_indexed, full):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            child = self.index.get_or_create(node, tokens, st.salt)
            if child is None:
                st.index_stopped = True  # lookup-key collision: the chain cannot continue
                break
            b = st.blocks[i]
            if child.block is None:
                self.pool.attach(b, child)
            elif self.parts is not None and self.parts.takes_over(child.block, b):
                self.pool.hand_over(child.block, b)
            # else: another request computed the same block first; ours stays private.
            if (i + 1) * bs <= st.checkpoint:
                child.prompt = True
            node = child
            st.num_indexed = i + 1
        st.last_node = node

    # --- end of a request ---

    def free(self, st: BlockTable, now: float, protect: str | None = None) -> None:
        """Release the table's blocks (freeing a released table is a no-op).
        `protect`: the live multi-turn program between turns they belong to
        (kv/protected_zone.py)."""
        if not st.released:
            st.released = True
            if st.window:
                self.parts.release_from(st, 0, now)
            self.pool.release(st.blocks, now, protect)

    def swap_out(self, st: BlockTable, now: float, onward: bool = False, protect: str | None = None) -> int:
        """Copy the request's indexed blocks to the host tier now (instead of at
        eviction), then free them. `onward` (a long wait, with a disk tier): its
        host copies are the first the host tier moves on to the disk tier. Returns
        the number of blocks copied."""
        copied = 0
        if not st.released and self.host.enabled:
            onward = onward and self.disk.enabled
            for b in st.blocks[:st.num_indexed]:
                node = b.node
                if node is not None and node.block is b and not self.is_loading(b):
                    if node.host_slot is None:
                        slot = self.host.store(node, self._loading)
                        if slot is None:
                            continue
                        self.copies.offload(b, slot, node)
                        copied += 1
                    if self.window_tier is not None:
                        self.window_tier.store(node, b, self._loading)
                    if onward:
                        self.host.demote(node)
        self.free(st, now, protect)
        return copied

    def pin(self, program_id: str, st: BlockTable, expiry: float, program_arrival: float, now: float) -> None:
        """Hand the finished request's blocks to a pin owned by its program."""
        if st.released:
            raise RuntimeError("pinning a block table that was already released")
        st.released = True
        self.pins.add(program_id, st.blocks, expiry, program_arrival, st.num_indexed * self.block_size,
                      list(st.window.values()))

    def unpin(self, program_id: str, now: float, protect: bool = False) -> int:
        """Release a program's pin; returns the number of blocks it held.
        `protect`: the program goes on (its TTL ran out, or its pin was
        reclaimed), so its freed blocks may enter the protected zone."""
        p = self.pins.pop(program_id)
        if p is None:
            return 0
        if p.window:
            self.parts.release_all(p.window, now)
        self.pool.release(p.blocks, now, program_id if protect else None)
        return len(p.blocks)

    def unprotect(self, program_id: str) -> int:
        """The program ended or was released: its blocks leave the protected zone."""
        return self.pool.unprotect(program_id)

    @property
    def num_protected_blocks(self) -> int:
        return len(self.pool.zone)

    def reclaimable_blocks(self, program_id: str) -> int:
        """Blocks that unpinning `program_id` would return to the free set."""
        return self.pins.reclaimable(program_id, self.pool.blocks)

    # --- copies for the executor ---

    def _on_evict(self, block: Block) -> None:
        node = block.node
        if self.host.enabled and node is not None and node.host_slot is None:
            slot = self.host.store(node, self._loading)
            if slot is not None:
                self.copies.offload(block, slot, node)
        if self.window_tier is not None and node is not None:
            self.window_tier.store(node, block, self._loading)

    # --- checks ---

    def check_integrity(self, tables: Iterable[BlockTable] = ()) -> None:
        """Every block's reference count equals its holders: `tables`, the block
        tables of every request that holds KV (a table missing here shows up as
        leaked blocks), and the pins."""
        tables = list(tables)
        holders: Counter[int] = Counter()
        for st in tables:
            assert not st.released, "a released block table is still in use"
            holders.update(b.block_id for b in st.blocks)
            assert st.num_indexed <= len(st.blocks)
        for p in self.pins.values():
            holders.update(b.block_id for b in p.blocks)
        holders.update(self.copies.held_blocks())  # reloads hold their device blocks until they land
        holders.update(self.disk_copies.held_blocks())
        if self.window_tier is not None:
            holders.update(b.block_id for b in self.window_tier.into_device)  # held while their parts land
        if self.parts is not None:
            filling = () if self.window_tier is None else self.window_tier.filling
            holders.update(self.parts.check_integrity(tables, self.pins.values(), filling))
        self.pool.check_integrity(holders)
        n = 0
        for node in self.index.iter_nodes():
            n += 1
            assert not node.is_empty, "an empty node was not pruned"
            if node.block is not None:
                assert node.block.node is node
            assert node.parent is not None and node.parent.children.get(node.lookup_key) is node
        assert n == self.index.num_nodes, f"index counts {self.index.num_nodes} nodes, found {n}"
        if self.host.enabled:
            self.host.check_integrity()
        self.copies.check_integrity(self.stages.staging)
        self.disk_copies.check_integrity()
        self.stages.check_integrity()
        if self.window_tier is not None:
            self.window_tier.check_integrity()
