import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentserve.policy.tool_stats import ToolDurationStats
from agentserve.policy.ttl import (
    EtaEstimator,
    QueueDelayWindow,
    TTLModel,
    exp_optimal_ttl,
    solve_ttl,
    solve_ttl_unsorted,
)

# ----------------------------------------------------------------------------- solve_ttl


def _objective(durations, benefit, tau):
    return sum(1 for d in durations if d <= tau) / len(durations) * benefit - tau


def _brute_candidates(durations, benefit):
    """Paper's rule by brute force: candidates {0} U durations, ties -> shorter tau."""
    if not durations or benefit <= 0:
        return 0.0
    best_tau, best_val = None, None
    for tau in sorted({0.0} | {d for d in durations if d >= 0}):
        val = _objective(durations, benefit, tau)
        if best_val is None or val > best_val:
            best_tau, best_val = tau, val
    return best_tau


_durations = st.lists(
    st.one_of(
        st.floats(min_value=0.0, max_value=50.0, allow_nan=False),
        st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0]),  # force ties and exact zeros
    ),
    max_size=40,
)
_benefit = st.one_of(st.floats(min_value=-5.0, max_value=80.0, allow_nan=False),
                     st.sampled_from([0.0, 1.0, 2.0, 4.0]))


@settings(max_examples=400, deadline=None)
@given(_durations, _benefit)
def test_solve_ttl_equals_brute_force_over_candidates(durations, benefit):
    assert solve_ttl(sorted(durations), benefit) == _brute_candidates(durations, benefit)
    assert solve_ttl_unsorted(durations, benefit) == solve_ttl(sorted(durations), benefit)


@settings(max_examples=150, deadline=None)
@given(_durations.filter(bool), st.floats(min_value=0.01, max_value=60.0))
def test_solve_ttl_beats_fine_grid(durations, benefit):
    tau = solve_ttl(sorted(durations), benefit)
    best = _objective(durations, benefit, tau)
    hi = max(durations) + 1.0
    steps = 2000
    for i in range(steps + 1):
        g = hi * i / steps
        assert _objective(durations, benefit, g) <= best + 1e-9


def test_solve_ttl_examples():
    assert solve_ttl([], 10.0) == 0.0
    assert solve_ttl([1.0, 2.0], 0.0) == 0.0
    assert solve_ttl([1.0, 2.0], -3.0) == 0.0
    assert solve_ttl([1.0, 2.0], float("nan")) == 0.0
    # all tools take 1 s, a reload costs 5 s: pin for exactly 1 s
    assert solve_ttl([1.0] * 10, 5.0) == 1.0
    # reload cheaper than the wait: do not pin
    assert solve_ttl([1.0] * 10, 0.9) == 0.0
    # exact tie between tau = 0 (value 0) and tau = 1 (1*1 - 1 = 0): shorter wins
    assert solve_ttl([1.0], 1.0) == 0.0
    # bimodal: short tools worth pinning, the long tail is not
    d = sorted([0.2] * 80 + [100.0] * 20)
    assert solve_ttl(d, 3.0) == 0.2
    # zero durations are covered by tau = 0
    assert solve_ttl([0.0, 0.0, 5.0], 100.0) == 5.0
    assert solve_ttl([0.0, 0.0, 5.0], 6.0) == 0.0


def test_solve_ttl_negative_durations_count_but_are_not_candidates():
    d = [-1.0, 2.0]
    # P(0) = 0.5 -> 0.5*B; tau = 2 -> B - 2. B = 3: 1.5 vs 1 -> 0
    assert solve_ttl(d, 3.0) == 0.0
    assert solve_ttl(d, 5.0) == 2.0


# ----------------------------------------------------------------------------- exp optimum


@pytest.mark.parametrize("mean,benefit", [(1.0, 0.5), (1.0, 1.0), (1.0, 2.0), (1.0, 10.0),
                                          (0.2, 0.5), (3.0, 40.0), (0.925, 7.3), (5.0, 4.0)])
def test_exp_optimal_ttl_matches_numeric_maximum(mean, benefit):
    def f(tau):
        return (1.0 - math.exp(-tau / mean)) * benefit - tau

    hi = max(10.0 * mean, benefit) + 1.0
    steps = 200000
    grid_best = max(range(steps + 1), key=lambda i: f(hi * i / steps))
    tau_num = hi * grid_best / steps
    tau = exp_optimal_ttl(mean, benefit)
    assert tau == pytest.approx(tau_num, abs=2 * hi / steps + 1e-9)
    assert f(tau) >= f(tau_num) - 1e-12
    if benefit <= mean:
        assert tau == 0.0
    else:
        assert tau == pytest.approx(mean * math.log(benefit / mean))


