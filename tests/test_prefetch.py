"""Prefetch on the predicted return: the lead time (policy/prefetch.py), and the
engine's reloads before a program's next turn (engine/prefetch.py) over the
fake executors of test_scheduler.py and test_async_copies.py, which check the
KV every chunk reads, so a prefetched block holding the wrong KV fails a run."""

from __future__ import annotations

import math
import random

import pytest
from test_async_copies import LaggingHarness
from test_scheduler import Harness, expected, prompt_of

from agentserve.policy.prefetch import prefetch_start, prefetch_value
from agentserve.policy.registry import parse_policy_spec

# --- the lead time ---


def test_a_known_duration_is_met_just_in_time():
    s, v = prefetch_start([10.0] * 20, reload_s=0.5, hold_cost=0.1)
    assert s == pytest.approx(9.5)
    assert v == pytest.approx(0.5 * (1 - 0.1))  # the whole reload saved, held for the reload only


def test_dear_memory_starts_later_cheap_memory_earlier():
    d = sorted([1.0] * 10 + [10.0] * 10)
    assert prefetch_start(d, 0.5, 0.01)[0] == pytest.approx(0.5)  # in time for the early returns
    assert prefetch_start(d, 0.5, 0.2)[0] == pytest.approx(9.5)  # only for the late ones


def test_nothing_worth_it_gives_none():
    assert prefetch_start([], 0.5, 0.1) is None
    assert prefetch_start([1.0, 2.0], 0.0, 0.1) is None
    assert prefetch_start([1.0, 2.0], 0.5, 1.0) is None  # a held second costs a saved one
    assert prefetch_start([1.0, 2.0], math.inf, 0.1) is None


@pytest.mark.parametrize("seed", range(5))
def test_the_start_is_the_best_on_a_fine_grid(seed):
    rng = random.Random(seed)
    d = sorted(rng.lognormvariate(0.5, 1.0) for _ in range(rng.randint(1, 60)))
    r, c = rng.uniform(0.05, 2.0), rng.uniform(0.0, 0.5)
    got = prefetch_start(d, r, c)
    grid = [i * 0.01 for i in range(int((d[-1] + 1) * 100))]

    def brute(s):  # the docstring's V(s), term by term
        return sum(min(max(x - s, 0.0), r) - c * max(x - s, 0.0) for x in d) / len(d)

    best = max(brute(s) for s in grid)
    if got is None:
        assert best <= 1e-9
    else:
        assert got[1] == pytest.approx(brute(got[0]), abs=1e-9)
        assert got[1] == pytest.approx(prefetch_value(d, got[0], r, c), abs=1e-12)
        assert got[1] >= best - 1e-9


def test_prefetch_off_is_an_agentserve_option(tmp_path):
    from agentserve.bench.peers.specs import server_spec

    assert parse_policy_spec("agentserve:prefetch=off") == ("agentserve", {"prefetch": False})
    with pytest.raises(ValueError):
        parse_policy_spec("agentserve:prefetch=3")
    argv = server_spec("agentserve-agentserve+host:prefetch=off", 32768, peers_dir=tmp_path).argv
    assert argv[argv.index("--policy") + 1] == "agentserve:prefetch=off" and "--host-kv-tokens" in argv


# --- the engine ---

TOOL = "t"


def _tiered(h: Harness, durations=(5.0,) * 150, reload_s: float = 0.05) -> Harness:
    """agentserve over a host tier that reloads a turn in `reload_s`, a tool whose learned
    durations are `durations` (by default: always 5 s)."""
    ctx = h.s.policy.ctx
    ctx.tier_reload = {"host": lambda n: reload_s}
    ctx.tier_residency = lambda tier: math.inf
    for d in durations:
        h.s.policy.tool_stats.record(TOOL, d)
    return h


def _first_turn(h: Harness, evict=True):
    """Program P's first turn (calling the tool, its KV not pinned), then one that evicts P's KV to the host tier."""
    r1 = h.req("t1", "P", prompt_of(1, 18), max_tokens=5, ttl_hint=0.0)
    r1.tool_name = TOOL
    h.run()
    assert len(h.s.prefetcher) == 1
    if evict:
        h.req("f", "Q", prompt_of(2, h.kv.num_blocks * 4 - 2), max_tokens=1, is_last_turn=True)
        h.run()
        h.run(until=lambda: not h.s.copies_in_flight)
        assert h.kv.match(r1.token_ids + [1]).num_host_blocks == 5
    return r1


