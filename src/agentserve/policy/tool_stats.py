"""Tool-duration statistics with bounded memory.

A tool's duration is measured on the server (CacheTTL paper, section 5.1): the finish of turn k
of a program (a response that called tool f) to the arrival of turn k+1 of the same program.
:class:`ToolDurationStats` keeps, per tool name and globally, a sliding window of such durations
plus the same window kept sorted, so the TTL solver can read sorted samples without sorting.

Everything is bounded: per-tool and global windows (oldest sample dropped), the number of tool
names (least recently updated tool dropped) and the number of programs waiting for their next
turn (oldest departure dropped).  Times are passed in; nothing here reads a clock.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import OrderedDict, deque
from typing import Sequence

__all__ = ["NO_TOOL_CALL", "ToolDurationStats"]

# The gap after a non-final turn whose output had no parsable tool call (a
# ReAct "Action:" line, a format the parser does not know, a question to the
# user). Learned in its own window like a tool, but kept out of the global
# window so that human-length gaps do not stretch every real tool's TTL.
NO_TOOL_CALL = "(no tool call)"


class _Window:
    """A sliding window of floats, also kept sorted, with a running sum and a version."""

    __slots__ = ("values", "sorted", "total", "version", "_adds", "_frozen", "_frozen_version")

    def __init__(self, maxlen: int) -> None:
        self.values: deque[float] = deque(maxlen=maxlen)
        self.sorted: list[float] = []
        self.total = 0.0
        self.version = 0
        self._adds = 0
        self._frozen: tuple[float, ...] = ()
        self._frozen_version = 0

    def add(self, x: float, version: int) -> None:
        values = self.values
        if len(values) == values.maxlen:
            old = values[0]  # dropped by the append below
            del self.sorted[bisect_left(self.sorted, old)]
            self.total -= old
        values.append(x)
        insort(self.sorted, x)
        self.total += x
        self._adds += 1
        if self._adds >= values.maxlen:  # bound the float drift of add/subtract
            self._adds = 0
            self.total = math.fsum(values)
        self.version = version

    def mean(self) -> float | None:
        n = len(self.values)
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
        self._tools: OrderedDict[str, _Window] = OrderedDict()  # oldest update first
        self._global = _Window(self.max_global_samples)
        self._pending: OrderedDict[str, tuple[str, float]] = OrderedDict()  # oldest first
        self._tick = 0  # monotonic version source shared by all windows
        self.evicted_tools = 0
        self.dropped_pending = 0

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
        win.add(duration, tick)
        if tool != NO_TOOL_CALL:
            self._global.add(duration, tick)

    # ------------------------------------------------------------------ queries

    def samples(self, tool: str) -> Sequence[float]:
        """The tool's window, oldest first (a copy)."""
        win = self._tools.get(tool)
        return tuple(win.values) if win is not None else ()

    def global_samples(self) -> Sequence[float]:
        return tuple(self._global.values)

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
        return len(win.values) if win is not None else 0

    def global_count(self) -> int:
        return len(self._global.values)

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
