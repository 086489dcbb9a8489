"""The prefix cache's salt (a tenant, a request's `cache_salt`): blocks indexed
under one salt are never a hit for another, in the KV manager, through the
scheduler, and for grouped prefill; an unsalted request behaves as before."""

from __future__ import annotations

import pytest

from agentserve.engine.grouped_prefill import follows
from agentserve.engine.request import Request
from test_kv_manager import BS, Named, accounting_ok, mk
from test_scheduler import Harness, expected

SALTS = [None, ("t-a", None), ("t-b", None), (None, "x"), ("t-a", "x")]


def admit_compute(kv: Named, rid: str, tokens, salt) -> int:
    """match under `salt`, admit, compute and commit all of `tokens`; returns the hit in tokens."""
    m = kv.match(tokens, salt)
    assert kv.admit(rid, m, len(tokens) - m.num_tokens, 0.0)
    assert kv.allocate_slots(rid, len(tokens))
    kv.commit(rid, tokens, len(tokens))
    return m.num_tokens


@pytest.mark.parametrize("first", SALTS)
def test_a_block_is_a_hit_only_under_its_own_salt(first):
    kv = mk(32, eviction="arc", host_blocks=8)
    tokens = list(range(1, 4 * BS + 2))
    assert admit_compute(kv, "r0", tokens, first) == 0
    kv.free("r0", 1.0)
    for salt in SALTS:
        got = kv.match(tokens, salt).num_tokens
        assert got == (4 * BS if salt == first else 0), (first, salt)
    assert admit_compute(kv, "r1", tokens, first) == 4 * BS
    kv.free("r1", 2.0)
    accounting_ok(kv)


def test_equal_prompts_under_two_salts_keep_two_chains():
    kv = mk(32)
    tokens = list(range(1, 3 * BS + 2))
    admit_compute(kv, "a", tokens, ("t-a", None))
    admit_compute(kv, "b", tokens, ("t-b", None))
    assert kv.index.num_nodes == 6  # three blocks each, nothing shared
    assert set(kv.block_ids("a")).isdisjoint(kv.block_ids("b"))
    for rid in ("a", "b"):
        kv.free(rid, 1.0)
    # an unsalted request with the same prompt still finds nothing
    assert kv.match(tokens).num_tokens == 0
    accounting_ok(kv)


def test_a_re_created_chain_keeps_its_salt():
    """commit's re-chaining (the chain ended on another request's block, which was
    evicted and its node pruned) puts the request's blocks back under its salt."""
    kv = mk(6)
    salt = ("t-a", None)
    first = list(range(1, BS + 1))
    a_tokens, b_tokens = first + [9], first + [8] * (BS + 1)
    for rid, tokens in (("a", a_tokens), ("b", b_tokens)):  # both admitted before either computed
        m = kv.match(tokens, salt)
        assert m.num_tokens == 0 and kv.admit(rid, m, len(tokens), 0.0)
    kv.commit("a", a_tokens, BS)
    kv.commit("b", b_tokens, BS)  # the same block: b's copy stays private
    kv.free("a", 1.0)
    m = kv.match([50] * (3 * BS), None)
    assert kv.admit("c", m, 3 * BS, 2.0)  # takes every free block: a's cached one is evicted
    assert kv.match(b_tokens, salt).num_tokens == 0
    kv.commit("b", b_tokens, 2 * BS)
    assert kv.match(b_tokens, salt).num_tokens == 2 * BS
    assert kv.match(b_tokens, None).num_tokens == 0
    accounting_ok(kv)


def test_supersede_walks_the_salted_chain():
    kv = mk(32)
    salt = ("t-a", "s")
    old = list(range(1, 4 * BS + 1))
    admit_compute(kv, "t1", old, salt)
    kv.pin("p", "t1", expiry=100.0, program_arrival=0.0, now=1.0)
    new = old[:BS] + [500] * (3 * BS)
    assert kv.supersede("p", old, new, 2.0, salt) == 3  # the three blocks past the first
    assert len(kv.pins["p"].blocks) == 1
    accounting_ok(kv)


def test_scheduler_hits_only_within_a_salt():
    prompt = list(range(100, 100 + 6 * BS + 1))
    h = Harness("vllm-fcfs", num_blocks=64, budget=256)
    a = h.req("a", "pa", prompt, max_tokens=2, cache_salt=("t-a", None))
    h.run()
    b = h.req("b", "pb", prompt, max_tokens=2, cache_salt=("t-b", None))
    h.run()
    a2 = h.req("a2", "pa2", prompt, max_tokens=2, cache_salt=("t-a", None))
    h.run()
    plain = h.req("p", "pp", prompt, max_tokens=2)
    h.run()
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0 and plain.num_cached_tokens == 0
    assert a2.num_cached_tokens == 6 * BS
    for r in (a, b, a2, plain):
        assert r.output_token_ids == expected(prompt, 2)


def test_grouped_prefill_waits_only_for_a_leader_of_the_same_salt():
    prompt = list(range(1, 5 * BS))
    leader = Request("l", "pl", prompt, 4, 0.0, cache_salt=("t-a", None))
    same = Request("s", "ps", prompt, 4, 0.0, cache_salt=("t-a", None))
    other = Request("o", "po", prompt, 4, 0.0, cache_salt=("t-b", None))
    plain = Request("n", "pn", prompt, 4, 0.0)
    assert follows(same, 0, [leader], BS)
    assert not follows(other, 0, [leader], BS)
    assert not follows(plain, 0, [leader], BS)


def test_a_burst_of_two_tenants_prefills_each_preamble_once_per_tenant():
    pre = list(range(1, 65))
    prompts = [pre + [200 + i] * 6 for i in range(4)]
    h = Harness("vllm-fcfs", num_blocks=128, budget=256, group_prefill=True)
    reqs = [h.req(f"r{i}", f"p{i}", p, max_tokens=2, cache_salt=(f"t{i % 2}", None))
            for i, p in enumerate(prompts)]
    h.run()
    assert all(r.output_token_ids == expected(p, 2) for r, p in zip(reqs, prompts))
    # one follower per tenant; the first of each tenant computes the preamble
    assert h.s.stats.grouped_requests == 2
    assert reqs[0].num_cached_tokens == 0 and reqs[1].num_cached_tokens == 0
    assert reqs[2].num_cached_tokens >= 64 and reqs[3].num_cached_tokens >= 64