def _until_due(h: Harness) -> None:
    due = h.s.prefetcher.next_due()
    assert due is not None and due > h.clock.now()
    h.idle(due - h.clock.now() + 1e-6)


def test_the_kv_is_back_on_the_device_before_the_turn_comes():
    h = _tiered(Harness("agentserve", num_blocks=12, budget=64, host=32))
    r1 = _first_turn(h)
    finished = r1.finish_time
    due = h.s.prefetcher.next_due()
    assert due == pytest.approx(finished + 5.0 - 0.05)  # just in time for the tool's return
    _until_due(h)
    st = h.s.stats
    assert (st.prefetch_issued, st.prefetch_blocks) == (1, 5)
    assert h.kv.match(r1.token_ids + [1]).num_host_blocks == 0  # on the device again
    h.idle(0.01)
    r2 = h.req("t2", "P", r1.token_ids + [1, 2, 3], max_tokens=2, is_last_turn=True)
    assert r2.prefetch == "used"
    h.run()
    assert r2.num_cached_tokens == 20 and r2.num_loaded_tokens == 0  # nothing reloaded on its path
    assert r2.output_token_ids == expected(r2.prompt_token_ids, 2)
    assert (st.prefetch_used, st.prefetch_late, st.prefetch_wasted, st.preemptions) == (1, 0, 0, 0)
    assert len(h.s.prefetcher) == 0


def test_no_prefetch_where_the_kv_stays_on_the_device_or_with_prefetch_off():
    h = _tiered(Harness("agentserve", num_blocks=12, budget=64, host=32))
    r1 = _first_turn(h, evict=False)
    _until_due(h)
    assert h.s.stats.prefetch_issued == 0  # nothing below the device: it looks again later
    h.idle(0.01)
    r2 = h.req("t2", "P", r1.token_ids + [1, 2, 3], max_tokens=2, is_last_turn=True)
    assert r2.prefetch is None and len(h.s.prefetcher) == 0
    off = _tiered(Harness("agentserve:prefetch=off", num_blocks=12, budget=64, host=32))
    r = off.req("t1", "P", prompt_of(1, 18), max_tokens=5, ttl_hint=0.0)
    r.tool_name = TOOL
    off.run()
    assert len(off.s.prefetcher) == 0


@pytest.mark.parametrize("how", ["end", "release"])
def test_an_ended_or_released_program_is_never_reloaded(how):
    h = _tiered(Harness("agentserve", num_blocks=12, budget=64, host=32))
    r1 = _first_turn(h)
    (h.s.end_program if how == "end" else h.s.release_program)("P")
    assert h.s.prefetcher.next_due() is None
    h.idle(10.0)
    assert h.s.stats.prefetch_issued == 0 and h.s.stats.prefetch_wasted == 0
    assert h.kv.match(r1.token_ids + [1]).num_host_blocks == 5


def test_under_kv_pressure_it_is_cancelled_and_never_preempts():
    h = _tiered(Harness("agentserve", num_blocks=12, budget=64, host=32, step_time=0.5))
    r1 = _first_turn(h, evict=False)
    # a request that takes all but one block and decodes past the prefetch's time
    big = h.req("b", "B", prompt_of(3, 30), max_tokens=14, is_last_turn=True)
    h.run(until=lambda: h.clock.now() > h.s.prefetcher.next_due() + 0.5 if h.s.prefetcher.next_due() else True)
    st = h.s.stats
    assert big.status.name == "RUNNING"
    assert (st.prefetch_cancelled, st.prefetch_issued, st.preemptions) == (1, 0, 0)
    h.run()
    r2 = h.req("t2", "P", r1.token_ids + [1, 2, 3], max_tokens=2, is_last_turn=True)
    h.run()
    assert r2.prefetch is None and r2.num_loaded_tokens > 0  # reloaded on its own path, as without
    assert r2.output_token_ids == expected(r2.prompt_token_ids, 2)
    assert big.output_token_ids == expected(big.prompt_token_ids, 14)