def test_exp_optimal_ttl_degenerate():
    assert exp_optimal_ttl(0.0, 5.0) == 0.0
    assert exp_optimal_ttl(-1.0, 5.0) == 0.0
    assert exp_optimal_ttl(1.0, float("nan")) == 0.0
    assert exp_optimal_ttl(float("nan"), 2.0) == 0.0


# ----------------------------------------------------------------------------- eta


def _pearson_eta(programs):
    xs, ys = [], []
    for N in programs:
        for k in range(1, N):
            xs.append(k)
            ys.append(N - k)
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    cov = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    vx = sum((x - mx) ** 2 for x in xs)
    vy = sum((y - my) ** 2 for y in ys)
    return -cov / math.sqrt(vx * vy)


def test_eta_fixed_turns_is_one():
    e = EtaEstimator()
    for _ in range(50):
        e.add_program(11)
    assert e.value() == pytest.approx(1.0, abs=1e-12)


def test_eta_geometric_turns_is_near_zero():
    rng = random.Random(12345)
    e = EtaEstimator(window=20000)
    p = 0.15
    for _ in range(20000):
        n = 1
        while rng.random() > p:
            n += 1
        e.add_program(n)
    assert abs(e.value()) < 0.05


def test_eta_matches_direct_pearson_with_window_eviction():
    rng = random.Random(5)
    e = EtaEstimator(window=30)
    progs = []
    for _ in range(200):
        N = rng.randint(1, 25)
        e.add_program(N)
        progs.append(N)
        win = progs[-30:]
        pairs = sum(N - 1 for N in win)
        if pairs >= 2 and len({(k, N - k) for N in win for k in range(1, N)}) > 1:
            assert e.value() == pytest.approx(_pearson_eta(win), abs=1e-9)
    assert len(e) == 30


def test_eta_prior_when_undefined():
    e = EtaEstimator()
    assert e.value() == 1.0  # no programs
    e.add_program(2)
    assert e.value() == 1.0  # one pair
    e.add_program(2)
    e.add_program(1)
    assert e.value() == 1.0  # all pairs (1, 1): zero variance
    e.add_program(0)  # ignored
    assert len(e) == 3
    assert EtaEstimator(prior=0.25).value() == 0.25
    e.add_program(3)  # pairs (1,1) x2, (1,2), (2,1): defined
    assert e.num_pairs() == 4
    assert e.value() == pytest.approx(_pearson_eta([2, 2, 1, 3]))


def test_eta_window_slides():
    e = EtaEstimator(window=4)
    for N in (3, 7, 20, 2):
        e.add_program(N)
    for _ in range(4):
        e.add_program(9)  # the mixed programs slide out
    assert e.value() == pytest.approx(1.0)


# ----------------------------------------------------------------------------- queue delay


def test_queue_delay_window():
    q = QueueDelayWindow(window=3)
    assert q.mean() == 0.0 and len(q) == 0
    q.add(1.0)
    q.add(2.0)
    assert q.mean() == pytest.approx(1.5)
    q.add(3.0)
    q.add(10.0)
    assert len(q) == 3 and q.mean() == pytest.approx(5.0)
    q.add(-4.0)  # clamped to 0
    q.add(float("nan"))  # ignored
    assert q.mean() == pytest.approx((3.0 + 10.0 + 0.0) / 3)


# ----------------------------------------------------------------------------- TTL model


def _feed(stats, tool, durations):
    for d in durations:
        stats.record(tool, d)


def test_regimes_switch_at_k():
    K = 100
    stats = ToolDurationStats()
    queue = QueueDelayWindow()
    queue.add(2.0)
    eta = EtaEstimator(prior=0.5)  # undefined -> 0.5, to tell it apart from the default's 1
    m = TTLModel(k_threshold=K, stats=stats, eta=eta, queue=queue)
    reload_s = 3.0

    # |S| = 0: default regime, mu = default_tool_mean, eta = 1
    assert m.ttl("bash", reload_s) == pytest.approx(exp_optimal_ttl(1.0, 2.0 * 1.0 + reload_s))
    assert m.last_regime == "default" and m.last_benefit == pytest.approx(5.0)

    # |S| = K: still default, mu = global mean
    _feed(stats, "other", [0.4] * K)
    assert m.ttl("bash", reload_s) == pytest.approx(exp_optimal_ttl(0.4, 5.0))
    assert m.last_regime == "default"

    # |S| = K + 1, |S[bash]| = 1 <= K: global samples, B = T * eta + r
    stats.record("bash", 2.5)
    tau = m.ttl("bash", reload_s)
    assert m.last_regime == "global"
    assert m.last_benefit == pytest.approx(2.0 * 0.5 + 3.0)
    assert tau == solve_ttl(stats.global_sorted_samples(), 4.0) == 0.4
    # unknown tool and no tool both use the global samples
    m.ttl(None, reload_s)
    assert m.last_regime == "global"
    m.ttl("never-seen", reload_s)
    assert m.last_regime == "global"

    # |S[bash]| = K: still global; K + 1: tool samples
    _feed(stats, "bash", [2.5] * (K - 1))
    assert stats.count("bash") == K
    m.ttl("bash", reload_s)
    assert m.last_regime == "global"
    stats.record("bash", 2.5)
    tau = m.ttl("bash", reload_s)
    assert m.last_regime == "tool"
    assert tau == solve_ttl(stats.sorted_samples("bash"), 4.0) == 2.5
    # "other" has exactly K samples: global
    assert m.regime("other") == "global" and m.regime("bash") == "tool"
    assert m.decide("other", reload_s) == (0.4, "global")

    assert m.regime_counts == {"default": 2, "global": 5, "tool": 1}


