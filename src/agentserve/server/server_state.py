"""The server's settings (`ServerConfig`) and what its endpoints share
(`ServerState`: the LLM, the engine, the metrics, the caches), kept on the app
as `app.state.server`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from starlette.requests import Request

from agentserve.engine.gc_policy import GCPolicy
from agentserve.server.async_engine import AsyncEngine
from agentserve.server.dashboard_view import DashboardSource
from agentserve.server.learned_state import SAVE_INTERVAL_S
from agentserve.server.metrics import ServerMetrics
from agentserve.server.protocol import now_s
from agentserve.server.render_cache import DEFAULT_ENTRIES as RENDER_CACHE_ENTRIES
from agentserve.server.render_cache import RenderCache
from agentserve.server.response_cache import ResponseCache
from agentserve.server.responses_store import DEFAULT_MAX_BYTES as RESPONSES_STORE_BYTES
from agentserve.server.responses_store import DEFAULT_MAX_RESPONSES as RESPONSES_STORE_MAX
from agentserve.server.responses_store import ResponsesStore
from agentserve.server.tenants import Tenants
from agentserve.server.tool_validation import ValidatorConfig


@dataclass
class ServerConfig:
    served_model_names: list[str]  # the first is reported; any of them is accepted as `model`
    api_key: str | None = None  # Bearer token required on /v1/* and /metrics when set (tenant api-key-1)
    api_keys: dict[str, str] = field(default_factory=dict)  # more keys: key -> tenant (tenants.py)
    cached_tokens_report: Literal["exact", "none"] = "exact"  # none: usage says 0 cached tokens
    max_queue: int | None = None  # requests waiting for admission at most (None: no limit); beyond: 503
    max_body_bytes: int = 16 * 2**20  # beyond: 413
    # seconds without a byte while a body arrives (None: no limit); beyond: 408 (http_limits.py)
    request_body_timeout: float | None = 10.0
    max_connections: int | None = None  # connections carrying a request at once (None: no limit); beyond: 503
    max_connections_per_client: int | None = None  # the same for one client address
    stats_interval: float | None = None  # seconds between the engine's stats log lines (None: none)
    tool_calls: ValidatorConfig = field(default_factory=ValidatorConfig)  # the streaming tool-call validator
    render_cache: int = RENDER_CACHE_ENTRIES  # chat prompts whose token ids are kept for reuse (0: off)
    response_cache: int = 0  # finished responses kept for exact repeats (0: off); see response_cache.py
    gc_policy: GCPolicy | None = None  # the collector's policy the engine applies at start (None: untouched)
    # the Responses API's stored responses, in memory only (responses_store.py): at most this many, and bytes
    responses_store_max: int = RESPONSES_STORE_MAX
    responses_store_bytes: int = RESPONSES_STORE_BYTES
    # the file that keeps what the server learned over a restart (learned_state.py; None: kept in memory only)
    state_file: str | None = None
    state_save_interval: float = SAVE_INTERVAL_S  # seconds between its saves (and one at shutdown)
    tenants: Tenants = field(init=False)  # api_key and api_keys, checked

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("at least one served model name is needed")
        if self.cached_tokens_report not in ("exact", "none"):
            raise ValueError(f"cached_tokens_report must be 'exact' or 'none', got {self.cached_tokens_report!r}")
        keys = {self.api_key: "api-key-1"} if self.api_key is not None else {}
        self.tenants = Tenants({**keys, **self.api_keys})


@dataclass
class ServerState:
    llm: Any
    engine: AsyncEngine
    metrics: ServerMetrics
    config: ServerConfig
    created: int = field(default_factory=now_s)
    warned_unconstrained: bool = False
    warned: set[str] = field(default_factory=set)  # what the log has said once for this server (not per request)
    render_cache: RenderCache | None = None
    response_cache: ResponseCache | None = None
    responses_store: ResponsesStore | None = None  # the Responses API's stored responses (responses_store.py)
    openapi: dict[str, Any] | None = None  # the OpenAPI document, built on its first request
    dashboard: DashboardSource = field(default_factory=DashboardSource)  # what /dashboard/state reads

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]


def server_state(request: Request) -> ServerState:
    return request.app.state.server