def test_prefetched_blocks_are_the_first_evicted_and_counted_wasted():
    h = _tiered(Harness("agentserve", num_blocks=16, budget=64, host=32))
    r1 = _first_turn(h)
    _until_due(h)
    h.idle(0.01)  # landed: to the cold end
    c = h.req("c", "C", prompt_of(4, 10), max_tokens=1, ttl_hint=0.0)  # C's blocks: free, cached
    h.run()
    c_blocks = h.kv.match(c.token_ids + [1]).nodes
    assert c_blocks and all(n.block is not None and n.block.ref_cnt == 0 for n in c_blocks)
    need = h.kv.num_free_blocks - len(c_blocks)  # every free block but C's
    q = h.req("q", "Q2", prompt_of(5, need * 4 - 2), max_tokens=1, is_last_turn=True)
    h.run()
    assert all(n.block is not None for n in h.kv.index.walk(c.token_ids[:8]))  # C's kept
    r2 = h.req("t2", "P", r1.token_ids + [1, 2, 3], max_tokens=2, is_last_turn=True)
    assert r2.prefetch == "wasted"
    h.run()
    st = h.s.stats
    assert (st.prefetch_wasted, st.prefetch_wasted_blocks, st.preemptions) == (1, 5, 0)
    assert r2.num_loaded_tokens == 20  # their host copies were kept: reloaded, not recomputed
    assert r2.output_token_ids == expected(r2.prompt_token_ids, 2)
    assert q.output_token_ids == expected(q.prompt_token_ids, 1)


def test_a_turn_that_comes_during_the_reload_waits_for_it():
    h = _tiered(LaggingHarness("agentserve", lag=3, num_blocks=12, budget=64, host=32))
    r1 = _first_turn(h)
    _until_due(h)
    assert h.s.stats.prefetch_issued == 1 and h.kv.copies_in_flight
    r2 = h.req("t2", "P", r1.token_ids + [1, 2, 3], max_tokens=2, is_last_turn=True)
    assert r2.prefetch == "late"
    out, _ = h.step()
    assert r2 not in [ch.request for ch in out.chunks] and r2.block_table is None  # it waits for the reload
    h.run()
    assert r2.num_cached_tokens == 20 and r2.num_loaded_tokens == 0  # not recomputed, not reloaded twice
    assert r2.output_token_ids == expected(r2.prompt_token_ids, 2)
    st = h.s.stats
    assert (st.prefetch_late, st.prefetch_used, st.prefetch_wasted) == (1, 0, 0)
    assert len(h.s.prefetcher) == 0


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("hybrid", [False, True])
def test_random_programs_keep_the_kv_consistent(seed, hybrid):
    """Programs with random tools, ends and releases over a small device and host
    tier and lagging copies (and the hybrid cache's window parts): every output
    is the model's, every step's accounting holds (the harness checks integrity
    each step)."""
    rng = random.Random(seed)
    kw = dict(num_blocks=48, host=72, window=6, window_pages=2) if hybrid else dict(num_blocks=16, host=24)
    h = _tiered(LaggingHarness("agentserve", lag=rng.randint(1, 3), budget=64, **kw),
                durations=[rng.uniform(0.1, 3.0) for _ in range(150)], reload_s=0.5)
    progs = {f"P{i}": prompt_of(100 + i, rng.randint(8, 30)) for i in range(8)}
    turns = {pid: 0 for pid in progs}
    live: list = []
    for _ in range(100):
        pid = rng.choice(list(progs))
        if not any(r.program_id == pid and not r.is_finished for r in live):
            last = turns[pid] >= 3 or rng.random() < 0.1
            r = h.req(f"{pid}/{turns[pid]}", pid, progs[pid], max_tokens=rng.randint(1, 4),
                      ttl_hint=rng.choice([0.0, None]), is_last_turn=last)
            r.tool_name = TOOL
            live.append(r)
            turns[pid] += 1
        for _ in range(rng.randint(0, 6)):
            h.step()
        for r in live:
            if r.is_finished and r.program_id in progs and r.request_id.endswith(f"/{turns[r.program_id] - 1}"):
                if r.is_last_turn:
                    turns[r.program_id] = 0
                    progs[r.program_id] = prompt_of(rng.randrange(10**6), rng.randint(8, 30))
                else:
                    progs[r.program_id] = r.token_ids + [rng.randrange(100, 200) for _ in range(rng.randint(1, 6))]
        if rng.random() < 0.05:
            h.s.release_program(rng.choice(list(progs)))
        if h.s.has_work:
            h.clock.advance(rng.uniform(0.0, 0.4))
            h.step()
        else:
            h.idle(rng.uniform(0.0, 0.4))
    h.run()
    h.run(until=lambda: not h.s.copies_in_flight)
    for r in live:
        assert r.output_token_ids == expected(r.prompt_token_ids, r.max_tokens)
    st = h.s.stats
    assert st.prefetch_used + st.prefetch_late + st.prefetch_wasted <= st.prefetch_issued
    assert st.prefetch_issued > 0 and st.preemptions == 0
    if hybrid:  # some prefetched blocks came back with their window parts
        assert h.kv.window_tier.num_reloaded > 0 and st.prefetch_blocks > st.prefetch_issued


