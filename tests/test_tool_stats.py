import math
import random

import pytest

from agentserve.policy.tool_stats import ToolDurationStats


def test_duration_finish_to_next_arrival():
    s = ToolDurationStats()
    s.on_finish("p1", "bash", 10.0)
    s.on_finish("p2", "search", 11.0)
    assert s.has_pending("p1") and s.pending_tool("p2") == "search"
    assert s.on_arrival("p1", 10.75) == ("bash", 0.75)
    assert s.on_arrival("p1", 12.0) is None  # nothing pending any more
    assert s.on_arrival("p2", 14.0) == ("search", 3.0)
    assert s.on_arrival("unknown", 1.0) is None
    assert s.samples("bash") == (0.75,)
    assert s.count("bash") == 1 and s.count("search") == 1 and s.count("nope") == 0
    assert s.global_count() == 2
    assert s.mean("bash") == pytest.approx(0.75)
    assert s.global_mean() == pytest.approx((0.75 + 3.0) / 2)
    assert s.mean("nope") is None
    assert sorted(s.tools()) == ["bash", "search"]
    assert s.pending_count() == 0


def test_no_tool_call_clears_pending_and_latest_finish_wins():
    s = ToolDurationStats()
    s.on_finish("p", "bash", 1.0)
    s.on_finish("p", None, 2.0)
    assert s.on_arrival("p", 3.0) is None
    s.on_finish("p", "a", 1.0)
    s.on_finish("p", "b", 2.0)
    assert s.on_arrival("p", 2.5) == ("b", 0.5)


def test_negative_and_nonfinite():
    s = ToolDurationStats()
    s.on_finish("p", "t", 5.0)
    assert s.on_arrival("p", 4.0) == ("t", 0.0)
    s.on_finish("p", "t", float("nan"))
    assert not s.has_pending("p")
    s.record("t", float("inf"))
    assert s.count("t") == 1
    assert s.global_mean() == 0.0


def test_empty_stats():
    s = ToolDurationStats()
    assert s.global_mean() is None and s.global_count() == 0
    assert s.samples("x") == () and s.global_samples() == ()
    assert s.sorted_samples("x") == () and s.global_sorted_samples() == ()
    assert s.version() == 0 and s.version("x") == 0


def test_windows_bounded_and_means_follow_window():
    s = ToolDurationStats(max_samples_per_tool=5, max_global_samples=8)
    for i in range(20):
        s.record("a" if i % 2 else "b", float(i))
    assert s.count("a") == 5 and s.count("b") == 5 and s.global_count() == 8
    assert list(s.samples("a")) == [9.0, 11.0, 13.0, 15.0, 17.0, 19.0][-5:]
    assert list(s.global_samples()) == [float(i) for i in range(12, 20)]
    assert s.mean("a") == pytest.approx(sum([11.0, 13.0, 15.0, 17.0, 19.0]) / 5)
    assert s.global_mean() == pytest.approx(sum(range(12, 20)) / 8)


def test_sorted_samples_match_window_and_are_cached():
    rng = random.Random(7)
    s = ToolDurationStats(max_samples_per_tool=50, max_global_samples=120)
    for _ in range(1000):
        s.record(rng.choice("xyz"), round(rng.expovariate(1.0), 2))  # rounding: many ties
        for t in "xyz":
            assert list(s.sorted_samples(t)) == sorted(s.samples(t))
        assert list(s.global_sorted_samples()) == sorted(s.global_samples())
    # no change -> the very same object, no re-sort, same version
    v = s.version("x")
    a = s.sorted_samples("x")
    assert s.sorted_samples("x") is a and s.version("x") == v
    g = s.global_sorted_samples()
    assert s.global_sorted_samples() is g
    s.record("x", 0.5)
    assert s.version("x") > v and s.sorted_samples("x") is not a
    assert s.global_sorted_samples() is not g


def test_running_mean_no_drift():
    rng = random.Random(3)
    s = ToolDurationStats(max_samples_per_tool=100, max_global_samples=100)
    for _ in range(20000):
        s.record("t", rng.uniform(0, 1e6) if rng.random() < 0.01 else rng.uniform(0, 1e-3))
    assert math.isclose(s.mean("t"), math.fsum(s.samples("t")) / 100, rel_tol=1e-9)


