"""Several engine listeners as one (the engine takes one): the metrics and the
dashboard's program timeline both hear every event, and a listener that
fails is logged without keeping the others from hearing it."""

from __future__ import annotations

import logging
from typing import Any

from agentserve.engine.llm_engine import RequestOutput
from agentserve.server.engine_snapshot import EngineListener

log = logging.getLogger("agentserve.server")


class Listeners:
    def __init__(self, *listeners: EngineListener) -> None:
        self.listeners = listeners

    def _each(self, method: str, *args: Any) -> None:
        for listener in self.listeners:
            try:
                getattr(listener, method)(*args)
            except Exception:  # one listener's bug must not silence the others, nor stop the engine
                log.exception("listener %s.%s failed", type(listener).__name__, method)

    def on_request_output(self, out: RequestOutput, now: float, last_token_time: float | None) -> None:
        self._each("on_request_output", out, now, last_token_time)

    def on_request_aborted(self) -> None:
        self._each("on_request_aborted")

    def on_program_end(self, jct: float) -> None:
        self._each("on_program_end", jct)

    def on_ttl_decisions(self, ttls: list[float]) -> None:
        self._each("on_ttl_decisions", ttls)
