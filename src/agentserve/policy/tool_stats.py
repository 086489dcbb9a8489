"""Tool-duration statistics with bounded memory.

A tool's duration is measured on the server (CacheTTL paper, section 5.1): the finish of turn k
of a program (a response that called tool f) to the arrival of turn k+1 of the same program.
:class:`ToolDurationStats` keeps, per tool name and globally, a sliding window of such durations
plus the same window kept sorted, so the TTL solver can read sorted samples without sorting.

Everything is bounded: per-tool and global windows (oldest sample dropped), the number of tool
names (least recently updated tool dropped) and the number of programs waiting for their next
turn (oldest departure dropped).  Times are passed in; nothing here reads a clock.

The TTL assumes a stable duration distribution per tool; a tool whose latency shifts (a slower
backend, a cache turned on) would otherwise be judged by its old samples until the window has
turned over (1000 calls).  After each sample, a two-sample Kolmogorov-Smirnov test compares the
tool's latest ``shift_window`` samples with the older rest of its window; when they differ at
level ``shift_alpha``, the older samples are dropped from the tool's and the global window, so the
statistics re-learn from the new distribution.  KS is distribution-free, so one threshold serves
any tool: its false alarms stay near ``shift_alpha`` per test however heavy the tail.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections import OrderedDict, deque
from typing import Sequence

__all__ = ["NO_TOOL_CALL", "ToolDurationStats"]

# The gap after a non-final turn whose output had no parsable tool call (a
# ReAct "Action:" line, a format the parser does not know, a question to the
# user). Learned in its own window like a tool, but kept out of the global
# window so that human-length gaps do not stretch every real tool's TTL.
NO_TOOL_CALL = "(no tool call)"


class _Window:
    """A sliding window of (duration, tool) samples, the durations also kept sorted, with a
    running sum and a version.  The tool stays with each sample so that the global window can
    forget one tool's samples after that tool's latency shifted."""

    __slots__ = ("samples", "sorted", "total", "version", "_adds", "_frozen", "_frozen_version")

    def __init__(self, maxlen: int) -> None:
        self.samples: deque[tuple[float, str]] = deque(maxlen=maxlen)
        self.sorted: list[float] = []
        self.total = 0.0
        self.version = 0
        self._adds = 0
        self._frozen: tuple[float, ...] = ()
        self._frozen_version = 0

    def __len__(self) -> int:
        return len(self.samples)

    def values(self) -> tuple[float, ...]:
        return tuple(x for x, _ in self.samples)

    def add(self, x: float, tool: str, version: int) -> None:
        samples = self.samples
        if len(samples) == samples.maxlen:
            old = samples[0][0]  # dropped by the append below
            del self.sorted[bisect_left(self.sorted, old)]
            self.total -= old
        samples.append((x, tool))
        insort(self.sorted, x)
        self.total += x
        self._adds += 1
        if self._adds >= samples.maxlen:  # bound the float drift of add/subtract
            self._adds = 0
            self.total = math.fsum(self.sorted)
        self.version = version

    def drop_older(self, tool: str, keep: int, version: int) -> None:
        """Forget `tool`'s samples except its `keep` most recent (rare: rebuilt in O(n log n))."""
        kept: list[tuple[float, str]] = []
        seen = 0
        for sample in reversed(self.samples):
            if sample[1] == tool:
                seen += 1
                if seen > keep:
                    continue
            kept.append(sample)
        kept.reverse()
        self.samples = deque(kept, maxlen=self.samples.maxlen)
        self.sorted = sorted(x for x, _ in kept)
        self.total = math.fsum(self.sorted)
        self._adds = 0
        self.version = version

    def shift_statistic(self, recent: int) -> float | None:
        """Two-sample KS distance between the latest `recent` samples and the older rest; None
        while the older rest is smaller than `recent` (too few to compare)."""
        n_old = len(self.samples) - recent
        if recent < 1 or n_old < recent:
            return None
        new = sorted(self.samples[-k][0] for k in range(1, recent + 1))
        every = self.sorted
        # Between two of the recent samples the recent ECDF is flat and the older one only
        # rises, so the largest gap lies at a recent sample or just below one: 2 x `recent`
        # evaluations instead of a merge of the whole window.
        d = 0.0
        for x in new:
            lo, hi = bisect_left(new, x), bisect_right(new, x)
            below = abs(lo / recent - (bisect_left(every, x) - lo) / n_old)
            at = abs(hi / recent - (bisect_right(every, x) - hi) / n_old)
            d = max(d, below, at)
        return d

    def mean(self) -> float | None:
        n = len(self.samples)
        if n == 0:
            return None
        return max(0.0, self.total / n)

    def sorted_tuple(self) -> tuple[float, ...]:
        # Rebuilt (one C-level copy, no sort) only when the window changed.
        if self._frozen_version != self.version:
            self._frozen = tuple(self.sorted)
            self._frozen_version = self.version
        return self._frozen