def test_tool_eviction_least_recently_updated():
    s = ToolDurationStats(max_tools=3)
    s.record("a", 1.0)
    s.record("b", 1.0)
    s.record("c", 1.0)
    s.record("a", 2.0)  # a is now the most recent
    s.record("d", 1.0)  # evicts b
    assert s.tools() == ["c", "a", "d"]
    assert s.count("b") == 0 and s.samples("b") == () and s.mean("b") is None
    assert s.evicted_tools == 1
    assert s.global_count() == 5  # global window keeps evicted tools' samples
    # a pending departure for an evicted tool still records on arrival
    s.on_finish("p", "b", 0.0)
    assert s.on_arrival("p", 1.0) == ("b", 1.0)
    assert "b" in s.tools() and len(s.tools()) == 3 and s.count("b") == 1
    assert s.version("b") > 0


def test_pending_cap_drops_oldest():
    s = ToolDurationStats(max_pending=3)
    for i in range(5):
        s.on_finish(f"p{i}", "t", float(i))
    assert s.pending_count() == 3 and s.dropped_pending == 2
    assert s.on_arrival("p0", 10.0) is None and s.on_arrival("p1", 10.0) is None
    assert s.on_arrival("p4", 10.0) == ("t", 6.0)
    # re-finishing refreshes a program's position
    s.on_finish("p2", "t", 20.0)
    s.on_finish("p5", "t", 20.0)
    s.on_finish("p6", "t", 20.0)  # drops p3 (oldest), not p2
    assert not s.has_pending("p3") and s.has_pending("p2")


def test_forget_program():
    s = ToolDurationStats()
    s.on_finish("p", "t", 1.0)
    s.forget_program("p")
    s.forget_program("never-seen")
    assert s.on_arrival("p", 2.0) is None
    assert s.global_count() == 0


def test_bad_constructor_args():
    for kw in ("max_samples_per_tool", "max_global_samples", "max_tools", "max_pending"):
        with pytest.raises(ValueError):
            ToolDurationStats(**{kw: 0})


# ---------------------------------------------------------------- latency shifts


def test_a_shifted_tool_forgets_its_older_samples_here_and_in_the_global_window():
    rng = random.Random(1)
    s = ToolDurationStats()
    for _ in range(400):
        s.record("slow", rng.uniform(0.9, 1.1))
        s.record("other", rng.uniform(4.0, 6.0))
    assert s.shifts == 0
    calls = 0
    while s.shifts == 0:
        s.record("slow", rng.uniform(9.0, 11.0))  # the backend got ten times slower
        calls += 1
        assert calls <= 32, "the shift went unnoticed"
    # exactly the samples since the change are kept (the two ranges do not overlap)
    assert s.count("slow") == calls and min(s.samples("slow")) >= 9.0
    assert s.count("other") == 400  # other tools keep theirs
    assert s.global_count() == 400 + calls
    assert sorted(s.global_samples()) == sorted(s.samples("other") + s.samples("slow"))
    assert list(s.global_sorted_samples()) == sorted(s.global_samples())
    assert s.global_mean() == pytest.approx(math.fsum(s.global_samples()) / s.global_count())
    # and it learns on from there
    s.record("slow", 10.0)
    assert s.count("slow") == calls + 1


@pytest.mark.parametrize("name,draw", [
    ("exponential", lambda r: r.expovariate(1.0)),
    ("heavy-tailed", lambda r: r.lognormvariate(0.0, 1.5)),
    ("rounded", lambda r: round(r.expovariate(1.0), 1)),  # many ties
])
def test_stable_latencies_are_not_mistaken_for_shifts(name, draw):
    shifts = 0
    for seed in range(4):
        rng = random.Random(seed)
        s = ToolDurationStats()
        for _ in range(5000):
            s.record("t", draw(rng))
        shifts += s.shifts
    assert shifts <= 1, f"{name}: {shifts} false shifts in 20000 samples"


def test_shift_detection_can_be_turned_off():
    s = ToolDurationStats(shift_alpha=0.0)
    for i in range(2000):
        s.record("t", 1.0 if i < 1000 else 100.0)
    assert s.shifts == 0 and s.count("t") == 1000
    with pytest.raises(ValueError):
        ToolDurationStats(shift_alpha=1.0)
