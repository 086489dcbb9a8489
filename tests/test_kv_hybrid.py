"""The hybrid KV cache (kv/window_parts.py): a block's window-layer KV lives in
a window part that is kept only while a token can still read it. Hand-made
cases, the memory a long conversation holds each way, and the hypothesis
state machine of test_kv_manager.py driven with window parts, whose fake
executor checks that every step reads the window KV it needs, written by the
tokens it stands for."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize

from agentserve.kv.manager import KVCacheManager
from test_kv_manager import ALL_STRATEGIES, BS, PREFIXES, PROGRAMS, KVMachine, KVModel, Named, collide

W = 6  # window positions: a token reads the 5 before it; with blocks of 4, up to 3 blocks
PAGES = 2  # a window part takes two more blocks


def mk(num_blocks: int = 64, **kw) -> Named:
    return Named(KVCacheManager(num_blocks, BS, window=W, window_pages=PAGES, **kw))


def run(kv: Named, rid: str, tokens, chunk: int = 8, checkpoint: int = 0):
    """Admit `tokens` and compute them chunk by chunk, committing after each."""
    m = kv.match(tokens)
    first = min(chunk, len(tokens) - m.num_tokens)
    table = kv.kv.admit(m, first, 0.0, checkpoint=checkpoint)
    assert table is not None
    kv.tables[rid] = table
    done = m.num_tokens
    while done < len(tokens):
        end = min(done + chunk, len(tokens))
        assert kv.allocate_slots(rid, end)
        kv.commit(rid, tokens, end)
        done = end
        kv.check_integrity()
    return m


def held_pages(kv: Named) -> int:
    return kv.num_blocks - kv.num_free_blocks


def test_a_long_sequence_holds_its_window_not_its_history():
    kv = mk(200)
    toks = list(range(1000, 1160))  # 40 blocks
    run(kv, "a", toks)
    table = kv.tables["a"]
    lo = kv.parts.first_needed(len(toks))
    assert sorted(table.window) == list(range(lo, 40))
    # held: the 40 blocks and the parts of the window's blocks; the parts left behind are free (evictable)
    assert held_pages(kv) == 40 + PAGES * (40 - lo)
    kv.free("a", 1.0)
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_memory_of_a_pinned_program_full_against_hybrid():
    toks = list(range(5000, 5000 + 4 * 100))  # 100 blocks
    full = Named(KVCacheManager(400, BS))
    hyb = mk(400)
    for kv in (full, hyb):
        run(kv, "a", toks, checkpoint=len(toks) - 10)
        kv.pin("p", "a", 10.0, 0.0, 1.0)
        kv.check_integrity()
    # full: one block per block of tokens, in a cache 1 + PAGES times smaller per block
    assert held_pages(full) * (1 + PAGES) == 300
    # hybrid: the blocks, plus the parts of the last window and the prompt's (they overlap here)
    assert held_pages(hyb) - 100 <= PAGES * 2 * kv.parts.window_blocks()
    assert kv.reclaimable_blocks("p") == held_pages(hyb)


def test_next_turn_hits_the_whole_pinned_history():
    kv = mk(200)
    t1 = list(range(100, 150))
    run(kv, "t1", t1, checkpoint=40)
    kv.pin("p", "t1", 10.0, 0.0, 1.0)
    t2 = t1 + [7, 7, 7, 7, 7]
    m = kv.match(t2)
    assert m.num_tokens == 48  # every full block of t1
    run(kv, "t2", t2)
    kv.free("t2", 2.0)
    kv.check_integrity()


def test_hit_stops_where_the_window_is_gone_and_falls_back_to_the_checkpoint():
    kv = mk(200)
    t1 = list(range(100, 180))  # 20 blocks
    run(kv, "t1", t1, checkpoint=40)  # the prompt ended at 40 tokens (10 blocks)
    kv.pin("p", "t1", 10.0, 0.0, 1.0)
    # every unheld part goes (pressure): what remains are the pin's
    while kv.parts.num_free_pages:
        kv.parts.evict_one()
    kv.check_integrity()
    # a next turn that re-renders the reply: it shares t1 up to token 60 (block 15)
    t2 = t1[:60] + [9] * 12
    m = kv.match(t2)
    # block 15's window (blocks 13-14) was dropped: the hit falls back to the prompt's end
    assert m.num_tokens == 40
    run(kv, "t2", t2)
    kv.free("t2", 2.0)
    kv.unpin("p", 3.0)
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_a_rewritten_history_keeps_the_window_where_it_left_the_old_one():
    """Claude Code compacting its conversation: each compacted prompt is the system
    prompt and a new summary. The first one leaves the old conversation's chain at
    the system prompt's end (its `branch`) and keeps that window, so the next one
    hits the whole system prompt after every part nobody holds was evicted."""
    kv = mk(200)
    system = list(range(100, 140))  # 10 blocks
    t0 = system + list(range(500, 540))
    run(kv, "t0", t0, checkpoint=len(t0))
    kv.free("t0", 1.0)
    c1 = system + [7] * 30
    m1 = kv.match(c1)
    assert m1.branch == 10
    run(kv, "c1", c1, checkpoint=len(c1))
    assert kv.tables["c1"].branch == 40
    lo = kv.parts.first_needed(40)
    assert set(range(lo, 10)) <= set(kv.tables["c1"].window)
    kv.pin("p", "c1", 10.0, 0.0, 2.0)
    while kv.parts.num_free_pages:
        kv.parts.evict_one()
    kv.check_integrity()
    c2 = system + [8] * 30
    m2 = kv.match(c2)
    assert m2.num_tokens == 40 and m2.branch == 10
    run(kv, "c2", c2, checkpoint=len(c2))
    kv.free("c2", 3.0)
    kv.unpin("p", 4.0)
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_without_the_branch_window_the_compacted_turn_misses():
    """The same turns where the chain left was a reply, not a prompt: no branch is
    kept, and once the unheld parts are evicted the hit is gone (what the rule buys)."""
    kv = mk(200)
    system = list(range(100, 140))
    t0 = system + list(range(500, 540))
    run(kv, "t0", t0, checkpoint=len(system))  # the tokens after the system prompt were a reply
    kv.free("t0", 1.0)
    c1 = system + [7] * 30
    assert kv.match(c1).branch == 0
    run(kv, "c1", c1, checkpoint=len(c1))
    kv.pin("p", "c1", 10.0, 0.0, 2.0)
    while kv.parts.num_free_pages:
        kv.parts.evict_one()
    assert kv.match(system + [8] * 30).num_tokens == 0
    kv.unpin("p", 3.0)
    kv.check_integrity()


def test_a_turn_that_extends_or_re_renders_the_last_one_keeps_no_branch():
    kv = mk(200)
    t1 = list(range(100, 160))  # a 40-token prompt and a 20-token reply
    run(kv, "t1", t1, checkpoint=40)
    kv.free("t1", 1.0)
    assert kv.match(t1 + [5] * 8).branch == 0  # the next turn appends: the chain simply ends
    assert kv.match(t1[:50] + [9] * 20).branch == 0  # the reply re-rendered: its prompt end is the checkpoint
    m = kv.match(t1[:30] + [9] * 20)  # a prompt that leaves the last one inside its prompt
    assert m.branch == 7
    full = Named(KVCacheManager(200, BS))
    run(full, "t1", t1, checkpoint=40)
    full.free("t1", 1.0)
    assert full.match(t1[:30] + [9] * 20).branch == 0  # only the hybrid cache keeps a window there


def test_an_unheld_part_serves_a_hit_until_evicted():
    kv = mk(200)
    t1 = list(range(100, 180))
    run(kv, "t1", t1)
    kv.free("t1", 1.0)
    assert kv.match(t1[:60] + [1]).num_tokens == 60  # block 15's window is unheld but still there
    kv.parts.evict_one()  # the oldest part: block 0's
    assert kv.match(t1[:60] + [1]).num_tokens == 60
    while kv.parts.num_free_pages:
        kv.parts.evict_one()
    assert kv.match(t1[:60] + [1]).num_tokens == 0
    kv.check_integrity()


def test_allocation_evicts_unheld_parts_before_cached_blocks():
    kv = mk(60)
    t1 = list(range(100, 180))  # 20 blocks, with parts for the last window
    run(kv, "t1", t1)
    kv.free("t1", 1.0)
    cached = sum(1 for b in kv.pool.blocks if b.node is not None)
    assert cached == 20
    # a fresh request needing every free block but the cached ones' count
    need = kv.num_free_blocks - 20
    fresh = [7] * (need // (1 + PAGES) * BS)
    m = kv.match(fresh)
    table = kv.kv.admit(m, len(fresh), 2.0)
    assert table is not None
    assert sum(1 for b in kv.pool.blocks if b.node is not None) == 20  # no cached block evicted
    kv.kv.free(table, 3.0)
    kv.check_integrity()


def test_admit_that_does_not_fit_changes_nothing():
    kv = mk(20)
    toks = list(range(100, 120))  # 5 blocks: 15 pages with their parts
    run(kv, "a", toks)
    free, parts = kv.num_free_blocks, kv.parts.num_parts
    other = list(range(500, 520))
    m = kv.match(other)
    assert kv.kv.admit(m, len(other), 1.0) is None
    assert (kv.num_free_blocks, kv.parts.num_parts) == (free, parts)
    kv.check_integrity()


def test_speculative_trim_releases_the_parts_of_the_blocks_it_drops():
    kv = mk(100)
    toks = list(range(100, 130))
    run(kv, "a", toks)
    assert kv.allocate_slots("a", len(toks) + 12)
    kv.trim_slots("a", len(toks) + 1, 1.0)
    kv.check_integrity()
    kv.free("a", 2.0)
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_supersede_releases_the_pins_parts_of_the_dead_chain():
    kv = mk(200)
    t1 = list(range(100, 180))
    run(kv, "t1", t1, checkpoint=30)
    kv.pin("p", "t1", 10.0, 0.0, 1.0)
    kv.supersede("p", t1, t1[:20] + [5] * 20, 2.0)
    kv.check_integrity()
    kv.unpin("p", 3.0)
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_pages_for_counts_two_windows_of_parts():
    kv = mk(10)
    wb = kv.parts.window_blocks()
    assert kv.pages_for(4) == 1 + PAGES
    assert kv.pages_for(4000) == 1000 + PAGES * (2 * wb + 1)


def test_the_disk_tier_is_refused_under_the_hybrid_cache():
    with pytest.raises(ValueError, match="no disk tier"):
        KVCacheManager(16, BS, host_blocks=4, disk_blocks=8, window=W, window_pages=PAGES)


# ---------------------------------------------------------------- the state machine, with window parts


class HybridModel(KVModel):
    """KVModel on the hybrid cache. The fake executor writes window KV into the
    pages of each block's part (`wdev`), and every step checks that the window
    positions it reads are there, in the parts its table holds."""

    def __init__(self, eviction: str, collisions: bool, num_blocks: int = 48, zone: int = 0, host: int = 0,
                 fail: float = 0.0) -> None:
        super().__init__(eviction, host, collisions, num_blocks=num_blocks, zone=zone, fail=fail)
        self.kv = Named(KVCacheManager(num_blocks, BS, eviction=eviction, key_fn=collide if collisions else None,
                                       protected_blocks=zone, host_blocks=host, window=W, window_pages=PAGES))
        self.wdev: dict[int, list] = {}
        self.whost: dict[int, list] = {}  # host slot -> the window KV written there

    def flush(self):
        """The fake executor's copies, of both kinds of KV: a copy moves whatever
        its source holds (a block's global KV, a part page's window KV); a failed
        one leaves garbage. Then every indexed block, host copy and part copy must
        hold its own tokens."""
        kv = self.kv.kv
        off, ld = kv.take_copies()
        failed_off = [i for i in range(len(off)) if self.rng.random() < self.fail]
        failed_ld = [i for i in range(len(ld)) if self.rng.random() < self.fail]
        for i, (d, h) in enumerate(off):
            self.host[h] = ["torn"] * BS if i in failed_off else list(self.dev.get(d, [None] * BS))
            self.whost[h] = ["torn"] * BS if i in failed_off else list(self.wdev.get(d, [None] * BS))
        for i, (h, d) in enumerate(ld):
            assert h in self.host, "load from a slot nothing was written to"
            self.dev[d] = ["torn"] * BS if i in failed_ld else list(self.host[h])
            self.wdev[d] = ["torn"] * BS if i in failed_ld else list(self.whost[h])
        unloaded = kv.finish_copies(failed_off, failed_ld)
        assert bool(unloaded) == bool(failed_ld)
        for rid, r in self.reqs.items():
            kept = kv.cut_unloaded(self.kv.tables[rid], unloaded, self.now)
            if kept is not None:
                assert kept < r["computed"]
                r["computed"] = kept
        tier = kv.window_tier
        for node in self.kv.index.iter_nodes():
            if node.block is not None:
                assert tuple(self.dev[node.block.block_id]) == node.tokens
                for page in node.block.wpart or ():
                    assert tuple(self.wdev[page.block_id]) == node.tokens, "an indexed block's part is not its KV"
            if node.host_slot is not None:
                assert node not in kv.host.pending
                assert tuple(self.host[node.host_slot]) == node.tokens
                if tier.readable(node):
                    for slot in tier.copies_of[node].slots:
                        assert tuple(self.whost[slot]) == node.tokens, "a part copy is not its block's KV"

    def allocate(self, toks, program):
        super().allocate(toks, program)
        rid = f"r{self.n - 1}"
        if rid in self.reqs:
            st = self.kv.tables[rid]
            st.checkpoint = len(self.reqs[rid]["tokens"])

    def pressure(self, nblocks):
        n = min(nblocks, self.kv.num_free_blocks // (1 + PAGES))
        if n:
            super().pressure(n)

    def compute(self, rid, frac, gen):
        r = self.reqs.get(rid)
        if r is None:
            return
        self.flush()  # the reloads its admission queued land first (a failed one cuts it back)
        toks = r["tokens"]
        start = r["computed"]
        n = max(1, round((len(toks) - start) * frac)) if len(toks) > start else 0
        end = start + n
        if not self.kv.allocate_slots(rid, end):
            return
        self.flush()  # as the executor runs a step's copies (offloads of what it evicted) before its forward pass
        st = self.kv.tables[rid]
        for pos in range(max(0, start - W + 1), start):  # what the window layers read
            b = st.blocks[pos // BS]
            assert b.wpart is not None and st.window.get(pos // BS) is b, (rid, pos, "window part not held")
            for page in b.wpart:
                assert self.wdev[page.block_id][pos % BS] == toks[pos], (rid, pos)
        for pos in range(start, end):
            b = st.blocks[pos // BS]
            assert b.wpart is not None and st.window.get(pos // BS) is b, (rid, pos, "no part to write to")
            for page in b.wpart:
                self.wdev.setdefault(page.block_id, [None] * BS)[pos % BS] = toks[pos]
        super().compute(rid, 0.0 if n == 0 else n / max(1, len(toks) - start), gen)

    def check(self):
        kv = self.kv
        kv.check_integrity()
        holders: Counter[int] = Counter()
        for rid in self.reqs:
            holders.update(kv.block_ids(rid))
        for p in kv.pins.values():
            holders.update(set(b.block_id for b in p.blocks))
        holders.update(kv.copies.held_blocks())  # a reload holds its block until it lands
        if kv.window_tier is not None:  # a block whose part reloads alone is held until it lands
            holders.update(b.block_id for b in kv.window_tier.into_device)
        held_parts = sum(1 for b in kv.pool.blocks if b.wpart is not None and b.wrefs > 0)
        assert kv.num_free_blocks + len(holders) + PAGES * held_parts == kv.num_blocks
        # a hit never needs a window part that is gone
        for toks in PREFIXES:
            m = kv.match(toks + [0])
            lo = kv.parts.first_needed(m.num_tokens)
            assert all((n.block is not None and n.block.wpart is not None)
                       or (kv.window_tier is not None and kv.window_tier.readable(n)) for n in m.nodes[lo:])


class HybridMachine(KVMachine):
    @initialize(eviction=st.sampled_from(ALL_STRATEGIES), collisions=st.booleans(), zone=st.sampled_from([0, 6]),
                host=st.sampled_from([0, 30]), fail=st.sampled_from([0.0, 0.3]))
    def setup(self, eviction, collisions, zone, host, fail):
        self.m = HybridModel(eviction, collisions, zone=zone, host=host, fail=fail)


HybridMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=80, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestHybridMachine = HybridMachine.TestCase


@pytest.mark.parametrize("eviction", ALL_STRATEGIES)
@pytest.mark.parametrize("zone,host,fail", [(0, 0, 0.0), (6, 0, 0.0), (0, 30, 0.0), (6, 30, 0.2)])
def test_long_randomized_sequences_hybrid(eviction, zone, host, fail):
    rng = random.Random(f"hybrid-{eviction}-{zone}-{host}-{fail}")
    m = HybridModel(eviction, collisions=False, num_blocks=40, zone=zone, host=host, fail=fail)
    for step in range(2500):
        ops = ["allocate", "expire", "pressure"]
        if m.reqs:
            ops += ["allocate_like", "grow", "compute", "compute", "compute", "compute", "free", "pin"]
            if host:
                ops += ["swap_out", "flush", "prefetch"]
        if m.kv.pins:
            ops.append("unpin")
        if m.history:
            ops.append("supersede")
        op = rng.choice(ops)
        rid = rng.choice(sorted(m.reqs)) if m.reqs else None
        if op == "allocate":
            m.allocate(rng.choice(PREFIXES) + [rng.randrange(4) for _ in range(rng.randrange(15))],
                       rng.choice(PROGRAMS))
        elif op == "allocate_like":
            toks = m.reqs[rid]["tokens"]
            m.allocate(toks[:rng.randrange(len(toks) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(6))],
                       rng.choice(PROGRAMS))
        elif op == "pressure":
            m.pressure(rng.randrange(1, 12))
        elif op == "grow":
            m.grow(rid, rng.randrange(1, 13))
        elif op == "compute":
            m.compute(rid, rng.random(), rng.randrange(4))
        elif op == "free":
            m.free(rid)
        elif op == "pin":
            m.pin(rid, rng.uniform(0, 3))
        elif op == "unpin":
            m.unpin(rng.choice(sorted(m.kv.pins)))
        elif op == "expire":
            m.expire(rng.uniform(0, 2))
        elif op == "swap_out":
            m.swap_out(rid)
        elif op == "flush":
            m.flush()
        elif op == "prefetch":
            m.prefetch(rng.choice(PREFIXES) if rng.random() < 0.5 else m.reqs[rid]["tokens"])
        else:
            m.supersede(rng.choice(sorted(m.history)), rng.random(), [rng.randrange(4) for _ in range(rng.randrange(6))])
        m.check()
        if step % 500 == 499:
            m.drain()
    m.drain()
    if host:  # the host tier was used: parts went there and came back with their blocks
        assert m.kv.window_tier.num_stored and m.kv.window_tier.num_reloaded
        assert not fail or m.kv.copies.num_failed


# ---------------------------------------------------------------- the host tier under the hybrid cache


def _swapped_out_turn(kv: Named, toks, checkpoint: int, unheld_gone: bool = False):
    """A turn computed, swapped out to the host, its device blocks and parts evicted by other traffic.
    `unheld_gone`: the parts it no longer held were evicted before it was swapped out."""
    run(kv, "t1", toks, checkpoint=checkpoint)
    while unheld_gone and kv.parts.num_free_pages:
        kv.parts.evict_one()
    kv.swap_out("t1", 1.0)
    kv.take_copies()  # every copy succeeds
    other = [7] * (kv.num_free_blocks // (1 + PAGES) * BS)  # other traffic takes every free page
    table = kv.kv.admit(kv.match(other), len(other), 1.5)
    kv.kv.free(table, 1.5)
    kv.take_copies()
    assert all(b.node is None for b in kv.pool.blocks)  # nothing of t1 on the device
    kv.check_integrity()


def test_a_swapped_out_turn_is_hit_through_the_host_with_its_window():
    kv, t1 = _turn_below(_swapped_out_turn)
    t2 = t1 + [5, 5, 5]
    m = kv.match(t2)
    assert m.num_tokens == 80 and m.num_host_blocks == 20  # the whole history, its window from part copies
    table = kv.kv.admit(m, len(t2) - 80, 2.0)
    off, ld = kv.kv.take_copies()
    wb = kv.parts.window_blocks()
    # every block, and the parts of the blocks the first new token reads
    assert len(ld) == 20 + PAGES * (20 - kv.parts.first_needed(80)) and len(ld) <= 20 + PAGES * wb
    assert sorted(table.window) == list(range(kv.parts.first_needed(80), len(table.blocks)))
    kv.kv.check_integrity([table])
    kv.kv.finish_copies()
    kv.kv.free(table, 3.0)
    kv.check_integrity()


def test_parts_evicted_before_their_blocks_are_written_back_with_them():
    kv, t1 = _turn_below(_swapped_out_turn, unheld_gone=True)
    # the parts the turn no longer held went first, each copied to the host with its block:
    # a next turn that re-renders the reply (sharing t1 up to token 60) still finds block 15's window
    m = kv.match(t1[:60] + [9] * 8)
    assert m.num_tokens == 60 and m.num_host_blocks == 15
    assert len(kv.window_tier.copies_of) == 20  # every block's part: held ones at the swap-out, the rest before


def test_a_hit_through_the_host_stops_before_a_part_copy_that_is_gone():
    kv, t1 = _turn_below(_swapped_out_turn)
    for node in [n for n in kv.window_tier.copies_of if n.tokens == tuple(t1[52:56])]:
        kv.window_tier.forget(node)  # block 13's part copy is gone (its host entry stays)
    m = kv.match(t1[:60] + [9] * 8)
    assert m.num_tokens == 52 and m.num_host_blocks == 13  # block 15's window lacks it: up to block 13
    kv.check_integrity()


def test_a_failed_part_reload_cuts_the_request_back_before_its_window():
    kv, t1 = _turn_below(_swapped_out_turn)
    t2 = t1 + [5, 5, 5]
    table = kv.kv.admit(kv.match(t2), 3, 2.0)
    _, ld = kv.kv.take_copies()
    page_ids = {p.block_id for b in table.blocks for p in b.wpart or ()}
    failed = [i for i, (_, d) in enumerate(ld) if d in page_ids][-1:]  # one page of the last block's part
    bad = kv.kv.finish_copies(failed_loads=failed)
    assert bad == {table.blocks[19].block_id}
    kept = kv.kv.cut_unloaded(table, bad, 3.0)
    # block 19 is recomputed, and so from where its window (blocks 17-18's parts) is whole: token 76
    assert kept == kv.parts.valid_hit(table.blocks[:19]) * BS and kept <= 76
    assert len(table.blocks) == kept // BS
    kv.kv.check_integrity([table])
    # the failed node's copies are not trusted again; the blocks before it are on the device, the
    # parts of their window (evicted or never reloaded) come back from their host copies
    assert kv.match(t2).num_tokens == 76
    kv.kv.free(table, 4.0)
    kv.check_integrity()


def test_a_part_copy_is_freed_with_its_host_entry():
    kv, t1 = _turn_below(_swapped_out_turn)
    assert kv.host.num_lent == PAGES * len(kv.window_tier.copies_of) > 0
    for node in list(kv.window_tier.copies_of):
        kv.host.drop(node)
    assert kv.host.num_used == 0 and kv.host.num_lent == 0
    kv.check_integrity()


def _parts_evicted_blocks_kept(kv: Named, toks, checkpoint: int):
    """A turn computed and ended; every unheld part then evicted (each written to the host with its
    block), the blocks themselves left on the device."""
    run(kv, "t1", toks, checkpoint=checkpoint)
    kv.free("t1", 1.0)
    while kv.parts.num_free_pages:
        kv.parts.evict_one()
    kv.take_copies()  # the write-backs succeed
    assert all(n.block is not None and n.block.wpart is None for n in kv.index.iter_nodes())
    kv.check_integrity()


def _turn_below(state, **kw) -> tuple[Named, list[int]]:
    """A 60-block cache over a host tier, and an 80-token turn (20 blocks; its prompt ended at 40
    tokens) left there by `state` (`_swapped_out_turn` or `_parts_evicted_blocks_kept`)."""
    kv = mk(60, host_blocks=100)
    t1 = list(range(100, 180))
    state(kv, t1, 40, **kw)
    return kv, t1


def test_a_part_evicted_from_a_block_on_the_device_comes_back_alone():
    kv, t1 = _turn_below(_parts_evicted_blocks_kept)
    t2 = t1 + [5, 5, 5]
    m = kv.match(t2)
    assert m.num_tokens == 80 and m.num_host_blocks == 0  # every block on the device, the window's parts on the host
    kv.tables["t2"] = table = kv.kv.admit(m, 3, 2.0)
    lo = kv.parts.first_needed(80)
    assert kv.kv.loads_pending(table) and table.loads == table.blocks[lo:20]  # it computes once they land
    assert kv.match(t2).num_tokens <= lo * BS  # no other request reads a part still being filled
    off, ld = kv.kv.take_copies()
    assert not off and len(ld) == PAGES * (20 - lo)  # the parts alone, no block
    kv.check_integrity()
    kv.kv.finish_copies()
    assert not kv.kv.loads_pending(table) and sorted(table.window) == list(range(lo, len(table.blocks)))
    kv.check_integrity()
    kv.free("t2", 3.0)
    kv.check_integrity()


def test_a_failed_part_reload_into_a_block_on_the_device_cuts_the_request_back():
    kv, t1 = _turn_below(_parts_evicted_blocks_kept)
    t2 = t1 + [5, 5, 5]
    kv.tables["t2"] = table = kv.kv.admit(kv.match(t2), 3, 2.0)
    _, ld = kv.kv.take_copies()
    bad = kv.kv.finish_copies(failed_loads=[len(ld) - 1])  # a page of the last block's part
    assert bad == {table.blocks[19].block_id}
    kept = kv.kv.cut_unloaded(table, bad, 3.0)
    assert kept is not None and kept < 76
    kv.check_integrity()
    assert kv.match(t2).num_tokens <= 76  # the failed node's copies are not trusted again
    kv.free("t2", 4.0)
    kv.check_integrity()


# ---------------------------------------------------------------- a prefetch under the hybrid cache


def test_a_prefetch_brings_a_swapped_out_chain_back_with_its_window():
    from agentserve.kv.prefetch_loads import chain_reload, landed, load_chain

    kv, t1 = _turn_below(_swapped_out_turn)
    t2 = t1 + [5, 5, 5]
    r = chain_reload(kv.kv, kv.index.walk(t2))
    lo = kv.parts.first_needed(80)
    assert len(r.nodes) == 20 and r.parts == r.nodes[lo:]  # every block, and the window's parts
    assert r.taken == r.need == 20 + PAGES * (20 - lo)
    loads = load_chain(kv.kv, r, 2.0)
    assert [n for n, _ in loads] == r.nodes and not landed(kv.kv, loads)
    assert kv.match(t2).num_tokens == 0  # nothing is matched while its reload is under way
    kv.check_integrity()
    _, ld = kv.kv.take_copies()
    assert len(ld) == r.taken
    kv.kv.finish_copies()
    kv.check_integrity()
    assert landed(kv.kv, loads)
    m = kv.match(t2)
    assert m.num_tokens == 80 and m.num_host_blocks == 0  # on the device, window and all
    assert kv.parts.all_present([n.block for n in m.nodes], 80)
    table = kv.kv.admit(m, 3, 3.0)
    assert not table.loads and not kv.kv.take_copies()[1]  # the turn reloads nothing
    kv.tables["t2"] = table
    kv.check_integrity()
    kv.free("t2", 4.0)
    kv.check_integrity()


def test_a_prefetch_brings_back_the_parts_a_block_on_the_device_lost():
    from agentserve.kv.prefetch_loads import chain_reload, landed, load_chain

    kv, t1 = _turn_below(_parts_evicted_blocks_kept)
    t2 = t1 + [5, 5, 5]
    r = chain_reload(kv.kv, kv.index.walk(t2))
    lo = kv.parts.first_needed(80)
    assert not r.nodes and len(r.parts) == 20 - lo and r.taken == PAGES * (20 - lo)
    loads = load_chain(kv.kv, r, 2.0)
    assert [b for _, b in loads] == [n.block for n in r.parts] and not landed(kv.kv, loads)
    assert kv.match(t2).num_tokens <= lo * BS  # no hit reads a part still being filled
    _, ld = kv.kv.take_copies()
    assert len(ld) == PAGES * (20 - lo)
    kv.kv.finish_copies()
    kv.check_integrity()
    assert landed(kv.kv, loads) and all(b.wpart is not None and b.wrefs == 0 for _, b in loads)  # free, unheld
    m = kv.match(t2)
    assert m.num_tokens == 80 and kv.parts.all_present([n.block for n in m.nodes], 80)


def test_a_prefetch_that_does_not_fit_changes_nothing_under_the_hybrid_cache():
    from agentserve.kv.prefetch_loads import chain_reload, load_chain

    kv, t1 = _turn_below(_swapped_out_turn)
    r = chain_reload(kv.kv, kv.index.walk(t1 + [5]))
    other = [8] * ((kv.num_free_blocks - r.need) // (1 + PAGES) * BS + BS)  # leaves less than it needs
    kv.tables["o"] = kv.kv.admit(kv.match(other), len(other), 2.0)
    assert kv.num_free_blocks < r.need
    kv.take_copies()
    before = (kv.num_free_blocks, len(kv.window_tier.filling), len(kv.host.reading))
    assert load_chain(kv.kv, r, 2.5) is None
    assert (kv.num_free_blocks, len(kv.window_tier.filling), len(kv.host.reading)) == before
    assert not kv.copies.loading and not kv.disk_copies.loading
    kv.check_integrity()
