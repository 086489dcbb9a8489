"""The policy's ring of retention decisions with their inputs (policy/decision_log.py),
which the dashboard shows: what is recorded at the end of a turn, and that the
ring stays bounded."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from agentserve.policy.base import PolicyContext
from agentserve.policy.decision_log import Decision, DecisionLog
from agentserve.policy.policies.continuum import Continuum
from agentserve.policy.policies.program_fcfs import ProgramFcfs
from agentserve.policy.policies.static_ttl import StaticTTL
from agentserve.policy.program import ProgramState
from agentserve.policy.tool_stats import NO_TOOL_CALL


def _turn(policy, pid: str, rid: str, tool: str | None, now: float, ttl_hint: float | None = None):
    req = SimpleNamespace(request_id=rid, program_id=pid, arrival_time=now - 1, waiting_since=now - 1,
                          preempted=False, num_computed_tokens=512, output_text=None, tool_name=tool,
                          ttl_hint=ttl_hint)
    return policy.on_turn_end(req, ProgramState(pid, 0.0), now)


def _tool_durations(policy, tool: str, durations: list[float]) -> None:
    """Programs that called `tool` and came back after each duration."""
    t = 0.0
    for i, d in enumerate(durations):
        pid = f"warm-{tool}-{i}"
        policy.tool_stats.on_finish(pid, tool, t)
        policy.on_arrival(SimpleNamespace(program_id=pid), None, t + d)
        t += 10.0


def test_continuum_records_the_inputs_of_each_ttl():
    policy = Continuum(PolicyContext(reload_cost=lambda n: 3.0), k_threshold=5)
    # cold start: the default regime, exponential mean 1 s, eta taken as 1
    r = _turn(policy, "p1", "r1", "search", 100.0)
    d = policy.decisions.recent()[-1]
    assert (d.request_id, d.program_id, d.tool, d.action) == ("r1", "p1", "search", r.action)
    assert d.action == "pin" and d.ttl == pytest.approx(math.log(3.0)) == pytest.approx(r.ttl)
    assert d.tool_mean_s is None and d.tool_samples == 0
    assert d.inputs.regime == "default" and d.inputs.eta == 1.0 and d.inputs.mean_used_s == 1.0
    assert d.inputs.reload_s == 3.0 and d.inputs.benefit_s == 3.0 and d.inputs.queue_delay_s == 0.0
    # learned: more than K samples of the tool, the tool's own regime and mean
    _tool_durations(policy, "search", [0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 2.5])
    r = _turn(policy, "p1", "r2", "search", 200.0)
    d = policy.decisions.recent()[-1]
    assert d.inputs.regime == "tool" and d.tool_samples == 7
    assert d.tool_mean_s == pytest.approx(sum([0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 2.5]) / 7)
    assert d.inputs.eta == policy.eta.value() and d.inputs.mean_used_s is None
    assert d.ttl == r.ttl == 1.0  # Eq. 2 on those samples with B = 3: P(1.0) * 3 - 1 = 6/7*3 - 1 is the best
    # a turn without a tool call is recorded under its own name
    _turn(policy, "p2", "r3", None, 300.0)
    assert policy.decisions.recent()[-1].tool == NO_TOOL_CALL
    assert policy.decisions.total == 3


def test_client_hints_and_the_cap_are_recorded():
    policy = Continuum(PolicyContext(reload_cost=lambda n: 1.0), max_ttl=60.0)
    _turn(policy, "p", "r1", "run", 1.0, ttl_hint=30.0)
    _turn(policy, "p", "r2", "run", 2.0, ttl_hint=900.0)
    _turn(policy, "p", "r3", "run", 3.0, ttl_hint=0.0)
    a, b, c = policy.decisions.recent()
    assert (a.action, a.ttl, a.inputs.regime, a.inputs.capped) == ("pin", 30.0, "hint", False)
    assert (b.action, b.ttl, b.inputs.capped) == ("pin", 60.0, True)
    assert (c.action, c.ttl, c.inputs.regime) == ("free", 0.0, "hint")


def test_static_ttl_and_policies_without_a_model():
    st = StaticTTL(PolicyContext(reload_cost=lambda n: 2.0))
    r = _turn(st, "p", "r", "grep", 1.0)
    d = st.decisions.recent()[-1]
    assert d.inputs.regime == "default" and d.inputs.benefit_s == 2.0 and d.ttl == r.ttl == pytest.approx(math.log(2))
    fcfs = ProgramFcfs(PolicyContext(reload_cost=lambda n: 2.0))
    _tool_durations(fcfs, "grep", [1.0, 3.0])
    _turn(fcfs, "p", "r", "grep", 1.0)
    d = fcfs.decisions.recent()[-1]
    assert (d.action, d.ttl, d.inputs, d.tool_mean_s, d.tool_samples) == ("free", 0.0, None, 2.0, 2)


def test_the_ring_is_bounded_and_counts_everything():
    log = DecisionLog(size=4)
    for i in range(10):
        log.add(Decision(float(i), f"r{i}", "p", "t", "pin", 1.0, None, 0))
    assert len(log) == 4 and log.total == 10
    assert [d.request_id for d in log.recent()] == ["r6", "r7", "r8", "r9"]
    with pytest.raises(ValueError):
        DecisionLog(size=0)
    policy = Continuum(PolicyContext(reload_cost=lambda n: 1.0))
    for i in range(1000):
        _turn(policy, f"p{i}", f"r{i}", "t", float(i))
    assert len(policy.decisions) == 256 and policy.decisions.total == 1000
