"""KVCacheManager: prefix matching, admission, commit, free, pins, the host
tier and every eviction strategy, on hand-made cases, plus a hypothesis state
machine that tracks block *contents* (what a fake executor wrote into each
device block and host slot) so a false prefix hit or a lost copy shows up as
wrong KV, not only as broken accounting."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from agentserve.kv.eviction import STRATEGIES
from agentserve.kv.block_table import BlockTable
from agentserve.kv.manager import KVCacheManager

ALL_STRATEGIES = sorted(STRATEGIES)
BS = 4


class Named:
    """The manager under test, with requests named as the cases name them. The
    manager keeps no requests (a block table lives on its request); here each
    name's table is kept in `tables`, which check_integrity is given, so a table
    dropped without being freed shows up as leaked blocks."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.tables: dict[str, BlockTable] = {}

    def __getattr__(self, name):
        return getattr(self.kv, name)

    def admit(self, rid: str, match, num_new_tokens: int, now: float) -> bool:
        if rid in self.tables:
            raise RuntimeError(f"{rid} already holds KV")
        table = self.kv.admit(match, num_new_tokens, now)
        if table is not None:
            self.tables[rid] = table
        return table is not None

    def allocate_slots(self, rid: str, n: int) -> bool:
        return self.kv.allocate_slots(self.tables[rid], n)

    def trim_slots(self, rid: str, n: int, now: float = 0.0) -> int:
        return self.kv.trim_slots(self.tables[rid], n, now)

    def commit(self, rid: str, tokens, computed: int) -> None:
        self.kv.commit(self.tables[rid], tokens, computed)

    def free(self, rid: str, now: float, protect: str | None = None) -> None:
        table = self.tables.pop(rid, None)
        if table is not None:
            self.kv.free(table, now, protect)

    def swap_out(self, rid: str, now: float, protect: str | None = None) -> int:
        table = self.tables.pop(rid, None)
        return 0 if table is None else self.kv.swap_out(table, now, protect=protect)

    def pin(self, program_id: str, rid: str, expiry: float, program_arrival: float, now: float) -> None:
        self.kv.pin(program_id, self.tables.pop(rid), expiry, program_arrival, now)

    def take_copies(self):
        """Hand the queued copies to an executor for which every copy succeeds."""
        copies = self.kv.take_copies()
        self.kv.finish_copies()
        return copies

    def block_ids(self, rid: str) -> list[int]:
        return self.tables[rid].block_ids

    def num_blocks_of(self, rid: str) -> int:
        table = self.tables.get(rid)
        return len(table) if table is not None else 0

    def check_integrity(self) -> None:
        self.kv.check_integrity(self.tables.values())


def mk(num_blocks: int = 16, block_size: int = BS, **kw) -> Named:
    return Named(KVCacheManager(num_blocks, block_size, **kw))


def admit(kv: Named, rid: str, tokens, now: float = 0.0, extra: int = 0):
    """match + admit room for all of `tokens` (plus `extra`); returns the match (None if it did not fit)."""
    m = kv.match(tokens)
    ok = kv.admit(rid, m, len(tokens) - m.num_tokens + extra, now)
    return m if ok else None


def compute(kv: Named, rid: str, tokens) -> None:
    """Pretend the whole of `tokens` was computed and commit it."""
    assert kv.allocate_slots(rid, len(tokens))
    kv.commit(rid, tokens, len(tokens))


def in_use(kv: Named) -> set[int]:
    ids = set()
    for rid in kv.tables:
        ids.update(kv.block_ids(rid))
    for p in kv.pins.values():
        ids.update(b.block_id for b in p.blocks)
    return ids


def accounting_ok(kv: Named) -> None:
    kv.check_integrity()
    assert kv.num_free_blocks + len(in_use(kv)) == kv.num_blocks


# ---------------------------------------------------------------- basics


def test_round_trip_match_admit_commit_free():
    kv = mk(16)
    toks = list(range(10))  # 2 full blocks + 2 tokens
    m = admit(kv, "a", toks)
    assert m is not None and m.num_tokens == 0
    assert kv.num_blocks_of("a") == 3
    assert kv.num_free_blocks == 13
    assert len(set(kv.block_ids("a"))) == 3
    kv.commit("a", toks, 10)
    accounting_ok(kv)
    assert kv.index.num_nodes == 2  # the partial third block is not indexed
    kv.free("a", 1.0)
    accounting_ok(kv)
    assert kv.num_free_blocks == 16
    assert kv.pool.num_cached_free == 2
    kv.free("a", 1.0)  # freeing twice is a no-op
    accounting_ok(kv)


def test_prefix_hit_on_freed_request():
    kv = mk(16)
    toks = list(range(10))
    admit(kv, "a", toks)
    compute(kv, "a", toks)
    a_blocks = kv.block_ids("a")
    kv.free("a", 1.0)
    follow = toks + [77, 78, 79]
    m = kv.match(follow)
    assert m.num_tokens == 8 and m.num_host_blocks == 0
    assert kv.can_admit(m, len(follow) - 8)
    assert kv.admit("b", m, len(follow) - 8, 2.0)
    assert kv.block_ids("b")[:2] == a_blocks[:2]  # revived without copying
    assert kv.pool.blocks[a_blocks[0]].hits == 1
    accounting_ok(kv)
    # a diverging prompt only hits the common full blocks
    m2 = kv.match(list(range(4)) + [99, 99, 99, 99, 5])
    assert m2.num_tokens == 4


