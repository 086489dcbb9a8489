"""The policy's recent retention decisions, each with what it was decided
from: a bounded ring that the server's dashboard reads (on the engine thread).

A decision is made at the end of every non-final turn of a named program
(`Policy.on_turn_end`). What every policy has is the turn's tool and that
tool's learned duration statistics; a policy that solves a cost model (the
continuum policy's Eq. 2) adds its own inputs (`TTLInputs`): which regime of
the cold start it used, eta, the queueing delay T, the reload time and the
benefit B. The ring keeps the latest `size` decisions and counts all of them,
so a long-running server holds a fixed amount here whatever its traffic."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class TTLInputs:
    """What an Eq. 2 TTL was solved from (policy/ttl.py: B = T * eta + PrefillReload(r))."""

    regime: str  # "hint" (the client's TTL), or the TTL model's "default", "global" or "tool"
    eta: float | None = None
    queue_delay_s: float | None = None  # T, the mean queueing delay of evicted returning requests
    reload_s: float | None = None  # PrefillReload(r): seconds to rebuild this turn's KV
    benefit_s: float | None = None  # B
    mean_used_s: float | None = None  # the default regime's exponential mean
    capped: bool = False  # the solved TTL exceeded the policy's cap and was cut to it
    pin_cost: float | None = None  # the cost of a pinned second (policy/pressure.py; None: the paper's 1)
    source: str | None = None  # where reload_s comes from: "host", "disk", "prefill" (None: the policy's one cost)


@dataclass(frozen=True)
class Decision:
    time: float  # the engine clock's seconds
    request_id: str
    program_id: str
    tool: str  # the tool the turn called (tool_stats.NO_TOOL_CALL when none was found)
    action: str  # "pin", "free", "swap" or "disk" (policy.base.Retention)
    ttl: float  # seconds the KV is kept (0 unless pinned)
    tool_mean_s: float | None  # the learned mean duration of that tool (None: no sample yet)
    tool_samples: int  # durations the mean is over
    inputs: TTLInputs | None = None  # None: the policy solves no TTL model


class DecisionLog:
    def __init__(self, size: int = 256) -> None:
        if size < 1:
            raise ValueError(f"the decision log needs room for at least one decision, got {size}")
        self._ring: deque[Decision] = deque(maxlen=size)
        self.total = 0  # decisions ever recorded, the ones the ring dropped included

    def add(self, decision: Decision) -> None:
        self._ring.append(decision)
        self.total += 1

    def recent(self) -> list[Decision]:
        """The decisions the ring holds, oldest first."""
        return list(self._ring)

    def __len__(self) -> int:
        return len(self._ring)
