"""The `agentserve` policy (policy/policies/agentserve.py) and what it reads:
the KV pressure meter and the tiers' turnover (policy/pressure.py), ablation
specs (policy/registry.py), and the "disk" retention through the KV manager."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from agentserve.clock import SimClock
from agentserve.engine.request import Request
from agentserve.engine.scheduler import Scheduler, SchedulerConfig
from agentserve.kv.manager import KVCacheManager
from agentserve.policy.base import PolicyContext
from agentserve.policy.policies.agentserve import AgentServe
from agentserve.policy.policies.continuum import Continuum
from agentserve.policy.pressure import PressureMeter, TurnoverMeter
from agentserve.policy.program import ProgramState
from agentserve.policy.registry import parse_policy_spec

from test_decision_log import _tool_durations
from test_disk_tier import BS, Tiers, seq


def _turn(policy, tool="grep", tokens=512, now=100.0):
    req = SimpleNamespace(request_id="r", program_id="p", arrival_time=now - 1, waiting_since=now - 1,
                          preempted=False, num_computed_tokens=tokens, output_text=None, tool_name=tool,
                          ttl_hint=None)
    return policy.on_turn_end(req, ProgramState("p", 0.0), now)


# more than K = 100 samples (the tool's own regime), mixed so no latency shift is seen
DURATIONS = [1.0, 1.0, 2.0, 1.0, 1.0, 2.0, 1.0, 1.0, 2.0, 8.0] * 10 + [8.0]


# --- the meters ---

def test_pressure_meter_rises_while_blocked_and_decays_when_not():
    m = PressureMeter(horizon=10.0, initial=0.0)
    m.observe(0.0, True)
    assert m.value(0.0) == 0.0
    assert m.value(10.0) == pytest.approx(1 - math.exp(-1))
    m.observe(30.0, False)
    high = m.value(30.0)
    assert high == pytest.approx(1 - math.exp(-3))
    assert m.value(40.0) == pytest.approx(high * math.exp(-1))
    assert PressureMeter().value(5.0) == 1.0  # nothing observed: the paper's assumption
    with pytest.raises(ValueError):
        PressureMeter(horizon=0)


def test_turnover_meter_gives_the_time_to_rewrite_the_tier():
    m = TurnoverMeter(num_slots=1000, horizon=5.0)
    assert m.residency() == math.inf
    for t in range(200):
        m.observe(t * 0.5, t * 25)  # 50 slots a second
    assert m.residency() == pytest.approx(20.0, rel=0.01)
    m.observe(200.0, 199 * 25)  # no stores for a long time: copies last longer
    assert m.residency() > 1000.0


# --- the TTL ---

def test_a_pin_costs_what_the_kv_pressure_says():
    pressure = [1.0]
    ctx = PolicyContext(reload_cost=lambda n: 3.0, kv_pressure=lambda: pressure[0])
    pol, paper = AgentServe(ctx, age_credit=15.0), Continuum(PolicyContext(reload_cost=lambda n: 3.0))
    for p in (pol, paper):
        _tool_durations(p, "grep", DURATIONS)
    contended = _turn(pol)
    assert contended.ttl == _turn(paper).ttl  # full pressure: Eq. 2 as the paper has it
    assert pol.decisions.recent()[-1].inputs.pin_cost == 1.0
    pressure[0] = 0.0  # nothing waits for KV: pin until the slowest recorded return
    idle = _turn(pol)
    assert idle.action == "pin" and idle.ttl == 8.0 > contended.ttl
    assert pol.decisions.recent()[-1].inputs.pin_cost == pol.min_pin_cost
    off = AgentServe(PolicyContext(reload_cost=lambda n: 3.0, kv_pressure=lambda: 0.0), pressure=False)
    _tool_durations(off, "grep", DURATIONS)
    assert _turn(off).ttl == contended.ttl  # the ablation: the paper's cost whatever the pressure


def test_the_miss_is_priced_at_the_tier_that_outlasts_the_wait():
    residency = {"host": 0.5, "disk": 100.0}
    ctx = PolicyContext(reload_cost=lambda n: 0.01, prefill_cost=lambda n: 5.0,
                        tier_reload={"host": lambda n: 0.01, "disk": lambda n: 0.2},
                        tier_residency=lambda t: residency[t], kv_pressure=lambda: 1.0)
    pol = AgentServe(ctx)
    _tool_durations(pol, "grep", DURATIONS)  # mean 1.6 s: longer than the host tier keeps a copy
    assert pol.miss_cost(512, pol.expected_wait("grep")) == (0.2, "disk")
    r = _turn(pol)
    assert r.action == "disk" and pol.decisions.recent()[-1].inputs.source == "disk"
    residency["host"] = 60.0
    assert pol.miss_cost(512, 1.6) == (0.01, "host")
    assert _turn(pol).action == "free"  # the host tier will have it: spilled there on eviction
    residency["host"] = residency["disk"] = 0.1  # no tier keeps it: a miss is a prefill, worth a pin
    assert pol.miss_cost(512, 1.6) == (5.0, "prefill")
    assert _turn(pol).action == "pin"
    flat = AgentServe(ctx, tiers=False)
    assert flat.miss_cost(512, 1.6) == (0.01, "reload")  # the ablation: one reload cost, the paper's


# --- the age credit ---

def _waiting(program_id, arrival, prompt=30_000):
    return SimpleNamespace(request_id=f"{program_id}@{arrival}", program_id=program_id, arrival_time=arrival,
                           waiting_since=arrival, preempted=False, num_prompt_tokens=prompt, num_computed_tokens=0,
                           output_text=None, tool_name=None, ttl_hint=None)


def test_with_a_host_tier_the_order_is_the_programs_own():
    """Where a host tier keeps evicted KV, seniority has no cap (the wait bound
    bounds the wait instead); without a tier, or with the bound off, the 50 s credit."""
    host = PolicyContext(reload_cost=lambda n: n * 5e-6, host_tier=True)
    flat = PolicyContext(reload_cost=lambda n: n * 1e-4)
    old, new = ProgramState("old", 0.0), ProgramState("new", 100.0)
    newcomer, returning = _waiting("new", 100.0), _waiting("old", 170.0)  # old's turn, 70 s after new's first
    pol = AgentServe(host)
    assert pol.bounded and pol.credit(returning) is None
    assert pol.priority(returning, old, 170.0) < pol.priority(newcomer, new, 170.0)
    for capped in (AgentServe(flat), AgentServe(host, wait_bound=None)):
        assert not capped.bounded and capped.credit(returning) == 50.0
        # 50 s of credit do not cover the 70 s: the newcomer first
        assert capped.priority(newcomer, new, 170.0) < capped.priority(returning, old, 170.0)
    assert Continuum(host).credit(returning) == 15.0  # the paper's policy is unchanged
    for bad in (0, -1.0, True, "soon"):
        with pytest.raises((ValueError, TypeError)):
            AgentServe(host, wait_bound=bad)


def _feed(pol, n, wait, start=0.0):
    """n requests of new programs, each admitted `wait(i)` seconds after it arrived, in order."""
    for i in range(n):
        t = start + i
        r = _waiting(f"w{start}-{i}", t)
        prog = ProgramState(r.program_id, t)
        pol.on_arrival(r, prog, t)
        pol.on_admitted(r, prog, t + wait(i), wait(i), False)


def test_the_wait_bound_is_twice_the_p90_of_fcfs_waits_fixed_at_arrival():
    # (short_first=none: the order would follow the KV pressure, time_dependent regardless)
    pol = AgentServe(PolicyContext(reload_cost=lambda n: 0.0, host_tier=True), short_first=None)
    _feed(pol, 60, lambda i: i % 10)  # FCFS's waits 0..9 s, six times each: p90 9 s
    assert not pol.time_dependent  # nobody waits with a deadline
    assert pol.fcfs_wait.quantile(0.9) == 9.0 and pol.max_wait() == 18.0
    newcomer, old = _waiting("new", 100.0), ProgramState("old", 0.0)
    pol.on_arrival(newcomer, ProgramState("new", 100.0), 100.0)
    returning = _waiting("old", 101.0)
    pol.on_arrival(returning, old, 101.0)
    assert pol.time_dependent
    assert not pol.late(newcomer, 117.9) and pol.late(newcomer, 118.0)  # 100 + 2 x 9
    prog = ProgramState("new", 100.0)
    assert pol.priority(returning, old, 117.9) < pol.priority(newcomer, prog, 117.9)  # the program under way first
    assert pol.priority(newcomer, prog, 118.0) < pol.priority(returning, old, 118.0)  # until the newcomer is late
    pol.on_admitted(returning, old, 102.0, 1.0, True)
    pol.on_withdrawn(newcomer, 120.0)  # aborted while waiting: it leaves FCFS's queue too
    assert not pol.time_dependent and not pol.late(newcomer, 200.0)
    _feed(pol, 1, lambda i: 0.0, start=300.0)  # paired with its own arrival, not the withdrawn one's
    assert pol.fcfs_wait.quantile(1.0) == 9.0
    # the paper's Continuum and the bound's ablation keep no deadlines
    off = AgentServe(PolicyContext(reload_cost=lambda n: 0.0, host_tier=True), wait_bound=None)
    _feed(off, 60, lambda i: i % 10)
    off.on_arrival(newcomer, ProgramState("new", 100.0), 100.0)
    assert not off.time_dependent and not off.late(newcomer, 1e6) and off.max_wait() is None


def test_with_a_host_tier_a_late_request_goes_first_but_keeps_the_headroom():
    """N fits in the free blocks but not beside R's decode reserve. Past its
    wait-bound deadline it goes first (ahead of O, an older program's turn that
    arrived after it), yet it still waits for the headroom: admitted without it,
    it would take the room R decodes into and be preempted. Once R is done, N
    is admitted before O."""
    from agentserve.policy.fcfs_wait import FcfsWait
    from test_scheduler import Harness, prompt_of
    h = Harness("agentserve", num_blocks=64, budget=64, host=32)
    pol = h.s.policy
    pol.fcfs_wait = FcfsWait(warmup=1)
    a = h.req("a", "A", prompt_of(9, 8), max_tokens=1)
    h.clock.advance(1.0)  # FCFS's wait: 1 s, so a deadline 2 s after arrival
    h.run()
    assert a.is_finished and pol.bounded
    r = h.req("r1", "R", prompt_of(2, 8), max_tokens=200)  # runs on, 128 tokens of headroom ahead
    h.step()
    n = h.req("n1", "N", prompt_of(3, 120), max_tokens=4)  # 31 blocks: they fit, but not beside R's reserve
    h.step()
    h.clock.advance(2.0)
    h.step()
    assert pol.late(n, h.clock.now()) and not pol.skips_headroom(n, h.clock.now())
    assert n not in h.s.running and r.reserve + 31 > h.kv.num_free_blocks >= 31
    o = h.req("o1", "A", prompt_of(9, 8) + prompt_of(4, 4), max_tokens=1)  # the older program's next turn
    h.step()
    assert next(iter(h.s.waiting)) is n and o not in h.s.running  # the head waits; nothing overtakes it
    while not r.is_finished:
        h.step()
    h.step()
    assert n in h.s.running or n.is_finished
    h.run()
    assert n.is_finished and o.is_finished and h.s.num_waiting == 0 and h.s.stats.preemptions == 0
    # without a host tier a late request (past the share's deadline) is held back only for KV
    flat = AgentServe(PolicyContext(reload_cost=lambda n: 0.0, kv_tokens=1000))
    flat._share_applies = True
    late = _waiting("x", 0.0)
    assert flat.late(late, 60.0) and flat.skips_headroom(late, 60.0)


def test_while_compute_bound_the_turn_with_the_fewest_new_tokens_goes_first():
    """With a host tier and the KV pressure under `short_first`, a waiting turn
    that adds fewer tokens to its program's history goes before one that adds
    more, whatever the programs' ages; under pressure the programs' order stands.
    Lateness still comes first."""
    pressure = [0.1]
    pol = AgentServe(PolicyContext(reload_cost=lambda n: 0.0, host_tier=True, kv_pressure=lambda: pressure[0]))
    old, young = ProgramState("old", 0.0), ProgramState("young", 50.0)
    old.history = list(range(1000))
    long_turn = _waiting("old", 60.0, prompt=1000 + 4000)  # 4000 new tokens (a long tool output)
    first_turn = _waiting("young", 61.0, prompt=2000)  # a first turn: 2000 new tokens
    assert pol.time_dependent
    assert pol.priority(first_turn, young, 62.0) < pol.priority(long_turn, old, 62.0)
    pressure[0] = 0.5  # KV holds requests back half the time: the programs' own order
    assert pol.priority(long_turn, old, 62.0) < pol.priority(first_turn, young, 62.0)
    pressure[0] = 0.1
    pol._deadlines[long_turn.request_id] = 61.5  # late: it goes first whatever its size
    assert pol.priority(long_turn, old, 62.0) < pol.priority(first_turn, young, 62.0)
    off = AgentServe(PolicyContext(reload_cost=lambda n: 0.0, host_tier=True, kv_pressure=lambda: 0.0),
                     short_first=None)
    assert not off.time_dependent
    assert off.priority(long_turn, old, 62.0) < off.priority(first_turn, young, 62.0)
    flat = AgentServe(PolicyContext(reload_cost=lambda n: 0.0, kv_pressure=lambda: 0.0))  # no tier: age order
    assert flat.priority(long_turn, old, 62.0) < flat.priority(first_turn, young, 62.0)
    for bad in (0, 1.5, True, "low"):
        with pytest.raises((ValueError, TypeError)):
            AgentServe(PolicyContext(reload_cost=lambda n: 0.0), short_first=bad)


def test_an_aborted_waiting_request_leaves_fcfs_queue_too():
    from test_scheduler import Harness, prompt_of
    h = Harness("agentserve", num_blocks=64, budget=64, host=32)
    pol = h.s.policy
    h.req("r1", "R", prompt_of(2, 8), max_tokens=200)
    h.step()
    h.req("x", "X", prompt_of(4, 200), max_tokens=4)  # does not fit beside R: waits
    h.step()
    assert len(pol.fcfs_wait._arrivals) == 1  # R's arrival was paired with its admission
    h.s.abort("x")
    assert len(pol.fcfs_wait._arrivals) == 0
    h.s.abort("r1")  # a running request was admitted: nothing more to withdraw
    assert len(pol.fcfs_wait._arrivals) == 0 and len(pol.fcfs_wait) == 1


# --- ablation specs ---

def test_policy_specs_parse_options_and_name_what_is_wrong():
    assert parse_policy_spec("agentserve") == ("agentserve", {})
    assert parse_policy_spec("agentserve:pressure=off:eta=1:age-credit=none") == \
        ("agentserve", {"pressure": False, "eta": 1, "age_credit": None})
    assert parse_policy_spec("continuum:max_ttl=30.5") == ("continuum", {"max_ttl": 30.5})
    assert parse_policy_spec("agentserve:wait_bound=none") == ("agentserve", {"wait_bound": None})
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        parse_policy_spec("nope")
    with pytest.raises(ValueError, match="has no option 'depth'.*takes"):
        parse_policy_spec("agentserve:depth=3")
    with pytest.raises(ValueError, match="takes none"):
        parse_policy_spec("vllm-fcfs:x=1")
    with pytest.raises(ValueError, match="not key=value"):
        parse_policy_spec("agentserve:eta")
    # a value the policy refuses is reported with the spec, before any run starts
    with pytest.raises(ValueError, match="'agentserve:deadline=0': deadline must be > 0"):
        parse_policy_spec("agentserve:deadline=0")
    with pytest.raises(ValueError, match="agentserve:running_share=2"):
        parse_policy_spec("agentserve:running_share=2")
    with pytest.raises(ValueError, match="agentserve:deadline=soon"):
        parse_policy_spec("agentserve:deadline=soon")


# --- the scheduler feeds the meter; the "disk" retention ---

def _req(rid, prog, n, max_tokens=4, now=0.0):
    return Request(rid, prog, list(range(1000 * int(rid[1:]), 1000 * int(rid[1:]) + n)), max_tokens,
                   arrival_time=now)


def test_the_scheduler_measures_pressure_when_a_request_is_held_back():
    clock = SimClock()
    kv = KVCacheManager(8, BS)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv, "agentserve", clock)
    sched.pressure = PressureMeter(horizon=1.0, initial=0.0)
    sched.add_request(_req("r1", "a", 20))
    sched.schedule()
    clock.advance(5.0)
    assert sched.policy.ctx.kv_pressure() == 0.0  # it fit
    sched.add_request(_req("r2", "b", 20))  # 6 + 6 blocks of 8: held back
    sched.schedule()
    clock.advance(5.0)
    assert sched.policy.ctx.kv_pressure() > 0.99


def test_a_disk_retention_puts_the_copies_first_in_line_for_the_disk():
    t = Tiers(KVCacheManager(3, BS, host_blocks=3, disk_blocks=8))
    kv = t.kv
    t.run(seq(1, blocks=1))
    st = kv.admit(kv.match(seq(2)), len(seq(2)), 0.0)  # evicts sequence 1 to the host tier
    for i, b in enumerate(st.blocks[:2]):
        t.dev[b.block_id] = tuple(seq(2)[i * BS:(i + 1) * BS])
    kv.commit(st, seq(2), len(seq(2)) - 1)
    assert kv.swap_out(st, 0.0, onward=True) == 2
    t.step()
    assert [n.tokens[0] // 1000 for n in kv.host._lru] == [2, 2, 1]  # the cold end: sequence 2's copies
    t.run(seq(3))
    t.run(seq(4))  # evicts sequence 3 to the host tier, which moves sequence 2 on to disk, not 1
    kv.check_integrity()
    assert 1 in {n.tokens[0] // 1000 for n in kv.host._lru}  # the older copy stayed in host memory
    assert t.run(seq(2))[2] == 2  # read back from disk, with the right content (checked by run)


def test_a_full_tier_evicts_a_confirmed_copy_before_one_in_flight():
    kv = KVCacheManager(8, BS, host_blocks=2)
    t = Tiers(kv)
    for tag in (1, 2, 3):
        t.run(seq(tag, blocks=1))  # on the device, indexed
    a, b, c = (kv.index.walk(seq(tag, blocks=1))[0] for tag in (1, 2, 3))
    host = kv.host
    host.store(a)
    host.confirm(a)
    host.store(b)  # in flight
    host.demote(b)  # and the coldest
    host.store(c)  # the tier is full: the confirmed copy goes, not the one being written
    assert host.slot(a) is None and host.slot(b) is not None and b in host.pending and host.slot(c) is not None
    host.check_integrity()


def test_the_dashboard_shows_the_pin_cost_and_where_a_miss_reloads_from():
    from agentserve.server.dashboard_view import _decision

    ctx = PolicyContext(reload_cost=lambda n: 0.01, prefill_cost=lambda n: 5.0, tier_reload={"host": lambda n: 0.01},
                        tier_residency=lambda t: 0.1, kv_pressure=lambda: 0.25)
    pol = AgentServe(ctx)
    _turn(pol)
    d = _decision(pol.decisions.recent()[-1], 100.0, lambda pid: pid)
    assert d["pin_cost"] == 0.25 and d["reload_from"] == "prefill" and d["reload_s"] == 5.0


# ---------------------------------------------------------------- the running share and the deadline


def test_the_running_share_leaves_room_for_programs_between_turns():
    """With running requests at their share of the KV, a request that would fit
    in the free memory waits, and that wait is not KV pressure (the pins that
    fill the rest are what the share is for); with no share it runs."""
    from test_scheduler import Harness, prompt_of
    for spec, admitted in (("agentserve:running_share=0.5", False), ("agentserve:running_share=1", True)):
        h = Harness(spec, num_blocks=64, budget=64)
        h.s.pressure = PressureMeter(horizon=1.0, initial=0.0)
        _turn(h.s.policy, tokens=16)  # programs hold 16 tokens between turns: the other half holds some
        r1 = h.req("a", "A", prompt_of(1, 20), max_tokens=200)  # 20 + 128 tokens ahead: 37 blocks of 64
        h.step()
        r2 = h.req("b", "B", prompt_of(2, 8), max_tokens=4)  # 3 blocks: 40 > 32, and 27 are left
        for _ in range(50):
            h.step()
        assert (r2.num_output_tokens > 0) is admitted, spec
        assert h.s.policy.ctx.kv_pressure() < 0.01, spec
        h.run()
        assert r1.is_finished and r2.is_finished
        assert h.kv.num_free_blocks == h.kv.num_blocks


def test_a_request_held_back_by_the_share_that_would_not_fit_anyway_is_kv_pressure():
    from test_scheduler import Harness, prompt_of
    h = Harness("agentserve:running_share=0.5", num_blocks=64, budget=64)
    h.s.pressure = PressureMeter(horizon=1.0, initial=0.0)
    _turn(h.s.policy, tokens=16)
    assert h.s.policy.running_kv_share == 0.5
    h.req("a", "A", prompt_of(1, 20), max_tokens=200)
    h.step()
    r2 = h.req("b", "B", prompt_of(2, 110), max_tokens=4)  # 29 blocks: over the share, and over the 27 left
    for _ in range(100):
        h.step()
    assert r2.num_output_tokens == 0
    assert h.s.policy.ctx.kv_pressure() > 0.5
    h.run()
    assert r2.is_finished


def test_a_request_past_the_deadline_goes_first_and_may_reclaim_an_earlier_programs_pin():
    """N, a new program, does not fit while P (an earlier program) holds a pin
    and R runs: it may not take an earlier program's pin, so it waits. Past the
    deadline it may, and is admitted; without a deadline, or where the share
    does not apply (at 0.8 the rest, 19 tokens of 96, would not hold P's 21),
    it still waits."""
    from test_scheduler import Harness, prompt_of
    for spec, late_admits in (("agentserve:running_share=0.7:deadline=1", True),
                              ("agentserve:running_share=0.7:deadline=none", False),
                              ("agentserve:running_share=0.8:deadline=1", False)):
        h = Harness(spec, num_blocks=24, budget=64)
        h.req("p1", "P", prompt_of(1, 20), max_tokens=2, tool_name="search", ttl_hint=100.0)
        h.run()
        assert "P" in h.kv.pins
        h.req("r1", "R", prompt_of(2, 8), max_tokens=40)  # runs on, holding a reserve of 12 blocks
        h.step()
        n = h.req("n1", "N", prompt_of(3, 64), max_tokens=4)  # 16 blocks; 15 are free beside P's pin and R
        h.step()
        assert n not in h.s.running and "P" in h.kv.pins
        h.clock.advance(1.0)
        h.step()
        assert (n in h.s.running) is late_admits, spec
        assert ("P" in h.kv.pins) is not late_admits, spec
        assert h.s.stats.pins_reclaimed == int(late_admits)
        h.run()
        assert n.is_finished


def test_a_late_request_goes_ahead_of_a_pinned_programs_turn():
    ctx = PolicyContext(reload_cost=lambda n: 0.0, is_pinned=lambda pid: pid == "P", kv_tokens=100_000)
    pol = AgentServe(ctx, deadline=10.0)
    assert not pol.time_dependent and pol.max_wait() is None  # nobody can be late before the share applies
    _turn(pol, tokens=512)  # the share applies: its 5% holds a program
    assert pol.time_dependent and pol.max_wait() == 10.0
    newcomer = Request("n", "N", [1, 2, 3], 4, arrival_time=100.0)
    pinned = Request("p", "P", [1, 2, 3], 4, arrival_time=104.0)
    progs = {"N": ProgramState("N", 100.0), "P": ProgramState("P", 50.0)}
    key = lambda r, now: pol.priority(r, progs[r.program_id], now)  # noqa: E731
    assert key(pinned, 105.0) < key(newcomer, 105.0)  # a pinned program's turn goes first ...
    assert key(newcomer, 110.0) < key(pinned, 110.0)  # ... until the newcomer has waited 10 s


def test_share_and_deadline_options_are_checked():
    ctx = PolicyContext(reload_cost=lambda n: 0.0)
    for bad in (dict(running_share=0.0), dict(running_share=1.5), dict(deadline=0.0), dict(deadline=-3.0)):
        with pytest.raises(ValueError):
            AgentServe(ctx, **bad)
    assert not AgentServe(ctx, deadline=None).time_dependent
    assert Continuum(ctx).running_kv_share == 1.0 and not Continuum(ctx).late(None, 0.0)


def test_the_running_share_applies_without_a_host_tier_only():
    pol = AgentServe(PolicyContext(reload_cost=lambda n: 0.0, kv_tokens=10_000), running_share=0.9)
    _turn(pol, tokens=512)
    assert pol.running_kv_share == 0.9
    tiered = AgentServe(PolicyContext(reload_cost=lambda n: 0.0, host_tier=True, kv_tokens=10_000),
                        running_share=0.9)
    _turn(tiered, tokens=512)
    assert tiered.running_kv_share == 1.0


def test_the_share_and_the_deadline_apply_only_where_the_rest_holds_a_program():
    """The default share (0.95) leaves 5% of the KV: 500 tokens of 10k. It
    applies once programs are seen to hold less than that at their turns' ends,
    and stops when their mean context outgrows it; the deadline goes with it."""
    pol = AgentServe(PolicyContext(reload_cost=lambda n: 0.0, kv_tokens=10_000))
    late = Request("n", "N", [1, 2, 3], 4, arrival_time=0.0)
    assert pol.running_kv_share == 1.0 and not pol.late(late, 100.0)  # nothing measured yet
    _turn(pol, tokens=400)
    assert pol.running_kv_share == 0.95
    assert pol.late(late, 50.0) and not pol.late(late, 49.0)
    _turn(pol, tokens=640)  # mean 520: past the room, within the 10% that keeps it from flapping
    assert pol.running_kv_share == 0.95
    _turn(pol, tokens=700)  # mean 580 > 550
    assert pol.running_kv_share == 1.0 and not pol.late(late, 100.0)
    _turn(pol, tokens=260)  # mean 500: fits again
    assert pol.running_kv_share == 0.95
    assert AgentServe(PolicyContext(reload_cost=lambda n: 0.0), running_share=0.9).running_kv_share == 1.0