def test_generated_tokens_are_indexed():
    kv = mk(16)
    prompt = [5, 6, 7, 8, 9, 10]
    req = list(prompt)
    admit(kv, "a", req, extra=0)
    computed = 0
    for out_tok in [20, 21, 22, 23, 24, 25, 26]:
        # the step computes every token not yet computed, samples one more
        assert kv.allocate_slots("a", len(req))
        computed = len(req)
        kv.commit("a", req, computed)
        req.append(out_tok)
        accounting_ok(kv)
    # 13 tokens, 12 computed: 3 full blocks are indexed
    assert computed == 12 and len(req) == 13
    kv.free("a", 1.0)
    follow = req + [40, 41, 42, 43, 44]
    m = kv.match(follow)
    assert m.num_tokens == (computed // BS) * BS == 12
    for i, node in enumerate(m.nodes):
        assert list(node.tokens) == follow[i * BS:(i + 1) * BS]


def test_match_never_covers_last_token():
    kv = mk(16)
    toks = list(range(8))  # exactly two full blocks
    admit(kv, "a", toks)
    compute(kv, "a", toks)
    kv.free("a", 0.0)
    assert kv.match(toks).num_tokens == 4
    assert kv.match(toks[:5]).num_tokens == 4
    assert kv.match(toks[:4]).num_tokens == 0
    assert kv.match(toks + [1]).num_tokens == 8
    assert kv.match([0]).num_tokens == 0
    # admitting an exact repeat leaves one token (at least) to compute
    m = kv.match(toks)
    assert kv.admit("b", m, len(toks) - m.num_tokens, 1.0)
    assert kv.num_blocks_of("b") == 2
    accounting_ok(kv)


def test_admit_that_does_not_fit_changes_nothing():
    kv = mk(8)
    a = list(range(20))  # 5 blocks
    admit(kv, "a", a)
    compute(kv, "a", a)
    kv.free("a", 0.0)  # 5 cached free blocks
    admit(kv, "x", [100, 101, 102, 103, 104])  # 2 blocks in use
    accounting_ok(kv)
    free_before, nodes_before = kv.num_free_blocks, kv.index.num_nodes
    hits_before = [b.hits for b in kv.pool.blocks]
    big = a[:8] + list(range(200, 230))  # hits 2 blocks, needs 10 in all
    m = kv.match(big)
    assert m.num_tokens == 8
    assert not kv.can_admit(m, len(big) - 8)
    assert kv.admit("b", m, len(big) - 8, 1.0) is False
    assert kv.num_free_blocks == free_before
    assert kv.index.num_nodes == nodes_before
    assert [b.hits for b in kv.pool.blocks] == hits_before
    assert kv.num_blocks_of("b") == 0
    assert kv.take_copies() == ([], [])
    accounting_ok(kv)
    # the cached blocks are still matchable after the refusal
    assert kv.match(big).num_tokens == 8
    with pytest.raises(RuntimeError):
        kv.admit("x", kv.match([1, 2]), 2, 1.0)  # already holds KV


def test_allocate_slots_failure_changes_nothing():
    kv = mk(4)
    admit(kv, "a", list(range(8)))  # 2 blocks
    assert not kv.allocate_slots("a", 8 + 3 * BS)
    assert kv.num_blocks_of("a") == 2 and kv.num_free_blocks == 2
    assert kv.allocate_slots("a", 16)
    assert kv.num_free_blocks == 0
    assert kv.allocate_slots("a", 10)  # shrinking asks nothing
    accounting_ok(kv)


def test_pin_holds_blocks_and_unpin_returns_them():
    kv = mk(8)
    toks = list(range(10))
    admit(kv, "a", toks)
    compute(kv, "a", toks)
    held = kv.block_ids("a")
    kv.pin("P", "a", expiry=10.0, program_arrival=0.0, now=1.0)
    assert kv.num_blocks_of("a") == 0
    assert kv.num_pinned_blocks == 3
    assert kv.pins["P"].num_tokens == 8
    assert kv.num_free_blocks == 5
    accounting_ok(kv)
    # pinned blocks are not evictable: fill every free block with other content
    other = list(range(100, 100 + 5 * BS))
    assert admit(kv, "x", other) is not None
    assert kv.num_free_blocks == 0
    assert not set(held) & set(kv.block_ids("x"))
    compute(kv, "x", other)
    kv.free("x", 2.0)
    accounting_ok(kv)
    assert kv.reclaimable_blocks("P") == 3
    assert kv.match(toks + [1]).num_tokens == 8
    assert kv.unpin("P", 3.0) == 3
    assert kv.unpin("P", 3.0) == 0
    assert kv.reclaimable_blocks("P") == 0
    assert kv.num_free_blocks == 8
    accounting_ok(kv)


def test_reclaimable_blocks_counts_shared_blocks_once():
    kv = mk(16)
    prefix = list(range(8))
    admit(kv, "a", prefix + [50, 51])
    compute(kv, "a", prefix + [50, 51])
    # b shares a's two full prefix blocks
    m = admit(kv, "b", prefix + [60, 61, 62])
    assert m.num_tokens == 8
    kv.pin("P", "a", 10.0, 0.0, 1.0)
    # b still uses the prefix: only a's private third block would come back
    assert kv.reclaimable_blocks("P") == 1
    # the same program pins b as well: one pin, the prefix referenced twice by it
    kv.pin("P", "b", 20.0, 0.0, 1.0)
    assert kv.pins["P"].expiry == 20.0
    assert len(kv.pins["P"].blocks) == 6 and kv.num_pinned_blocks == 4
    accounting_ok(kv)
    free_before = kv.num_free_blocks
    expected = kv.reclaimable_blocks("P")
    kv.unpin("P", 2.0)
    assert kv.num_free_blocks - free_before == expected == 4
    accounting_ok(kv)


# ---------------------------------------------------------------- superseded history


@pytest.mark.parametrize("eviction", ALL_STRATEGIES)
def test_superseded_history_leaves_the_pin_and_is_evicted_first(eviction):
    """P's next turn keeps only the first 2 of its 5 history blocks: the other 3
    (and the pin's partial last block) leave P's pin at once and are evicted
    before Q's blocks, freed earlier, whatever the strategy."""
    kv = mk(12, eviction=eviction)
    q = list(range(500, 500 + 3 * BS + 1))
    admit(kv, "q", q)
    compute(kv, "q", q)
    kv.free("q", 0.0)
    p = list(range(5 * BS + 2))  # 5 full blocks and a partial one
    admit(kv, "p", p)
    compute(kv, "p", p)
    kv.pin("P", "p", expiry=100.0, program_arrival=0.0, now=1.0)
    assert len(kv.pins["P"].blocks) == 6
    rewritten = p[:2 * BS] + [900, 901, 902, 903, 904]
    assert kv.supersede("P", p, p + [7, 7, 7], now=2.0) == 0  # extends its history: nothing happens
    assert kv.supersede("P", p, rewritten, now=2.0) == 3
    accounting_ok(kv)
    assert len(kv.pins["P"].blocks) == 2 and kv.pins["P"].num_tokens == 2 * BS
    assert kv.reclaimable_blocks("P") == 2
    # 12 blocks: 3 Q, 2 pinned, 3 superseded, 4 empty; take 7
    fresh = list(range(2000, 2000 + 7 * BS - 1))
    assert admit(kv, "f", fresh) is not None
    accounting_ok(kv)
    assert kv.match(q).num_tokens == 3 * BS  # Q's older blocks all stayed
    assert kv.match(p).num_tokens == 2 * BS  # P's superseded chain is gone
    assert kv.pool.num_demoted == 3


def test_superseded_block_revived_by_a_hit_leaves_the_cold_list():
    kv = mk(8)
    p = list(range(4 * BS))
    admit(kv, "p", p)
    compute(kv, "p", p)
    kv.free("p", 1.0)
    assert kv.supersede("P", p, p[:BS] + [99] * BS, now=2.0) == 3
    # another program still wants the old chain: the hit takes the blocks off the cold list
    m = admit(kv, "r", p + [1])
    assert m.num_tokens == 4 * BS
    accounting_ok(kv)
    kv.free("r", 3.0)
    accounting_ok(kv)
    assert kv.pool.num_cached_free == 4 and kv.num_free_blocks == 8


def test_superseded_host_copies_are_evicted_first():
    kv = mk(4, host_blocks=4)
    old = list(range(2 * BS + 1))
    other = list(range(300, 300 + 2 * BS + 1))
    for rid, toks in (("o", other), ("p", old)):  # other's copies are older on the host
        admit(kv, rid, toks)
        compute(kv, rid, toks)
        kv.free(rid, 1.0)
    filler = list(range(1000, 1000 + 4 * BS - 1))
    admit(kv, "f", filler)  # evicts the cached device blocks: all four on the host now
    compute(kv, "f", filler)
    kv.free("f", 2.0)
    kv.take_copies()
    assert kv.host.num_used == 4
    assert kv.supersede("P", old, [5] * (3 * BS), now=3.0) == 0  # no device block of it left
    g = list(range(2000, 2000 + 3 * BS - 1))
    admit(kv, "g", g)  # evicts two of f's blocks to the host: two host slots must go
    kv.take_copies()
    accounting_ok(kv)
    assert kv.match(other + [0]).num_host_blocks == 2  # other's copies kept, old's dropped
    assert kv.match(old + [0]).num_tokens == 0


def test_dead_kv_is_dropped_not_written_to_the_tier_below():
    """A superseded chain evicted from the device is not offloaded to the host
    tier (no turn reads it again); the live blocks evicted beside it are."""
    kv = mk(4, host_blocks=8)
    old = list(range(3 * BS + 1))
    admit(kv, "p", old)
    compute(kv, "p", old)
    kv.free("p", 1.0)
    assert kv.supersede("P", old, old[:BS] + [9] * (2 * BS), now=2.0) == 2
    filler = list(range(1000, 1000 + 4 * BS - 1))
    admit(kv, "f", filler)  # evicts all three cached blocks
    offloads, _ = kv.take_copies()
    assert len(offloads) == 1  # the live first block only
    kv.finish_copies()
    accounting_ok(kv)
    assert kv.match(old + [0]).num_host_blocks == 1


def test_a_dead_host_copy_is_not_spilled_unless_a_turn_revives_it():
    kv = mk(4, host_blocks=4, disk_blocks=8)
    a = list(range(2 * BS + 1))
    b = list(range(300, 300 + 2 * BS + 1))
    for rid, toks in (("a", a), ("b", b)):
        admit(kv, rid, toks)
        compute(kv, rid, toks)
        kv.free(rid, 1.0)
    filler = list(range(1000, 1000 + 4 * BS - 1))
    admit(kv, "f", filler)  # a's and b's blocks go to the host tier
    compute(kv, "f", filler)
    kv.free("f", 2.0)
    kv.take_copies()
    kv.finish_copies()
    assert kv.host.num_used == 4
    for node in kv.index.walk(a):
        kv.host.demote(node, dead=True)
    revived = kv.index.walk(b)[0]
    kv.host.demote(revived, dead=True)
    kv.host.touch(revived)  # a turn reads it after all: it is live again
    g = list(range(2000, 2000 + 4 * BS - 1))
    admit(kv, "g", g)  # f's three blocks to the host: a's two and b's older host copy go
    kv.take_copies()
    spills, _ = kv.take_disk_copies()
    assert len(spills) == 1 and not kv.host.dead  # b's copy goes to disk, a's dead ones nowhere
    kv.finish_copies()
    accounting_ok(kv)
    assert kv.match(a + [0]).num_tokens == 0 and kv.match(b + [0]).num_tokens == 2 * BS


# ---------------------------------------------------------------- host tier


def _fill_and_evict(kv: KVCacheManager, toks, filler_start: int = 1000):
    admit(kv, "a", toks)
    compute(kv, "a", toks)
    kv.free("a", 1.0)
    filler = list(range(filler_start, filler_start + kv.num_blocks * BS - 1))
    assert admit(kv, "f", filler) is not None  # needs every block: evicts all of a's
    kv.free("f", 2.0)


def test_host_tier_offload_and_reload():
    kv = mk(6, host_blocks=16)
    toks = list(range(13))  # 3 full blocks indexed
    admit(kv, "a", toks)
    compute(kv, "a", toks)
    a_blocks = kv.block_ids("a")[:3]
    kv.free("a", 1.0)
    kv.take_copies()
    filler = list(range(1000, 1000 + 6 * BS - 1))
    assert admit(kv, "f", filler) is not None
    off, ld = kv.take_copies()
    assert ld == []
    assert sorted(d for d, _ in off) == sorted(a_blocks)
    assert len({h for _, h in off}) == 3
    assert kv.host.num_used == 3
    accounting_ok(kv)
    kv.free("f", 2.0)  # f was not computed: nothing of it is cached
    slot_of = {}
    for node in kv.index.iter_nodes():
        assert node.block is None and node.host_slot is not None
        slot_of[node.tokens] = node.host_slot
    follow = toks + [7, 7]
    m = kv.match(follow)
    assert m.num_tokens == 12 and m.num_host_blocks == 3 and m.num_host_tokens == 12
    assert kv.admit("b", m, len(follow) - 12, 3.0)
    off, ld = kv.take_copies()
    assert off == []
    table = kv.block_ids("b")
    want = [(slot_of[tuple(toks[i * BS:(i + 1) * BS])], table[i]) for i in range(3)]
    assert ld == want
    accounting_ok(kv)
    # the reloaded blocks are device-resident again (and still on the host)
    kv.free("b", 4.0)
    m = kv.match(follow)
    assert m.num_tokens == 12 and m.num_host_blocks == 0
    accounting_ok(kv)


def test_host_partial_reload_mixes_device_and_host_blocks():
    kv = mk(6, host_blocks=16, eviction="lru")
    toks = list(range(13))
    _fill_and_evict(kv, toks)
    kv.take_copies()
    # recompute the first block only, on the device
    admit(kv, "c", toks[:5])  # hits host block 0 -> load
    _, ld = kv.take_copies()
    assert len(ld) == 1
    kv.free("c", 3.0)
    m = kv.match(toks)
    assert m.num_tokens == 12 and m.num_host_blocks == 2
    assert kv.admit("d", m, 1, 4.0)
    _, ld = kv.take_copies()
    assert [d for _, d in ld] == kv.block_ids("d")[1:3]
    accounting_ok(kv)


def test_swap_out():
    kv = mk(8, host_blocks=8)
    toks = list(range(10))
    admit(kv, "a", toks)
    compute(kv, "a", toks)
    ids = kv.block_ids("a")
    assert kv.swap_out("a", 1.0) == 2
    off, _ = kv.take_copies()
    assert [d for d, _ in off] == ids[:2]
    assert kv.num_free_blocks == 8
    assert kv.host.num_used == 2
    accounting_ok(kv)
    # eviction later copies nothing again: the host already holds them
    filler = list(range(500, 500 + 8 * BS - 1))
    assert admit(kv, "f", filler) is not None
    off, _ = kv.take_copies()
    assert off == []
    assert kv.match(toks).num_host_blocks == 2
    kv.free("f", 2.0)
    assert kv.swap_out("nobody", 2.0) == 0
    # without a host tier swap_out just frees
    kv2 = mk(8)
    admit(kv2, "a", toks)
    compute(kv2, "a", toks)
    assert kv2.swap_out("a", 1.0) == 0
    assert kv2.num_free_blocks == 8
    assert kv2.take_copies() == ([], [])
    accounting_ok(kv2)


def test_a_host_copy_counts_once_its_copy_is_confirmed():
    """A host slot is not matched while its copy is queued or in flight; a
    failed copy frees the slot and prunes the node; a second batch may be taken
    while the first is in flight, but not under the same ticket."""
    raw = KVCacheManager(4, BS, host_blocks=8)
    kv = Named(raw)
    toks = list(range(2 * BS + 1))
    admit(kv, "a", toks)
    compute(kv, "a", toks)
    second = kv.block_ids("a")[1]
    kv.free("a", 1.0)
    admit(kv, "f", list(range(900, 900 + 4 * BS - 1)))  # evicts a's two blocks: offloads queued
    assert raw.host.num_used == 2
    assert kv.match(toks).num_tokens == 0  # queued: not a hit yet
    off, _ = raw.take_copies(ticket=7)
    assert len(off) == 2
    assert kv.match(toks).num_tokens == 0  # in flight: still not a hit
    assert raw.take_copies(ticket=8) == ([], [])  # nothing queued since: an empty batch, nothing in flight
    with pytest.raises(RuntimeError, match="still in flight"):
        raw.take_copies(ticket=7)
    assert raw.finish_copies(ticket=3) == set()  # an unknown ticket: nothing happens
    assert raw.host.pending
    failed = [i for i, (d, _) in enumerate(off) if d == second]
    assert raw.finish_copies(failed_offloads=failed, ticket=7) == set()  # the second block's copy failed
    accounting_ok(kv)
    assert raw.host.num_used == 1 and not raw.host.pending
    assert kv.match(toks).num_tokens == BS and kv.match(toks).num_host_blocks == 1
    assert kv.index.num_nodes == 1  # the failed block's node held nothing: pruned
    # a failed reload: the block leaves its node, the host copy is dropped, the request is cut back
    kv.free("f", 2.0)
    table = raw.admit(kv.match(toks), 2 * BS + 1 - BS, 3.0)
    _, ld = raw.take_copies()
    assert [d for _, d in ld] == [table.blocks[0].block_id]
    unloaded = raw.finish_copies(failed_loads=[0])
    assert unloaded == {table.blocks[0].block_id}
    assert raw.cut_unloaded(table, unloaded, 3.0) == 0
    assert table.block_ids == list(unloaded) and table.num_indexed == 0 and table.last_node is raw.index.root
    assert raw.host.num_used == 0 and kv.index.num_nodes == 0
    assert kv.match(toks).num_tokens == 0
    raw.check_integrity([table])
    # the request recomputes and indexes its blocks again
    assert raw.allocate_slots(table, len(toks))
    raw.commit(table, toks, len(toks))
    raw.check_integrity([table])
    assert kv.match(toks).num_tokens == 2 * BS
    raw.free(table, 4.0)
    raw.check_integrity()


def test_a_failed_reload_in_the_middle_keeps_the_blocks_before_it():
    raw = KVCacheManager(6, BS, host_blocks=16)
    kv = Named(raw)
    toks = list(range(13))  # 3 full blocks
    _fill_and_evict(kv, toks)
    kv.take_copies()
    table = raw.admit(kv.match(toks + [1]), 2, 3.0)
    nodes = [b.node for b in table.blocks[:3]]
    _, ld = raw.take_copies()
    assert len(ld) == 3
    unloaded = raw.finish_copies(failed_loads=[1])
    assert raw.cut_unloaded(table, unloaded, 3.0) == BS
    assert table.block_ids[1:] == list(unloaded)  # kept, private, to recompute into
    assert len(table.blocks) == 2 and table.num_indexed == 1 and table.last_node is nodes[0]
    raw.check_integrity([table])
    # block 0 stays on the device with this request, block 2's reload stood: cached, free
    assert nodes[0].block is table.blocks[0] and nodes[2].block is not None and nodes[2].block.ref_cnt == 0
    assert nodes[1].block is None and nodes[1].host_slot is None
    assert kv.match(toks + [1]).num_tokens == BS  # nothing is reachable past the lost block
    assert raw.allocate_slots(table, 14)
    raw.commit(table, toks + [1], 13)
    raw.check_integrity([table])
    assert kv.match(toks + [1]).num_tokens == 3 * BS  # the chain is whole again
    raw.free(table, 4.0)
    raw.check_integrity()


def test_host_tier_capacity_eviction():
    kv = mk(4, host_blocks=2)
    toks = list(range(4 * BS))  # 4 blocks, the last not indexed fully computed
    admit(kv, "a", toks)
    compute(kv, "a", toks)
    kv.free("a", 1.0)
    kv.take_copies()
    admit(kv, "f", list(range(900, 900 + 4 * BS - 1)))
    off, _ = kv.take_copies()
    # every eviction offloads, the host evicts LRU entries: the copies of the
    # first two were taken back (their slots reused) before they ran
    assert len(off) == 2 and len({h for _, h in off}) == 2
    assert kv.host.num_used == 2
    assert kv.host.num_evicted == 2
    accounting_ok(kv)
    # a request's tail is freed (and so evicted) first: the host keeps the
    # most recently offloaded blocks, the prefix; the tail nodes are pruned
    kv.free("f", 2.0)
    assert kv.index.num_nodes == 2
    m = kv.match(toks)
    assert m.num_tokens == 8 and m.num_host_blocks == 2
    accounting_ok(kv)


def test_host_tier_disabled():
    kv = mk(4, host_blocks=0)
    _fill_and_evict(kv, list(range(9)))
    assert kv.take_copies() == ([], [])
    assert kv.index.num_nodes == 0
    assert kv.match(list(range(9))).num_tokens == 0
    accounting_ok(kv)


@pytest.mark.parametrize("eviction", ALL_STRATEGIES)
@pytest.mark.parametrize("host", [0, 6])
def test_every_eviction_strategy_through_manager(eviction, host):
    kv = mk(8, eviction=eviction, host_blocks=host)
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    now = 0.0
    for i in range(12):
        toks = shared + [i, i, i, i] * (1 + i % 3) + [9]
        rid = f"r{i}"
        for pid, pin in list(kv.pins.items()):
            if pin.expiry <= now:
                kv.unpin(pid, now)
        m = kv.match(toks)
        if i and host:
            assert m.num_tokens >= 8  # the shared prefix is on the device or the host
        assert kv.admit(rid, m, len(toks) - m.num_tokens, now)
        assert kv.allocate_slots(rid, len(toks))
        kv.commit(rid, toks, len(toks))
        accounting_ok(kv)
        if i % 4 == 3:
            kv.pin(f"p{i}", rid, now + 1, now, now)
        else:
            kv.free(rid, now)
        now += 1.0
        kv.take_copies()
        accounting_ok(kv)
    assert kv.pool.num_evictions > 0
    for pid in list(kv.pins):
        kv.unpin(pid, now)
    assert kv.num_free_blocks == kv.num_blocks
    accounting_ok(kv)
    # leaf-aware strategies keep the shared prefix over the suffixes
    if eviction in ("leaf-lru", "lfu", "arc"):
        assert kv.match(shared + [0]).num_tokens == 8


def test_unknown_strategy_and_bad_sizes():
    with pytest.raises(ValueError):
        mk(8, eviction="nope")
    with pytest.raises(ValueError):
        mk(0)
    with pytest.raises(ValueError):
        KVCacheManager(8, 0)
    with pytest.raises(ValueError):
        mk(8, host_blocks=-1)


# ---------------------------------------------------------------- hash collisions


def collide(toks):
    return sum(toks) % 3


@pytest.mark.parametrize("host", [0, 8])
def test_hash_collisions_are_never_false_hits(host):
    kv = mk(12, key_fn=collide, host_blocks=host)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 0]  # blocks sum 10 (key 1), 26 (key 2)
    b = [4, 3, 2, 1, 2, 2, 2, 2, 0]  # block 0 collides with a's (sum 10), different tokens
    admit(kv, "a", a)
    compute(kv, "a", a)
    kv.free("a", 0.0)
    m = kv.match(b)
    assert m.num_tokens == 0  # same key, other tokens: a miss
    admit(kv, "b", b)
    compute(kv, "b", b)  # collides with a's node: b's chain is not indexed
    accounting_ok(kv)
    assert kv.match(b).num_tokens == 0
    assert kv.match(a).num_tokens == 8
    kv.free("b", 1.0)
    # second-level collision under a shared first block
    c = [1, 2, 3, 4, 8, 7, 6, 5, 0]  # second block: same sum as a's, other tokens
    m = kv.match(c)
    assert m.num_tokens == 4
    for node in m.nodes:
        assert list(node.tokens) == c[:4]
    admit(kv, "c", c)
    compute(kv, "c", c)
    accounting_ok(kv)
    kv.free("c", 2.0)
    assert kv.match(c).num_tokens == 4
    assert kv.match(a).num_tokens == 8
    accounting_ok(kv)


