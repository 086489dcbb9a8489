"""The CacheTTL time-to-live model (CacheTTL paper v4, sections 4.1-4.2).

When a turn ends in a tool call, the program's KV may be pinned for

    tau* = argmax_tau  P(tau, f) * B  -  tau,        B = T * eta + PrefillReload(r)      (Eq. 2)

where P(tau, f) is the empirical CDF of the recorded durations of tool f, T the mean queueing
delay of evicted returning requests, and eta the workload's memoryfulness.  This module holds the
pieces and the model that combines them with the paper's cold-start rule (threshold K):

* ``|S| <= K`` (few samples at all): T_default, the optimum under exponential durations, eta = 1;
* ``|S[f]| <= K`` (tool new or unknown): solve Eq. 2 on the global samples S;
* otherwise: solve Eq. 2 on the tool's samples S[f].

Pure Python; time is always passed in.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque
from itertools import islice
from typing import Iterable, Sequence

from agentserve.policy.tool_stats import ToolDurationStats

__all__ = [
    "solve_ttl",
    "solve_ttl_unsorted",
    "exp_optimal_ttl",
    "EtaEstimator",
    "QueueDelayWindow",
    "TTLModel",
    "REGIMES",
]

REGIMES = ("default", "global", "tool")


def solve_ttl(sorted_durations: Sequence[float], benefit: float) -> float:
    """Exact maximiser of Eq. 2 over the paper's candidate set.

    ``sorted_durations`` must be ascending and finite (use :func:`solve_ttl_unsorted`
    otherwise; it is not checked, to keep this one pass).  Candidates are 0 and every distinct
    non-negative duration; P(tau) = #(d <= tau) / n.  Returns argmax P(tau)*benefit - tau with
    ties broken toward the shorter tau.  Empty samples, or benefit <= 0 / NaN / inf, give 0.

    Cost: O(log n) binary searches plus one pass over the durations in (0, benefit).  A
    candidate tau >= benefit can never beat tau = 0 (P <= 1 gives P*B - tau <= 0 <= P(0)*B), so
    those are skipped.  At sorted index i the value (i+1)/n * B - d[i] equals P(d[i])*B - d[i]
    at the last copy of a repeated duration and is smaller at earlier copies, so scanning in
    ascending order and keeping only strict improvements yields the shortest optimal tau.
    """
    n = len(sorted_durations)
    if n == 0 or not (benefit > 0.0) or math.isinf(benefit):
        return 0.0
    d = sorted_durations
    start = bisect_left(d, 0.0)  # negative durations count in P but are not candidates
    lo = bisect_right(d, 0.0, start)  # first strictly positive duration
    hi = bisect_left(d, benefit, lo)
    base = (lo / n) * benefit  # tau = 0: P(0) counts durations <= 0
    if hi <= lo:
        return 0.0
    best_val = base
    best_tau = 0.0
    # A plain loop measured faster here than chained C-level map()s (no temporaries).
    for k, u in enumerate(islice(d, lo, hi), lo + 1):
        val = (k / n) * benefit - u
        if val > best_val:  # strict: ties keep the shorter tau
            best_val = val
            best_tau = u
    return best_tau


def solve_ttl_unsorted(durations: Iterable[float], benefit: float) -> float:
    """:func:`solve_ttl` for samples in any order (sorts a copy, dropping non-finite values)."""
    return solve_ttl(sorted(x for x in durations if math.isfinite(x)), benefit)


def exp_optimal_ttl(mean: float, benefit: float) -> float:
    """argmax_tau (1 - exp(-tau/mean)) * benefit - tau for Exp(mean) durations.

    The derivative (benefit/mean) * exp(-tau/mean) - 1 vanishes at tau = mean * ln(benefit/mean);
    when benefit <= mean it is <= 0 already at tau = 0, so the optimum is 0.
    """
    if not (mean > 0.0) or not (benefit > mean) or math.isinf(mean) or math.isinf(benefit):
        return 0.0
    return mean * math.log(benefit / mean)


class EtaEstimator:
    """Memoryfulness eta = -Corr(k, N - k) over the finished programs of a sliding window.

    A program with N turns contributes the pairs (k, N - k), k = 1 .. N - 1.  The sums needed
    for the correlation have closed forms in N, so the estimator keeps exact integer running
    sums: ``add_program`` and ``value`` are O(1) and never drift.

    When the correlation is undefined (fewer than 2 pairs, or zero variance, e.g. every program
    has 2 turns) ``value`` returns ``prior``.  The default prior 1.0 is the paper's cold-start
    assumption: T_default is derived for a fully memoryful workload (eta = 1).  It is also the
    conservative side: early on T (the queueing delay) is 0, so eta barely matters, and a
    memoryful guess keeps pins instead of disabling the queueing-delay term.
    (A third-party re-implementation returns 0 here instead.)  eta may be negative for
    anti-memoryful workloads; it is not clamped, as in the paper.
    """

    def __init__(self, window: int = 256, prior: float = 1.0) -> None:
        if int(window) < 1:
            raise ValueError(f"window must be >= 1, got {window!r}")
        self.window = int(window)
        self.prior = float(prior)
        self._programs: deque[int] = deque()
        self._n = 0  # number of pairs
        self._sx = 0  # sum k (== sum N-k)
        self._sxx = 0  # sum k^2 (== sum (N-k)^2)
        self._sxy = 0  # sum k (N-k)

    @staticmethod
    def _sums(N: int) -> tuple[int, int, int, int]:
        m = N - 1
        return (
            m,
            N * m // 2,
            m * N * (2 * N - 1) // 6,
            m * N * (N + 1) // 6,
        )

    def _apply(self, N: int, sign: int) -> None:
        n, sx, sxx, sxy = self._sums(N)
        self._n += sign * n
        self._sx += sign * sx
        self._sxx += sign * sxx
        self._sxy += sign * sxy

    def add_program(self, num_turns: int) -> None:
        """A program finished after ``num_turns`` LLM calls (values < 1 are ignored)."""
        N = int(num_turns)
        if N < 1:
            return
        if len(self._programs) == self.window:
            self._apply(self._programs.popleft(), -1)
        self._programs.append(N)
        self._apply(N, +1)

    def __len__(self) -> int:
        return len(self._programs)

    def export_state(self) -> list[int]:
        """The window's programs' turn counts, oldest first (for a restart)."""
        return list(self._programs)

    def import_state(self, turns: list[int]) -> None:
        """Replace the window by exported turn counts (the newest `window` kept). ValueError on
        a count that is not an integer >= 1, changing nothing."""
        counts = [_count(n) for n in turns]
        self._programs.clear()
        self._n = self._sx = self._sxx = self._sxy = 0
        for n in counts:
            self.add_program(n)

    def num_pairs(self) -> int:
        return self._n

    def value(self) -> float:
        n = self._n
        if n < 2:
            return self.prior
        # x = k and y = N - k have the same sum and sum of squares over the pairs,
        # so Var(x) == Var(y) and Corr = Cov / Var.
        var = n * self._sxx - self._sx * self._sx
        if var <= 0:
            return self.prior
        cov = n * self._sxy - self._sx * self._sx
        return -(cov / var)


class QueueDelayWindow:
    """Sliding-window mean of the queueing delay of evicted returning requests (the paper's T).

    Empty -> 0.0 (the paper initialises T to 0).  Negative values are clamped to 0 and
    non-finite ones ignored.
    """

    def __init__(self, window: int = 256) -> None:
        if int(window) < 1:
            raise ValueError(f"window must be >= 1, got {window!r}")
        self.window = int(window)
        self._values: deque[float] = deque(maxlen=self.window)
        self._total = 0.0
        self._adds = 0

    def add(self, seconds: float) -> None:
        if not math.isfinite(seconds):
            return
        x = max(0.0, float(seconds))
        if len(self._values) == self.window:
            self._total -= self._values[0]
        self._values.append(x)
        self._total += x
        self._adds += 1
        if self._adds >= self.window:  # bound float drift
            self._adds = 0
            self._total = math.fsum(self._values)

    def mean(self) -> float:
        n = len(self._values)
        return max(0.0, self._total / n) if n else 0.0

    def export_state(self) -> list[float]:
        """The window's delays, oldest first (for a restart)."""
        return list(self._values)

    def import_state(self, delays: list[float]) -> None:
        """Replace the window by exported delays. ValueError on one that is not a finite number
        >= 0, changing nothing."""
        values = [_seconds(x) for x in delays]
        self._values.clear()
        self._total = 0.0
        self._adds = 0
        for x in values:
            self.add(x)

    def __len__(self) -> int:
        return len(self._values)


def _count(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"a program's turn count must be an integer >= 1, got {n!r}")
    return n


def _seconds(x) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
        raise ValueError(f"a delay must be a finite number of seconds >= 0, got {x!r}")
    return float(x)


class TTLModel:
    """Eq. 2 with the paper's three-regime cold start.

    ``ttl(tool, prefill_reload_seconds)`` returns the TTL in seconds (0 = do not pin).  The
    regime used is left in ``last_regime`` ("default", "global" or "tool") and counted in
    ``regime_counts``; ``last_benefit`` holds the B used.  Feed ``stats`` (turn finish/arrival),
    ``eta`` (finished programs) and ``queue`` (queueing delays of evicted returning requests)
    from the scheduler; the model only reads them.

    ``tool_name`` None (or a tool without more than K samples) uses the global samples once
    there are more than K of them; whether a turn without a tool call is pinned at all is the
    caller's decision.
    """

    def __init__(
        self,
        k_threshold: int = 100,
        default_tool_mean: float = 1.0,
        stats: ToolDurationStats | None = None,
        eta: EtaEstimator | None = None,
        queue: QueueDelayWindow | None = None,
    ) -> None:
        if int(k_threshold) < 0:
            raise ValueError(f"k_threshold must be >= 0, got {k_threshold!r}")
        if not (default_tool_mean > 0.0) or math.isinf(default_tool_mean):
            raise ValueError(f"default_tool_mean must be positive, got {default_tool_mean!r}")
        self.k_threshold = int(k_threshold)
        self.default_tool_mean = float(default_tool_mean)
        self.stats = stats if stats is not None else ToolDurationStats()
        self.eta = eta if eta is not None else EtaEstimator()
        self.queue = queue if queue is not None else QueueDelayWindow()
        self.last_regime: str | None = None
        self.last_benefit: float = 0.0
        self.regime_counts: dict[str, int] = {r: 0 for r in REGIMES}

    def regime(self, tool_name: str | None) -> str:
        """Which regime ``ttl(tool_name, ...)`` would use now."""
        K = self.k_threshold
        if tool_name is not None and self.stats.count(tool_name) > K:
            return "tool"  # checked first: NO_TOOL_CALL samples are not in the global window
        if self.stats.global_count() <= K:
            return "default"
        return "global"

    def default_mean(self, tool_name: str | None = None) -> float:
        """The mean mu of the exponential prior used by the default regime.

        THE COLD-START TRAP: the paper's T_default takes mu = 1 s literally, and with T = 0 at
        start-up B = PrefillReload(r), so tau* = mu * ln(B / mu) = 0 whenever rebuilding the
        context takes under a second -- on small models or fast hardware nothing would ever be
        pinned, and without pins the model keeps seeing no benefit.  The unit mean is only a
        stand-in for "the typical tool duration", so we use what is known about that: the global
        mean of recorded durations as soon as there is one sample, else ``default_tool_mean``
        (configurable, 1 s by default as in the paper).
        """
        m = self.stats.global_mean() if self.stats.global_count() > 0 else None
        if m is None and tool_name is not None:
            m = self.stats.mean(tool_name)  # only NO_TOOL_CALL gaps recorded so far
        if m is None or not (m > 0.0):
            # No samples, or all recorded durations are 0 (instant tools): keep the configured
            # prior rather than mu = 0, which would never pin.
            return self.default_tool_mean
        return m

    def ttl(self, tool_name: str | None, prefill_reload_seconds: float) -> float:
        """TTL in seconds for pinning after a turn that called ``tool_name`` (0: do not pin)."""
        return self.decide(tool_name, prefill_reload_seconds)[0]

    def decide(self, tool_name: str | None, prefill_reload_seconds: float, eta: float | None = None,
               pin_cost: float = 1.0) -> tuple[float, str]:
        """``(ttl, regime)``; also sets ``last_regime``/``last_benefit``, counts the regime.

        ``eta``: use this memoryfulness instead of the learned one (not in the default regime,
        which assumes 1). ``pin_cost``: the cost of a second pinned, in seconds of the benefit's
        unit (the paper's 1: some request is always blocked by the pin); argmax P*B - c*tau is
        argmax P*(B/c) - tau, so the solvers take B/c. It must be positive.
        """
        reload_s = float(prefill_reload_seconds)
        if not math.isfinite(reload_s) or reload_s < 0.0:
            reload_s = 0.0
        if not pin_cost > 0.0:
            raise ValueError(f"pin_cost must be positive, got {pin_cost!r}")
        T = self.queue.mean()
        regime = self.regime(tool_name)
        if regime == "default":
            benefit = T * 1.0 + reload_s  # T_default assumes a fully memoryful workload
            tau = exp_optimal_ttl(self.default_mean(tool_name), benefit / pin_cost)
        else:
            benefit = T * (self.eta.value() if eta is None else eta) + reload_s
            if regime == "global":
                samples = self.stats.global_sorted_samples()
            else:
                samples = self.stats.sorted_samples(tool_name)  # type: ignore[arg-type]
            tau = solve_ttl(samples, benefit / pin_cost)
        self.last_regime = regime
        self.last_benefit = benefit
        self.regime_counts[regime] += 1
        return tau, regime
