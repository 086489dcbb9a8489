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


class TurnoverMeter:
    """How long a copy lasts in a tier of `num_slots` slots kept in LRU order:
    the time the tier takes to write that many slots at its recent rate (an
    exponentially time-decayed rate of `observe`d store counts). A copy not
    touched again is evicted about that long after it was written. Infinite
    until the tier has been written at all."""

    def __init__(self, num_slots: int, horizon: float = 60.0) -> None:
        if not horizon > 0.0 or math.isinf(horizon):
            raise ValueError(f"horizon must be a positive number of seconds, got {horizon!r}")
        self.num_slots = num_slots
        self.horizon = float(horizon)
        self._rate = 0.0  # slots stored per second
        self._count: int | None = None
        self._t: float | None = None

    def observe(self, now: float, stored: int) -> None:
        """The tier has stored `stored` slots in all by `now`."""
        if self._t is not None and now > self._t:
            dt = now - self._t
            w = math.exp(-dt / self.horizon)
            self._rate = self._rate * w + (1.0 - w) * (stored - self._count) / dt
        if self._t is None or now > self._t:
            self._t, self._count = now, stored

    def residency(self) -> float:
        """Seconds a copy written now is expected to stay (inf: no turnover yet)."""
        return self.num_slots / self._rate if self._rate > 0.0 else math.inf


def pin_to_reclaim(pins, own_program: str | None, own_arrival: float, any_program: bool, frees_a_block):
    """The pin to give up for a request that cannot get KV: the latest-arriving
    program's (later than the request's own, unless `any_program`) among those
    whose release returns at least one block (`frees_a_block(pin)`): a pin whose
    blocks others also hold frees nothing, and dropping it would only cost its
    program the retention. `pins` holds objects with `program_id` and
    `program_arrival`; None when no pin qualifies. The engine and the vLLM
    plugin both reclaim by this rule."""
    candidates = [pin for pin in pins if pin.program_id != own_program
                  and (any_program or pin.program_arrival > own_arrival)]
    candidates.sort(key=lambda p: p.program_arrival, reverse=True)
    return next((pin for pin in candidates if frees_a_block(pin)), None)