def test_hash_collisions_random_no_false_hit():
    import random
    rng = random.Random(7)
    kv = mk(24, key_fn=collide, host_blocks=10)
    for i in range(300):
        toks = [rng.randrange(4) for _ in range(rng.randrange(1, 20))]
        m = kv.match(toks)
        for j, node in enumerate(m.nodes):
            assert list(node.tokens) == toks[j * BS:(j + 1) * BS]
        if kv.admit(f"r{i}", m, len(toks) - m.num_tokens, float(i)):
            kv.commit(f"r{i}", toks, len(toks))
            kv.free(f"r{i}", float(i))
        kv.take_copies()
        accounting_ok(kv)


# ---------------------------------------------------------------- regressions


def test_commit_after_foreign_tail_block_was_evicted():
    """Two requests compute the same prompt at once: the second's blocks stay
    private and its chain ends on the first's node. The first frees, its blocks
    are evicted and their nodes pruned; the second must still index what it
    computes next (this used to attach blocks under a detached node)."""
    kv = mk(6)
    prompt = list(range(9))
    for rid in "AB":
        m = kv.match(prompt)
        assert m.num_tokens == 0
        assert kv.admit(rid, m, len(prompt), 0.0)
    kv.commit("A", prompt, 9)
    kv.commit("B", prompt, 9)
    kv.free("A", 1.0)
    assert admit(kv, "C", list(range(100, 109))) is not None  # evicts A's cached blocks
    accounting_ok(kv)
    toks = prompt + [50, 51, 52, 53]
    kv.commit("B", toks, 12)
    accounting_ok(kv)
    kv.free("C", 2.0)
    kv.free("B", 2.0)
    accounting_ok(kv)
    # B's blocks now carry the whole chain
    assert kv.match(toks + [1]).num_tokens == 12
    # and evicting everything prunes cleanly
    assert admit(kv, "D", list(range(300, 300 + 6 * BS - 1))) is not None
    kv.free("D", 3.0)
    accounting_ok(kv)
    assert kv.index.num_nodes == 0