class ToolDurationStats:
    """Per-tool and global tool-duration windows, fed by turn finish/arrival events.

    Counts are window sizes (at most ``max_samples_per_tool`` per tool and
    ``max_global_samples`` globally).  Negative durations (clock skew) are recorded as 0;
    non-finite times are ignored.
    """

    def __init__(
        self,
        max_samples_per_tool: int = 1000,
        max_global_samples: int = 10000,
        max_tools: int = 1000,
        max_pending: int = 100000,
        shift_window: int = 32,
        shift_alpha: float = 1e-4,
    ) -> None:
        for label, v in (
            ("max_samples_per_tool", max_samples_per_tool),
            ("max_global_samples", max_global_samples),
            ("max_tools", max_tools),
            ("max_pending", max_pending),
        ):
            if int(v) < 1:
                raise ValueError(f"{label} must be >= 1, got {v!r}")
        self.max_samples_per_tool = int(max_samples_per_tool)
        self.max_global_samples = int(max_global_samples)
        self.max_tools = int(max_tools)
        self.max_pending = int(max_pending)
        if not 0.0 <= shift_alpha < 1.0:
            raise ValueError(f"shift_alpha must be in [0, 1) (0: never re-learn), got {shift_alpha!r}")
        self.shift_window = max(1, int(shift_window))
        self.shift_alpha = float(shift_alpha)
        # KS critical value: D > c(alpha) * sqrt((m + n) / (m n)), c(alpha) = sqrt(-ln(alpha / 2) / 2)
        self._shift_c = math.sqrt(-0.5 * math.log(shift_alpha / 2.0)) if shift_alpha > 0 else math.inf
        self._tools: OrderedDict[str, _Window] = OrderedDict()  # oldest update first
        self._global = _Window(self.max_global_samples)
        self._pending: OrderedDict[str, tuple[str, float]] = OrderedDict()  # oldest first
        self._tick = 0  # monotonic version source shared by all windows
        self.evicted_tools = 0
        self.dropped_pending = 0
        self.shifts = 0  # times a tool's latency shift made its older samples be dropped
        # the samples recorded here, (tool, seconds), while a cluster shares them (policy/shared_tool_stats.py)
        self.journal: list[tuple[str, float]] | None = None

    # ------------------------------------------------------------------ events

    def on_finish(self, program_id: str, tool_name: str | None, now: float) -> None:
        """A turn of ``program_id`` finished at ``now``, calling ``tool_name`` (None: no tool)."""
        pending = self._pending
        if not tool_name or not isinstance(tool_name, str) or not math.isfinite(now):
            pending.pop(program_id, None)
            return
        pending[program_id] = (tool_name, float(now))
        pending.move_to_end(program_id)
        while len(pending) > self.max_pending:
            pending.popitem(last=False)
            self.dropped_pending += 1

    def on_arrival(self, program_id: str, now: float) -> tuple[str, float] | None:
        """The next turn of ``program_id`` arrived at ``now``.

        Returns ``(tool, duration)`` when a departure was pending (and records it), else None.
        """
        entry = self._pending.pop(program_id, None)
        if entry is None or not math.isfinite(now):
            return None
        tool, departed = entry
        duration = max(0.0, float(now) - departed)
        self.record(tool, duration)
        return tool, duration

    # ------------------------------------------------------------------ learned state

    def export_state(self) -> dict:
        """The windows as plain data, for a restart (server/learned_state.py keeps it): each
        tool's samples oldest first, tools least recently updated first, and the global window
        with each sample's tool. Pending departures stay out: they are measured on this
        process's clock and name programs, which a restart does not keep."""
        return {"tools": [[tool, list(win.values())] for tool, win in self._tools.items()],
                "global": [[x, tool] for x, tool in self._global.samples],
                "shifts": self.shifts}

    def import_state(self, state: dict) -> None:
        """Replace the windows by exported ones (where a window here is smaller, its newest
        samples are kept; past ``max_tools``, the most recently updated tools). Pending
        departures are left as they are. Raises ValueError on malformed data, changing nothing."""
        try:
            tools = [(_tool_name(t), [_duration(x) for x in xs]) for t, xs in state["tools"]]
            global_ = [(_duration(x), _tool_name(t)) for x, t in state["global"]]
            shifts = int(state.get("shifts", 0))
        except (TypeError, KeyError) as e:
            raise ValueError(f"malformed tool statistics: {e!r}") from None
        self._tools.clear()
        self._global = _Window(self.max_global_samples)
        for tool, xs in tools[-self.max_tools:]:
            win = _Window(self.max_samples_per_tool)
            for x in xs:
                self._tick += 1
                win.add(x, tool, self._tick)
            self._tools[tool] = win
        for x, tool in global_:
            self._tick += 1
            self._global.add(x, tool, self._tick)
        self.shifts = shifts

    def forget_program(self, program_id: str) -> None:
        """Drop the pending departure of a program that ended."""
        self._pending.pop(program_id, None)

    def record(self, tool: str, duration: float) -> None:
        """Record one duration directly (used by :meth:`on_arrival`; handy for warm starts)."""
        if not math.isfinite(duration):
            return
        duration = max(0.0, float(duration))
        self._tick += 1
        tick = self._tick
        win = self._tools.get(tool)
        if win is None:
            win = _Window(self.max_samples_per_tool)
            self._tools[tool] = win
            while len(self._tools) > self.max_tools:
                self._tools.popitem(last=False)
                self.evicted_tools += 1
        else:
            self._tools.move_to_end(tool)
        win.add(duration, tool, tick)
        if self.journal is not None:
            self.journal.append((tool, duration))
        if tool != NO_TOOL_CALL:
            self._global.add(duration, tool, tick)
        if self._shifted(win):
            self.shifts += 1
            self._tick += 1
            keep = self._change_point(win)
            win.drop_older(tool, keep, self._tick)
            if tool != NO_TOOL_CALL:
                self._global.drop_older(tool, keep, self._tick)

    def _shifted(self, win: _Window) -> bool:
        m = self.shift_window
        d = win.shift_statistic(m)
        if d is None:
            return False
        n_old = len(win) - m
        return d > self._shift_c * math.sqrt((m + n_old) / (m * n_old))

    def _change_point(self, win: _Window) -> int:
        """How many of the latest samples came after the shift: the split of the latest
        ``shift_window`` with the largest standardised KS distance, sqrt(k (n - k) / n) * D(k).
        A big shift is seen after a dozen samples, so keeping the whole test window would keep
        as many samples from before it."""
        n = len(win)
        best_k, best = self.shift_window, -1.0
        for k in range(max(1, self.shift_window // 4), self.shift_window + 1):
            score = math.sqrt(k * (n - k) / n) * (win.shift_statistic(k) or 0.0)
            if score > best:
                best_k, best = k, score
        return best_k

    # ------------------------------------------------------------------ queries

    def samples(self, tool: str) -> Sequence[float]:
        """The tool's window, oldest first (a copy)."""
        win = self._tools.get(tool)
        return win.values() if win is not None else ()

    def global_samples(self) -> Sequence[float]:
        return self._global.values()

    def sorted_samples(self, tool: str) -> Sequence[float]:
        """The tool's window in ascending order.

        The sorted order is maintained incrementally on insert (binary search), and the returned
        tuple is cached until the window changes, so repeated calls cost nothing.
        """
        win = self._tools.get(tool)
        return win.sorted_tuple() if win is not None else ()

    def global_sorted_samples(self) -> Sequence[float]:
        return self._global.sorted_tuple()

    def version(self, tool: str | None = None) -> int:
        """Changes whenever the tool's (or, for None, the global) window changes; 0 if unknown.

        Versions come from one counter, so a tool evicted and seen again never reuses one.
        """
        if tool is None:
            return self._global.version
        win = self._tools.get(tool)
        return win.version if win is not None else 0

    def count(self, tool: str) -> int:
        win = self._tools.get(tool)
        return len(win) if win is not None else 0

    def global_count(self) -> int:
        return len(self._global)

    def mean(self, tool: str) -> float | None:
        win = self._tools.get(tool)
        return win.mean() if win is not None else None

    def global_mean(self) -> float | None:
        return self._global.mean()

    def tools(self) -> list[str]:
        """Known tool names, least recently updated first."""
        return list(self._tools)

    def has_pending(self, program_id: str) -> bool:
        return program_id in self._pending

    def pending_tool(self, program_id: str) -> str | None:
        entry = self._pending.get(program_id)
        return entry[0] if entry is not None else None

    def pending_count(self) -> int:
        return len(self._pending)


def _duration(x) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
        raise ValueError(f"a tool duration must be a finite number >= 0, got {x!r}")
    return float(x)


def _tool_name(t) -> str:
    if not isinstance(t, str) or not t:
        raise ValueError(f"a tool name must be a non-empty string, got {t!r}")
    return t
