"""When to bring a program's KV back from a tier below the device before its
next turn arrives: the lead time of a prefetch, chosen by the same kind of
cost reasoning as the TTL of Eq. 2 (policy/ttl.py).

A turn ends at time 0 and calls a tool whose duration D follows the learned
distribution (policy/tool_stats.py's samples); the program's KV, off the
device, takes R seconds to reload from its tier. A prefetch started at s
finishes at s + R. For the next turn arriving at D:

* D >= s + R: the KV is back in time, the turn saves R, and the reloaded
  blocks sat on the device for the D - s seconds since the prefetch began;
* s <= D < s + R: the prefetch is late, the turn saves the D - s seconds the
  reload had already run (and waits for the rest);
* D < s: the turn came first and reloads its KV itself: nothing saved, nothing spent.

A second of device memory taken early costs `hold_cost` seconds (the
pressure-weighted cost of a pinned second, as agentserve prices a pin), so the
value of starting at s is

    V(s) = E[ min(max(D - s, 0), R) ] - hold_cost * E[ max(D - s, 0) ]

and the lead time is argmax_s V(s), kept only when V > 0. Over the empirical
samples V is piecewise linear in s; as s passes a duration d - R its term's
slope falls (from +hold_cost to -(1 - hold_cost)), and as it passes d it rises
(to 0), so the maximum lies at s = 0 or at some d - R: n + 1 candidates, each
priced in O(log n) from prefix sums of the sorted samples. Pure Python; time
is passed in."""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

__all__ = ["PrefetchPlan", "prefetch_start", "prefetch_value", "stage_start"]

# More samples than this are priced at this many evenly spaced candidates
# (one per sample below it): a turn's decision stays well under a millisecond.
MAX_CANDIDATES = 256


@dataclass(frozen=True)
class PrefetchPlan:
    """A prefetch into the device to start at `at` (absolute time; None: none),
    expected to take `reload_s` seconds from `tier`, worth `value_s` seconds of
    a turn's wait on average; and, KV expected on disk below a host tier, a
    disk -> host stage to start at `stage_at` (None: none), worth
    `stage_value_s`. Neither is started after `until` (the longest return
    recorded: a turn later than that is no return the durations predict)."""

    at: float | None
    reload_s: float
    tier: str
    value_s: float
    until: float
    stage_at: float | None = None
    stage_value_s: float = 0.0


class _Sums:
    """Prefix sums of one sorted sample tuple (kept while the tuple is the same object)."""

    __slots__ = ("samples", "prefix")

    def __init__(self, samples: Sequence[float]) -> None:
        self.samples = samples
        self.prefix = [0.0, *accumulate(samples)]


_cache: list[_Sums] = []


def _sums(samples: Sequence[float]) -> _Sums:
    for s in _cache:
        if s.samples is samples:
            return s
    s = _Sums(samples)
    _cache.insert(0, s)
    del _cache[8:]
    return s


def prefetch_value(sorted_durations: Sequence[float], start: float, reload_s: float, hold_cost: float) -> float:
    """V(start) of the module's docstring over `sorted_durations` (ascending, finite)."""
    n = len(sorted_durations)
    if n == 0:
        return 0.0
    sums = _sums(sorted_durations)
    return _value(sorted_durations, sums.prefix, n, start, reload_s, hold_cost)


def _value(d: Sequence[float], prefix: list[float], n: int, s: float, r: float, c: float) -> float:
    i0 = bisect_left(d, s)  # first return at or after the start
    i1 = bisect_left(d, s + r)  # first return after the reload is done
    partial = (prefix[i1] - prefix[i0]) - s * (i1 - i0)  # sum of D - s over the late returns
    held = (prefix[n] - prefix[i1]) - s * (n - i1)  # sum of D - s over the timely ones
    return ((1.0 - c) * partial + r * (n - i1) - c * held) / n


def prefetch_start(sorted_durations: Sequence[float], reload_s: float, hold_cost: float) -> tuple[float, float] | None:
    """(s, V(s)): when to start a prefetch after the turn ended, and its expected
    saving in seconds; None when no start saves anything (no samples, no reload
    time, or memory too dear: V <= 0 everywhere). `sorted_durations` ascending
    and finite; `hold_cost` >= 0 (at 1 or more nothing is worth it)."""
    n = len(sorted_durations)
    if n == 0 or not reload_s > 0.0 or math.isinf(reload_s) or not hold_cost >= 0.0 or hold_cost >= 1.0:
        return None
    d = sorted_durations
    prefix = _sums(d).prefix
    step = max(1, n // MAX_CANDIDATES)
    best_s, best_v = 0.0, _value(d, prefix, n, 0.0, reload_s, hold_cost)
    for i in range(0, n, step):
        s = d[i] - reload_s
        if s <= 0.0:
            continue
        v = _value(d, prefix, n, s, reload_s, hold_cost)
        if v > best_v:  # strict: ties keep the earlier start (the turn less likely to come first)
            best_s, best_v = s, v
    return (best_s, best_v) if best_v > 0.0 else None


def stage_start(sorted_durations: Sequence[float], read_s: float, host_residency_s: float) -> tuple[float, float] | None:
    """(s, V(s)) of a disk -> host stage taking `read_s` seconds (the disk read
    it takes off the turn), None when no start saves anything. It holds no
    device memory, only a host slot, whose copy the host tier evicts about
    `host_residency_s` after it was written (policy/pressure.py
    `TurnoverMeter`): a copy held t seconds is lost before its turn with a
    chance of about t / residency, and then the turn reads the disk after all,
    so a held second costs read_s / residency seconds of the turn's wait (the
    hold cost of `prefetch_start`)."""
    if not host_residency_s > 0.0:
        return None
    return prefetch_start(sorted_durations, read_s, read_s / host_residency_s)
