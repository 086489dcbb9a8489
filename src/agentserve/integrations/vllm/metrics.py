"""The plugin's Prometheus series, next to vLLM's on its `/metrics`.

The scheduler runs in vLLM's engine-core process, and vLLM's `/metrics` is
served by its API-server process: the two meet only through prometheus_client's
multiprocess mode, which vLLM uses whenever `PROMETHEUS_MULTIPROC_DIR` is set
when it starts (the launcher, `python -m agentserve.integrations.vllm serve`,
sets it). Without it the series live in the engine process only, and the
scheduler logs them instead (a summary line a minute)."""

from __future__ import annotations

import os

from prometheus_client import Counter, Gauge

from agentserve.integrations.vllm.keeper import KeeperCounts

_COUNTERS = {
    "pins_created": "Finished turns whose KV was held for their program's next turn",
    "pin_hits": "Turns admitted while their program's held KV was still there",
    "pins_expired": "Held KV released when its TTL ran out",
    "pins_reclaimed": "Held KV released early for another request's allocation",
    "pins_released_early": "Held KV the policy's review released before its TTL",
    "pins_released_at_end": "Held KV released because its program ended or the client released it",
    "pins_refused": "Pins not made because held KV would have passed its share of the pool",
    "turns_finished": "Turns the plugin saw end",
}


def multiprocess_export() -> bool:
    """Whether these series reach vLLM's `/metrics` (see the module's docstring)."""
    return "PROMETHEUS_MULTIPROC_DIR" in os.environ


class PinMetrics:
    def __init__(self) -> None:
        self._counters = {name: Counter(f"agentserve:{name}", text) for name, text in _COUNTERS.items()}
        self._pinned = Gauge("agentserve:pinned_blocks", "KV blocks held for programs between turns",
                             multiprocess_mode="livesum")
        self._last = {name: 0 for name in _COUNTERS}

    def update(self, counts: KeeperCounts, pinned_blocks: int) -> None:
        for name, counter in self._counters.items():
            value = getattr(counts, name)
            if value != self._last[name]:
                counter.inc(value - self._last[name])
                self._last[name] = value
        self._pinned.set(pinned_blocks)