def test_counted_in_metrics_and_on_the_dashboard():
    from agentserve.policy.toolcall_scan import ValidatorCounts
    from agentserve.server.dashboard_view import DashboardSource, build_state
    from agentserve.server.engine_snapshot import take_snapshot
    from agentserve.server.metrics import ServerMetrics

    h = _tiered(Harness("agentserve", num_blocks=12, budget=64, host=32))
    r1 = _first_turn(h)
    _until_due(h)
    h.idle(0.01)
    h.req("t2", "P", r1.token_ids + [1, 2, 3], max_tokens=2, is_last_turn=True)
    h.run()
    text = ServerMetrics("m").render(take_snapshot(h.s, ValidatorCounts())).decode()
    assert 'agentserve:prefetch_issued_total{model_name="m"} 1.0' in text
    assert 'agentserve:prefetch_blocks_total{model_name="m"} 5.0' in text
    assert 'agentserve:prefetch_used_total{model_name="m"} 1.0' in text
    assert 'agentserve:prefetch_wasted_total{model_name="m"} 0.0' in text
    counters = build_state(h.s, DashboardSource(), h.clock.now(), None)["counters"]
    assert (counters["prefetch_issued"], counters["prefetch_used"], counters["prefetch_late"]) == (1, 1, 0)


@pytest.mark.parametrize("disk_lag", [0, 2])
def test_a_chain_on_disk_is_reloaded_with_its_own_kv(disk_lag):
    """kv/prefetch_loads.py on the disk tier's fake executor (test_disk_tier.py), which
    tracks every block's content through the tiers: the prefetched blocks hold the
    chain's KV, and the next run of the sequence hits them on the device."""
    from test_disk_tier import mk, seq

    from agentserve.kv.prefetch_loads import chain_reload, landed, load_chain

    t = mk()
    for tag in range(1, 4):  # device -> host -> disk, as in test_disk_tier
        t.run(seq(tag))
    t.disk_lag = disk_lag  # from here the disk reloads land batches after their host part
    kv = t.kv
    tokens = seq(1)
    path = kv.index.walk(tokens)
    r = chain_reload(kv, path)
    nodes = r.nodes
    assert len(nodes) == 2 and all(n.block is None and kv.disk.readable(n) for n in nodes)
    loads = load_chain(kv, r, now=1.0)
    assert [n for n, _ in loads] == nodes and not landed(kv, loads)
    assert chain_reload(kv, path) is None  # a reload under way is not issued twice
    t.step()
    while t.in_flight:
        t.land()
        kv.check_integrity()
    assert landed(kv, loads)
    for i, (node, block) in enumerate(loads):
        assert node.block is block and t.dev[block.block_id] == tuple(tokens[i * 4:(i + 1) * 4])
    assert t.run(tokens) == (2, 0, 0)  # a hit on the device: nothing reloaded on its path


