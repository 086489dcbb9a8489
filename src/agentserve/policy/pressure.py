"""How contended the device KV is: the share of recent time during which a
waiting request was held back because its KV did not fit (or a running one
was preempted for room).

Eq. 2 charges a pin one second of cost per second held, assuming "the waiting
queue always contains enough requests for this blocking effect to occur"
(CacheTTL section 4.1). That holds only under pressure: while nothing waits
for memory, a pin delays nobody. The meter gives the cost its weight: an
exponentially time-decayed average of the held-back indicator, so a burst
raises it within a horizon and a quiet spell lets it fall. Time is passed in.
"""

from __future__ import annotations

import math


class PressureMeter:
    def __init__(self, horizon: float = 20.0, initial: float = 1.0) -> None:
        if not horizon > 0.0 or math.isinf(horizon):
            raise ValueError(f"horizon must be a positive number of seconds, got {horizon!r}")
        if not 0.0 <= initial <= 1.0:
            raise ValueError(f"initial must be in [0, 1], got {initial!r}")
        self.horizon = float(horizon)
        # the paper's assumption until something is observed: memory is contended
        self._value = float(initial)
        self._blocked = False  # the indicator since the last observation
        self._t: float | None = None

    def observe(self, now: float, blocked: bool) -> None:
        """The state since the previous call held until `now`; from now on it is `blocked`."""
        self._value = self.value(now)
        self._t = now
        self._blocked = blocked

    def value(self, now: float) -> float:
        """The time-decayed share of held-back time, in [0, 1]."""
        if self._t is None or now <= self._t:
            return self._value
        w = math.exp(-(now - self._t) / self.horizon)
        return self._value * w + (1.0 - w) * (1.0 if self._blocked else 0.0)
