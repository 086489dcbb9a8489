"""GET /dashboard (the page: one static HTML file with its script, no build
step and nothing fetched from elsewhere) and GET /dashboard/state (the JSON
the page polls, dashboard_view.py).

The page holds no data, so it is served to anyone; the state needs the API
key when the server has one (the page asks for it and keeps it for the
browser tab), and on a server with several tenants shows the caller only
their tenant's programs (dashboard_view.py)."""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from agentserve.server.api_errors import APIError
from agentserve.server.dashboard_view import build_state
from agentserve.server.request_checks import authorize
from agentserve.server.request_stream import EngineStopped
from agentserve.server.server_state import server_state


@lru_cache(maxsize=1)
def page() -> str:
    return resources.files("agentserve.server").joinpath("dashboard.html").read_text(encoding="utf-8")


async def dashboard_page(request: Request) -> Response:
    return HTMLResponse(page(), headers={"Cache-Control": "no-cache"})


async def dashboard_state(request: Request) -> Response:
    st = server_state(request)
    tenant = authorize(st, request)  # None: the server takes no key
    scope = st.config.tenants.scope(tenant)  # None: one tenant or none, nobody to hide from
    eng = st.engine
    try:
        state = await eng.call(lambda: build_state(eng.scheduler, st.dashboard, eng.clock.now(), scope, tenant,
                                                   eng.integrity_failures))
    except EngineStopped as e:
        raise APIError(503, str(e), "server_error", code="engine_unavailable") from None
    # ASCII JSON: a program id is the client's text, and any string of it must encode
    body = json.dumps(state, allow_nan=False, separators=(",", ":"))
    return Response(body, media_type="application/json", headers={"Cache-Control": "no-store"})


def dashboard_routes() -> list[Route]:
    return [Route("/dashboard", dashboard_page, methods=["GET"]),
            Route("/dashboard/state", dashboard_state, methods=["GET"])]