def test_a_reload_that_does_not_fit_changes_nothing():
    from test_disk_tier import mk, seq

    from agentserve.kv.prefetch_loads import chain_reload, load_chain

    t = mk(device=3)
    for tag in range(1, 3):
        t.run(seq(tag))
    kv = t.kv
    r = chain_reload(kv, kv.index.walk(seq(1)))
    st = kv.admit(kv.match(seq(5)), 12, 0.0)  # a request holds every device block
    assert st is not None and kv.num_free_blocks == 0 and r.nodes
    assert load_chain(kv, r, 0.0) is None
    kv.check_integrity([st])
    assert not kv.copies.loading and not kv.disk_copies.loading


def test_a_program_ended_during_its_reload_leaves_the_blocks_first_in_line():
    h = _tiered(LaggingHarness("agentserve", lag=3, num_blocks=12, budget=64, host=32))
    r1 = _first_turn(h)
    _until_due(h)
    blocks = [n.block for n in h.kv.index.walk(r1.token_ids)]
    assert h.kv.copies_in_flight and all(b is not None for b in blocks)
    h.s.end_program("P")
    assert h.s.stats.prefetch_wasted == 1 and h.s.stats.prefetch_wasted_blocks == 5
    while h.s.copies_in_flight:
        h.idle(0.01)
        h.s.copies_done(h.ex.poll_copies(wait=1.0))
    h.idle(0.01)
    cold = h.kv.pool._cold
    assert all(b.ref_cnt == 0 and b.strategy_data is cold for b in blocks)  # evicted before any other
    h.s.check_integrity()


def _hybrid(lag: int = 0) -> Harness:
    """agentserve over a host tier and the hybrid cache (a window of 6 positions, parts of 2 pages)."""
    kw = dict(num_blocks=48, budget=16, host=96, window=6, window_pages=2)
    return _tiered(LaggingHarness("agentserve", lag=lag, **kw) if lag else Harness("agentserve", **kw))


def _hybrid_first_turn(h: Harness):
    """P's first turn, then one whose prompt evicts P's blocks and their window parts to the host tier."""
    r1 = _first_turn(h, evict=False)
    for i in range(2):  # live programs' turns, unpinned (an ended one's blocks would go first)
        h.req(f"f{i}", f"Q{i}", prompt_of(2 + i, 100), max_tokens=1, ttl_hint=0.0)
        h.run()
    h.run(until=lambda: not h.s.copies_in_flight)
    m = h.kv.match(r1.token_ids + [1])
    assert m.num_tokens == 20 and m.num_host_blocks == 5  # the whole chain, its window from part copies
    return r1


@pytest.mark.parametrize("lag", [0, 3])
def test_under_the_hybrid_cache_the_chain_comes_back_with_its_window(lag):
    h = _hybrid(lag)
    r1 = _hybrid_first_turn(h)
    _until_due(h)
    st = h.s.stats
    parts = h.kv.parts
    lo = parts.first_needed(20)
    assert (st.prefetch_issued, st.prefetch_blocks) == (1, 5 + parts.pages * (5 - lo))
    h.run(until=lambda: not h.s.copies_in_flight)
    h.idle(0.01)
    m = h.kv.match(r1.token_ids + [1])
    assert m.num_host_blocks == 0 and parts.all_present([n.block for n in m.nodes], 20)
    r2 = h.req("t2", "P", r1.token_ids + [1, 2, 3], max_tokens=2, is_last_turn=True)
    assert r2.prefetch == "used"
    h.run()
    assert r2.num_cached_tokens == 20 and r2.num_loaded_tokens == 0  # nothing reloaded on its path
    assert r2.output_token_ids == expected(r2.prompt_token_ids, 2)
    assert (st.prefetch_used, st.prefetch_wasted, st.preemptions) == (1, 0, 0)


def test_under_the_hybrid_cache_a_lost_window_part_counts_the_prefetch_wasted():
    h = _hybrid()
    r1 = _hybrid_first_turn(h)
    _until_due(h)
    h.idle(0.01)
    while h.kv.parts.num_free_pages:  # other traffic takes the unheld parts, the blocks stay
        h.kv.parts.evict_one()
    r2 = h.req("t2", "P", r1.token_ids + [1, 2, 3], max_tokens=2, is_last_turn=True)
    assert r2.prefetch == "wasted"
    h.run()
    assert r2.output_token_ids == expected(r2.prompt_token_ids, 2)