# ---------------------------------------------------------------- state machine

PREFIXES = [
    [1, 2, 3, 4, 5, 6, 7, 8],
    [1, 2, 3, 4, 0, 0, 0, 0, 1],
    [2, 2, 2, 2],
    [],
]
PROGRAMS = ["p0", "p1", "p2", "p3"]


class KVModel:
    """A small manager driven like the scheduler drives it, with a fake executor's
    memory: `dev[block]` / `host[slot]` hold the tokens whose KV was written there.
    Operations take explicit arguments; the state machine and the seeded
    driver below pick them."""

    def __init__(self, eviction: str, host: int, collisions: bool, num_blocks: int = 24, fail: float = 0.0,
                 zone: int = 0) -> None:
        import random
        self.kv = Named(KVCacheManager(num_blocks, BS, eviction=eviction, host_blocks=host,
                                       key_fn=collide if collisions else None, protected_blocks=zone))
        self.zone = zone  # a protected zone: turns free into it, expired pins too (kv/protected_zone.py)
        self.zone_peak = 0
        self.fail = fail  # the chance that the fake executor fails a copy
        self.rng = random.Random(f"{eviction}-{host}-{collisions}-{fail}")
        self.reqs: dict[str, dict] = {}
        self.n = 0
        self.now = 0.0
        self.dev: dict[int, list] = {}
        self.host: dict[int, list] = {}
        self.history: dict[str, list] = {}  # program -> tokens of the request it pinned last

    # --- the fake executor ---

    def flush(self):
        """The fake executor runs the queued copies; with `fail`, some fail and
        leave garbage where they were to write (a torn copy), so a slot or a
        block the manager trusted without its copy shows up as wrong KV."""
        kv = self.kv.kv
        off, ld = kv.take_copies()
        failed_off = [i for i in range(len(off)) if self.rng.random() < self.fail]
        failed_ld = [i for i in range(len(ld)) if self.rng.random() < self.fail]
        for i, (d, h) in enumerate(off):
            self.host[h] = ["torn"] * BS if i in failed_off else list(self.dev.get(d, [None] * BS))
        for i, (h, d) in enumerate(ld):
            assert h in self.host, "load from a slot nothing was written to"
            self.dev[d] = ["torn"] * BS if i in failed_ld else list(self.host[h])
        unloaded = kv.finish_copies(failed_off, failed_ld)
        assert unloaded == {ld[i][1] for i in failed_ld}
        for rid, r in self.reqs.items():
            kept = kv.cut_unloaded(self.kv.tables[rid], unloaded, self.now)
            if kept is not None:
                assert kept < r["computed"]
                r["computed"] = kept
        # every cached block / host copy holds exactly its node's tokens
        for node in self.kv.index.iter_nodes():
            if node.block is not None:
                assert tuple(self.dev[node.block.block_id]) == node.tokens
            if node.host_slot is not None:
                assert node not in kv.host.pending
                assert tuple(self.host[node.host_slot]) == node.tokens

    def tick(self, dt=0.25):
        self.now += dt

    # --- operations ---

    def allocate(self, toks, program):
        if not toks:
            toks = [3]
        self.tick()
        m = self.kv.match(toks)
        assert m.num_tokens % BS == 0 and m.num_tokens <= len(toks) - 1
        for j, node in enumerate(m.nodes):
            assert list(node.tokens) == toks[j * BS:(j + 1) * BS]  # never a false hit
        free_before = self.kv.num_free_blocks
        nodes_before = self.kv.index.num_nodes
        rid = f"r{self.n}"
        self.n += 1
        if self.kv.admit(rid, m, len(toks) - m.num_tokens, self.now):
            self.reqs[rid] = {"tokens": list(toks), "computed": m.num_tokens, "program": program}
            assert self.kv.num_blocks_of(rid) == self.kv.blocks_for(len(toks))
        else:
            assert self.kv.num_free_blocks == free_before
            assert self.kv.index.num_nodes == nodes_before
            assert self.kv.num_blocks_of(rid) == 0

    def pressure(self, nblocks):
        """A one-off request of fresh tokens that takes `nblocks` blocks and is
        freed at once: evicts cached blocks like a burst of other traffic."""
        n = min(nblocks, self.kv.num_free_blocks)
        if n == 0:
            return
        self.n += 1
        rid = f"x{self.n}"
        toks = [100 + self.n] * (n * BS)
        assert self.kv.admit(rid, self.kv.match(toks), len(toks), self.now)
        self.kv.free(rid, self.now)

    def grow(self, rid, extra):
        before_free = self.kv.num_free_blocks
        before_n = self.kv.num_blocks_of(rid)
        want = len(self.reqs[rid]["tokens"]) + extra
        if self.kv.allocate_slots(rid, want):
            assert self.kv.num_blocks_of(rid) >= self.kv.blocks_for(want)
        else:
            assert self.kv.num_free_blocks == before_free
            assert self.kv.num_blocks_of(rid) == before_n

    def compute(self, rid, frac, gen):
        """One step for one request: compute some of its tokens (`frac` of what
        remains, at least one), commit, and when it caught up sample a token
        (generated tokens are indexed too)."""
        self.flush()  # the reloads its admission queued: a failed one cuts it back
        r = self.reqs[rid]
        toks = r["tokens"]
        remaining = len(toks) - r["computed"]
        n = max(1, round(remaining * frac)) if remaining > 0 else 0
        end = r["computed"] + n
        if not self.kv.allocate_slots(rid, end):
            return  # the scheduler would preempt something
        self.flush()
        table = self.kv.block_ids(rid)
        assert len(table) >= self.kv.blocks_for(end)
        for pos in range(r["computed"]):  # the KV this chunk attends to is this request's
            assert self.dev[table[pos // BS]][pos % BS] == toks[pos], (rid, pos)
        for pos in range(r["computed"], end):
            self.dev.setdefault(table[pos // BS], [None] * BS)[pos % BS] = toks[pos]
        r["computed"] = end
        self.kv.commit(rid, toks, end)
        if end == len(toks):
            toks.append(gen)
        self.tick(0.1)

    def free(self, rid):
        r = self.reqs.pop(rid)
        self.tick()
        self.kv.free(rid, self.now, r["program"] if self.zone else None)

    def unprotect(self, pid):
        before = self.kv.num_free_blocks
        self.kv.unprotect(pid)
        assert self.kv.num_free_blocks == before  # protected or not, they are free

    def pin(self, rid, ttl):
        r = self.reqs.pop(rid)
        self.tick()
        free_before = self.kv.num_free_blocks
        self.kv.pin(r["program"], rid, self.now + ttl, 0.0, self.now)
        assert self.kv.num_free_blocks == free_before  # a pin frees nothing
        assert r["program"] in self.kv.pins
        self.history[r["program"]] = r["tokens"]

    def unpin(self, pid):
        expect = self.kv.reclaimable_blocks(pid)
        held = len(self.kv.pins[pid].blocks)  # 0 once a next turn superseded them all
        before = self.kv.num_free_blocks
        self.tick()
        n = self.kv.unpin(pid, self.now)
        assert n == held
        assert self.kv.num_free_blocks - before == expect

    def supersede(self, pid, cut, suffix):
        """The program's next turn keeps `cut` of its pinned history and rewrites the rest."""
        old = self.history.get(pid)
        if old is None:
            return
        new = old[:round(len(old) * cut)] + suffix
        before = self.kv.num_free_blocks
        pin = self.kv.pins.get(pid)
        held = list(pin.blocks) if pin is not None else []
        self.tick()
        self.kv.supersede(pid, old, new, self.now)
        assert self.kv.num_free_blocks >= before
        if pin is not None:
            assert all(b in held for b in pin.blocks)
            hits = {n.block for n in self.kv.match(new + [0]).nodes}
            assert all(b in pin.blocks for b in held if b in hits), "a block the new turn matches left the pin"

    def expire(self, dt):
        self.now += dt
        for pid, pin in list(self.kv.pins.items()):
            if pin.expiry <= self.now:
                self.kv.unpin(pid, self.now, protect=bool(self.zone))
        assert all(p.expiry > self.now for p in self.kv.pins.values())

    def swap_out(self, rid):
        r = self.reqs.pop(rid)
        self.tick()
        copied = self.kv.swap_out(rid, self.now, r["program"] if self.zone else None)
        if not self.kv.host.enabled:
            assert copied == 0
        assert self.kv.host.num_used <= self.kv.host.num_slots

    def prefetch(self, toks):
        """A prefetch's reload (kv/prefetch_loads.py) of the chain `toks` walks:
        no request holds what it brings back, which lands with the next flush
        and must then hold its tokens' KV."""
        from agentserve.kv.prefetch_loads import chain_reload, load_chain

        self.tick()
        kv = self.kv.kv
        r = chain_reload(kv, kv.index.walk(toks))
        if r is None:
            return
        free = kv.num_free_blocks
        if load_chain(kv, r, self.now) is None:
            assert kv.num_free_blocks == free and r.need > free
        elif kv.parts is None:
            assert chain_reload(kv, kv.index.walk(toks)) is None  # a reload under way is not issued twice

    # --- invariants ---

    def check(self):
        kv = self.kv
        kv.check_integrity()
        self.zone_peak = max(self.zone_peak, kv.num_protected_blocks)
        holders: Counter[int] = Counter()
        for rid, r in self.reqs.items():
            ids = kv.block_ids(rid)
            assert len(ids) == len(set(ids)), "a block twice in one table"
            assert len(ids) >= kv.blocks_for(r["computed"])
            holders.update(ids)
        for p in kv.pins.values():
            holders.update(set(b.block_id for b in p.blocks))
        holders.update(kv.copies.held_blocks())  # a reload holds its block until it lands
        assert kv.num_free_blocks + len(holders) == kv.num_blocks
        for bid, n in holders.items():
            if n > 1:  # shared by two live holders: must be a cached (full, indexed) prefix block
                assert kv.pool.blocks[bid].is_cached, bid
        for rid in self.reqs:
            st = kv.tables[rid]
            for i, b in enumerate(st.blocks):
                if holders[b.block_id] > 1:
                    assert i < st.num_indexed, (rid, i, "shared block outside the indexed prefix")
        assert set(self.reqs) == set(kv.tables)

    def drain(self):
        for rid in list(self.reqs):
            self.kv.free(rid, self.now)
        self.reqs.clear()
        for pid in list(self.kv.pins):
            self.kv.unpin(pid, self.now)
        self.flush()
        self.check()
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert self.kv.num_pinned_blocks == 0


def _has_reqs(self):
    return bool(self.m.reqs)


class KVMachine(RuleBasedStateMachine):
    @initialize(eviction=st.sampled_from(ALL_STRATEGIES), host=st.sampled_from([0, 10]),
                collisions=st.booleans(), fail=st.sampled_from([0.0, 0.3]))
    def setup(self, eviction, host, collisions, fail):
        self.m = KVModel(eviction, host, collisions, fail=fail)

    def _rid(self, data):
        return data.draw(st.sampled_from(sorted(self.m.reqs)))

    @rule(p=st.integers(0, len(PREFIXES) - 1), suffix=st.lists(st.integers(0, 3), max_size=14),
          program=st.sampled_from(PROGRAMS))
    def allocate(self, p, suffix, program):
        self.m.allocate(PREFIXES[p] + suffix, program)

    @precondition(_has_reqs)
    @rule(data=st.data(), cut=st.floats(0.0, 1.0), suffix=st.lists(st.integers(0, 3), max_size=6),
          program=st.sampled_from(PROGRAMS))
    def allocate_like(self, data, cut, suffix, program):
        """A prompt that repeats (part of) a live request's tokens, as parallel
        agents with one system prompt or a program's next turn do."""
        toks = self.m.reqs[self._rid(data)]["tokens"]
        self.m.allocate(toks[:round(len(toks) * cut)] + suffix, program)

    @rule(nblocks=st.integers(1, 24))
    def pressure(self, nblocks):
        self.m.pressure(nblocks)

    @precondition(_has_reqs)
    @rule(data=st.data(), extra=st.integers(1, 12))
    def grow(self, data, extra):
        self.m.grow(self._rid(data), extra)

    @precondition(_has_reqs)
    @rule(data=st.data(), frac=st.floats(0.0, 1.0), gen=st.integers(0, 3))
    def compute(self, data, frac, gen):
        self.m.compute(self._rid(data), frac, gen)

    @precondition(_has_reqs)
    @rule(data=st.data())
    def free(self, data):
        self.m.free(self._rid(data))

    @precondition(_has_reqs)
    @rule(data=st.data(), ttl=st.floats(0.0, 3.0))
    def pin(self, data, ttl):
        self.m.pin(self._rid(data), ttl)

    @precondition(lambda self: self.m.kv.pins)
    @rule(data=st.data())
    def unpin(self, data):
        self.m.unpin(data.draw(st.sampled_from(sorted(self.m.kv.pins))))

    @rule(dt=st.floats(0.0, 2.0))
    def expire(self, dt):
        self.m.expire(dt)

    @precondition(lambda self: self.m.history)
    @rule(data=st.data(), cut=st.floats(0.0, 1.0), suffix=st.lists(st.integers(0, 3), max_size=6))
    def supersede(self, data, cut, suffix):
        self.m.supersede(data.draw(st.sampled_from(sorted(self.m.history))), cut, suffix)

    @precondition(_has_reqs)
    @rule(data=st.data())
    def swap_out(self, data):
        self.m.swap_out(self._rid(data))

    @rule(p=st.integers(0, len(PREFIXES) - 1))
    def prefetch(self, p):
        self.m.prefetch(PREFIXES[p])

    @rule()
    def take_copies(self):
        self.m.flush()

    @invariant()
    def integrity(self):
        if hasattr(self, "m"):
            self.m.check()

    def teardown(self):
        if hasattr(self, "m"):
            self.m.drain()


KVMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=80, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestKVMachine = KVMachine.TestCase


NB = 16


@pytest.mark.parametrize("eviction", ALL_STRATEGIES)
@pytest.mark.parametrize("host,fail,zone", [(0, 0.0, 0), (10, 0.0, 0), (10, 0.2, 0), (0, 0.0, 5), (10, 0.2, 5)])
@pytest.mark.parametrize("collisions", [False, True])
def test_long_randomized_sequences(eviction, host, collisions, fail, zone):
    """The same operations driven by a seeded RNG for a long run, so every
    strategy / host / collision / copy-failure / protected-zone setting gets
    long sequences regardless of hypothesis' draws (copies fail only with a host tier)."""
    import random
    rng = random.Random(f"{eviction}-{host}-{collisions}")
    m = KVModel(eviction, host, collisions, num_blocks=NB, fail=fail, zone=zone)
    for step in range(4000):
        ops = ["allocate", "expire", "take_copies", "pressure"]
        if m.reqs:
            ops += ["allocate_like", "allocate_like", "grow", "compute", "compute", "compute", "compute",
                    "free", "pin", "swap_out"]
        if m.kv.pins:
            ops.append("unpin")
        if m.history:
            ops.append("supersede")
        if zone:
            ops.append("unprotect")
        op = rng.choice(ops)
        rid = rng.choice(sorted(m.reqs)) if m.reqs else None
        if op == "allocate":
            m.allocate(rng.choice(PREFIXES) + [rng.randrange(4) for _ in range(rng.randrange(15))],
                       rng.choice(PROGRAMS))
        elif op == "allocate_like":
            toks = m.reqs[rid]["tokens"]
            if rng.random() < 0.5:  # an exact twin, computed side by side
                m.allocate(list(toks), rng.choice(PROGRAMS))
            else:
                m.allocate(toks[:rng.randrange(len(toks) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(6))],
                           rng.choice(PROGRAMS))
        elif op == "pressure":
            m.pressure(rng.randrange(1, NB + 1))
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
        elif op == "supersede":
            m.supersede(rng.choice(sorted(m.history)), rng.random(), [rng.randrange(4) for _ in range(rng.randrange(6))])
        elif op == "unprotect":
            m.unprotect(rng.choice(PROGRAMS))
        else:
            m.flush()
        m.check()
        if step % 500 == 499:
            m.drain()
    m.drain()
    assert m.zone_peak == zone  # the zone filled (and never past its capacity: check_integrity)


@pytest.mark.parametrize("seed", range(6))
def test_a_chain_hint_gives_the_same_match_as_looking_every_block_up(seed):
    """A program's next turn is matched from its last turn's chain (kv.chain_hint);
    whatever happened to the index meanwhile (eviction, pruning, other programs,
    a turn that rewrote its context, another salt) the match must be the one the
    plain walk finds."""
    import random

    rng = random.Random(seed)
    kv = KVCacheManager(24, BS, eviction=rng.choice(ALL_STRATEGIES), host_blocks=rng.choice([0, 6]))
    hints: dict = {}
    history: dict[str, list[int]] = {}
    for step in range(60):
        pid = rng.choice("abcd")
        old = history.get(pid, [])
        if old and rng.random() < 0.8:
            keep = len(old) if rng.random() < 0.7 else rng.randrange(len(old) + 1)  # extend, or rewrite
            toks = old[:keep] + [rng.randrange(3) for _ in range(rng.randrange(1, 9))]
        else:
            toks = [rng.randrange(3) for _ in range(rng.randrange(2, 20))]
        salt = rng.choice([None, None, "t2"])
        plain = kv.match(toks, salt)
        hinted = kv.match(toks, salt, hints.get(pid))  # made under this salt or another
        assert hinted.nodes == plain.nodes, (step, pid)
        table = kv.admit(plain, len(toks) - plain.num_tokens, float(step))
        if table is None:
            kv.take_copies()
            kv.finish_copies()
            continue
        kv.commit(table, toks, len(toks))
        hints[pid] = kv.chain_hint(toks, table)
        history[pid] = toks
        kv.free(table, float(step))
        kv.take_copies()
        kv.finish_copies()
        kv.check_integrity()
