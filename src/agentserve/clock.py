"""Clocks. Everything below the server takes time from an injected clock, so the
same scheduler runs in real time and in the discrete-event simulator."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class WallClock:
    """Monotonic seconds; the clock of a real server."""

    def now(self) -> float:
        return time.monotonic()


class SimClock:
    """A clock that only moves when the simulator advances it."""

    def __init__(self, start: float = 0.0) -> None:
        self._t = float(start)

    def now(self) -> float:
        return self._t

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError(f"cannot move a clock backwards by {dt}")
        self._t += dt

    def advance_to(self, t: float) -> None:
        if t > self._t:
            self._t = t
