"""Tool-duration statistics the replicas of a cluster share: each learns from
every replica's tool calls, not only from the programs routed to it.

A replica (`ToolStatsShare`) journals the durations its policy records. Every
`interval` seconds of its clock it hands what it recorded since the last
exchange to one hub (`ToolStatsHub`: router/shared_tools.py keeps it in a
named Ray actor), which records them into its own windows, with everyone
else's, by the same code a replica learns with (policy/tool_stats.py: sliding
windows per tool and globally, the latency-shift test): a merge of samples,
never one replica's windows over another's. The hub answers with its merged
windows (the export server/learned_state.py stores), which the replica takes
up as its own. Its own samples are in them once: it sent them, and the
samples it recorded while the exchange was under way are recorded again on
top of the merged windows and sent next time.

The hub starts from the first replica's windows (`seed`) when it has none:
what that replica loaded from its --state-dir is not lost to an empty hub.
The statistics are learned per tool name from every tenant's calls, as a
single server learns them, so nothing here is per tenant."""

from __future__ import annotations

import math
from typing import Any

from agentserve.policy.tool_stats import ToolDurationStats, _duration, _tool_name

SHARE_INTERVAL_S = 5.0
MAX_JOURNAL = 10000  # samples recorded between two exchanges, at most (the oldest go unshared)


class ToolStatsShare:
    """A replica's side: `take` what to send when `due`, then `apply` the hub's answer."""

    def __init__(self, stats: ToolDurationStats, interval: float = SHARE_INTERVAL_S) -> None:
        if not interval > 0 or interval == math.inf:
            raise ValueError(f"the exchange interval must be a number of seconds > 0, got {interval!r}")
        self.stats = stats
        self.interval = interval
        self._last: float | None = None
        self._seeded = False
        self.exchanges = 0
        self.unshared = 0  # samples dropped from a full journal
        stats.journal = []

    def due(self, now: float) -> bool:
        return self._last is None or now - self._last >= self.interval

    def take(self, now: float) -> dict[str, Any]:
        """What to send: the samples recorded since the last take, and (the first
        time) this replica's windows as the hub's seed."""
        self._last = now
        sent, self.stats.journal = self.stats.journal or [], []
        if len(sent) > MAX_JOURNAL:
            self.unshared += len(sent) - MAX_JOURNAL
            sent = sent[-MAX_JOURNAL:]
        out: dict[str, Any] = {"samples": [[t, x] for t, x in sent]}
        if not self._seeded:
            out["seed"] = self.stats.export_state()
            self._seeded = True
        return out

    def apply(self, merged: dict[str, Any]) -> None:
        """Take up the hub's merged windows, then the samples recorded since `take`
        (they go to the hub next time). ValueError on malformed data, nothing changed."""
        stats = self.stats
        fresh = stats.journal or []
        stats.import_state(merged)
        stats.journal = None
        try:
            for tool, x in fresh:
                stats.record(tool, x)
        finally:
            stats.journal = fresh
        self.exchanges += 1


class ToolStatsHub:
    """The cluster's merged statistics: each replica's samples recorded as they come."""

    def __init__(self, stats: ToolDurationStats | None = None) -> None:
        self.stats = stats or ToolDurationStats()
        self.merges = 0
        self.samples = 0  # merged in all
        self.seeded_by: str | None = None

    def exchange(self, replica: str, sent: dict[str, Any]) -> dict[str, Any]:
        """Merge what `replica` sent (`ToolStatsShare.take`); the merged windows.
        ValueError on malformed data, with nothing merged."""
        try:
            samples = [(_tool_name(t), _duration(x)) for t, x in sent.get("samples", [])]
            seed = sent.get("seed")
        except (TypeError, AttributeError, ValueError) as e:  # (not iterable, not a pair, out of range)
            raise ValueError(f"malformed tool statistics from {replica}: {e}") from None
        if seed is not None and not self.stats.tools():
            self.stats.import_state(seed)  # raises ValueError, changing nothing
            self.seeded_by = replica
            samples = []  # recorded before the take: in the seed already
        for tool, x in samples:
            self.stats.record(tool, x)
        self.merges += 1
        self.samples += len(samples)
        return self.stats.export_state()