def test_cold_start_trap_avoided():
    stats = ToolDurationStats()
    _feed(stats, "grep", [0.1, 0.2, 0.3])  # global mean 0.2 s, far below K samples
    m = TTLModel(stats=stats)
    tau = m.ttl("grep", prefill_reload_seconds=0.5)
    assert m.last_regime == "default"
    assert tau > 0.0
    assert tau == pytest.approx(0.2 * math.log(0.5 / 0.2))


def test_cold_start_without_samples_uses_configured_mean():
    # mu = 1 s literally: a 0.5 s reload never pins (the trap)...
    assert TTLModel().ttl("x", 0.5) == 0.0
    # ...a configured prior mean fixes it
    m = TTLModel(default_tool_mean=0.1)
    assert m.ttl("x", 0.5) == pytest.approx(0.1 * math.log(5.0))
    # all-zero samples keep the configured prior
    s = ToolDurationStats()
    s.record("t", 0.0)
    assert TTLModel(default_tool_mean=0.1, stats=s).default_mean() == 0.1


def test_model_sanitises_reload_and_defaults_objects():
    m = TTLModel()
    assert m.ttl("x", -5.0) == 0.0
    assert m.ttl("x", float("nan")) == 0.0
    assert m.last_benefit == 0.0
    assert isinstance(m.stats, ToolDurationStats)
    with pytest.raises(ValueError):
        TTLModel(default_tool_mean=0.0)
    with pytest.raises(ValueError):
        TTLModel(k_threshold=-1)


def test_end_to_end_events_drive_tool_regime():
    rng = random.Random(0)
    m = TTLModel(k_threshold=20)
    t = 0.0
    for i in range(200):
        pid = f"p{i % 7}"
        tool = "fast" if i % 2 else "slow"
        t += 1.0
        m.stats.on_finish(pid, tool, t)
        dur = rng.uniform(0.05, 0.15) if tool == "fast" else rng.uniform(20, 30)
        m.stats.on_arrival(pid, t + dur)
    assert m.ttl("fast", 1.0) > 0.0 and m.last_regime == "tool"
    assert m.ttl("slow", 1.0) == 0.0 and m.last_regime == "tool"


def _calls_until_ttl_follows(shift_alpha: float, before, after, settled) -> int | None:
    """Tool "t" is called 500 times with `before` latencies, then 400 times with
    `after` ones, beside a steady tool "u". Returns after how many calls past the
    swap the learned TTL of "t" entered `settled` and stayed there (None: never)."""
    rng = random.Random(5)
    stats = ToolDurationStats(shift_alpha=shift_alpha)
    m = TTLModel(k_threshold=100, stats=stats)
    for _ in range(500):
        stats.record("t", before(rng))
        stats.record("u", rng.uniform(4.0, 6.0))
    assert not settled(m.ttl("t", 30.0))
    since = None
    for call in range(1, 401):
        stats.record("t", after(rng))
        stats.record("u", rng.uniform(4.0, 6.0))
        if settled(m.ttl("t", 30.0)):
            since = since or call
        else:
            since = None
    return since


@pytest.mark.parametrize("before,after,settled", [
    (lambda r: r.uniform(0.9, 1.1), lambda r: r.uniform(9.0, 11.0), lambda ttl: 10.5 <= ttl <= 11.0),
    (lambda r: r.uniform(9.0, 11.0), lambda r: r.uniform(0.9, 1.1), lambda ttl: 1.05 <= ttl <= 1.1),
], ids=["slower", "faster"])
def test_ttl_follows_a_tool_latency_shift_within_bounded_calls(before, after, settled):
    """After a tool's latency distribution changes, the TTL is the optimum for
    the new one within the shift test's delay plus the K samples the paper asks
    of any new tool; a window that only slides takes several hundred calls."""
    bound = 100 + 2 * 32  # K + twice the shift test's window
    follows = _calls_until_ttl_follows(1e-4, before, after, settled)
    assert follows is not None and follows <= bound, follows
    sliding = _calls_until_ttl_follows(0.0, before, after, settled)
    assert sliding is None or sliding > bound, sliding
