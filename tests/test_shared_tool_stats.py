"""Tool statistics the replicas of a cluster share (policy/shared_tool_stats.py),
engine-free: a hub merges every replica's samples (never one replica's windows
over another's), each replica takes up the merged view, and no sample counts
twice, not even one recorded while an exchange was under way."""

from __future__ import annotations

import pytest

from agentserve.policy.shared_tool_stats import ToolStatsHub, ToolStatsShare
from agentserve.policy.tool_stats import ToolDurationStats


def replica(interval=5.0):
    stats = ToolDurationStats()
    return stats, ToolStatsShare(stats, interval)


def exchange(hub, name, share, now=0.0):
    share.apply(hub.exchange(name, share.take(now)))


def test_replicas_learn_from_each_others_calls_and_count_each_sample_once():
    hub = ToolStatsHub()
    a, sa = replica()
    b, sb = replica()
    for x in (1.0, 2.0, 3.0):
        a.record("search", x)
    b.record("search", 10.0)
    b.record("search", 20.0)
    b.record("run_tests", 60.0)
    exchange(hub, "a", sa)
    exchange(hub, "b", sb)
    exchange(hub, "a", sa)
    for stats in (a, b, hub.stats):
        assert sorted(stats.samples("search")) == [1.0, 2.0, 3.0, 10.0, 20.0]
        assert stats.samples("run_tests") == (60.0,) and stats.global_count() == 6
    exchange(hub, "a", sa, 10.0)  # nothing new: nothing counts twice
    exchange(hub, "b", sb, 10.0)
    assert a.count("search") == b.count("search") == hub.stats.count("search") == 5
    a.record("search", 4.0)  # learned after: A's own sample reaches B through the hub
    exchange(hub, "a", sa, 20.0)
    exchange(hub, "b", sb, 20.0)
    assert b.count("search") == 6 and 4.0 in b.samples("search")
    assert hub.merges == 7 and hub.seeded_by == "a"
    assert hub.samples == 4  # B's three and A's last; A's first three came as the empty hub's seed


def test_a_sample_recorded_during_an_exchange_is_kept_and_sent_once():
    hub = ToolStatsHub()
    a, sa = replica()
    a.record("search", 1.0)
    sent = sa.take(0.0)
    a.record("search", 2.0)  # while the exchange is under way
    sa.apply(hub.exchange("a", sent))
    assert sorted(a.samples("search")) == [1.0, 2.0]
    assert hub.stats.samples("search") == (1.0,)
    exchange(hub, "a", sa, 5.0)
    assert sorted(hub.stats.samples("search")) == sorted(a.samples("search")) == [1.0, 2.0]


def test_the_hub_starts_from_the_first_replicas_loaded_windows():
    hub = ToolStatsHub()
    a = ToolDurationStats()
    for x in (5.0, 6.0):
        a.record("build", x)  # what --state-dir gave it before the share began
    sa = ToolStatsShare(a)
    a.record("build", 7.0)  # recorded before the first take: in the seed
    exchange(hub, "a", sa)
    assert hub.seeded_by == "a" and hub.stats.samples("build") == (5.0, 6.0, 7.0)
    b, sb = replica()
    b.record("build", 1.0)  # the hub has windows: B's seed is not taken, its sample is merged
    exchange(hub, "b", sb)
    assert sorted(b.samples("build")) == [1.0, 5.0, 6.0, 7.0] and hub.seeded_by == "a"


def test_the_injected_clock_decides_when():
    _, sa = replica(interval=5.0)
    assert sa.due(100.0)
    sa.take(100.0)
    assert not sa.due(104.9) and sa.due(105.0)
    with pytest.raises(ValueError, match="> 0"):
        ToolStatsShare(ToolDurationStats(), 0.0)


@pytest.mark.parametrize("sent", [{"samples": [["search", -1.0]]}, {"samples": [["", 1.0]]},
                                  {"samples": [["search"]]}, {"samples": 3}])
def test_malformed_samples_are_refused_with_nothing_merged(sent):
    hub = ToolStatsHub()
    hub.exchange("a", {"samples": [["search", 1.0]]})
    with pytest.raises(ValueError):
        hub.exchange("b", sent)
    assert hub.stats.samples("search") == (1.0,) and hub.merges == 1 and hub.stats.tools() == ["search"]


def test_a_malformed_seed_is_refused_and_the_hub_stays_empty():
    hub = ToolStatsHub()
    with pytest.raises(ValueError):
        hub.exchange("a", {"samples": [], "seed": {"tools": [["x", [-1.0]]], "global": []}})
    assert hub.stats.tools() == [] and hub.seeded_by is None and hub.merges == 0
