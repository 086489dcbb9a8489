"""The HTTP ingress of `agentserve cluster`: one OpenAI-compatible endpoint in
front of the engine replicas (a Ray Serve deployment with one replica).

A request's method, path, query, headers and body are forwarded as they came
to a replica, which runs them through the same Starlette app as `agentserve
serve` (validation, limits, errors and streaming are that app's: replica.py).
The ingress only reads the body to name the request's `RouteKey`
(route_key.py, with the caller's tenant when the server takes keys), which
rides along with the call for the request router (ray_router.py).

Failover. The response is held back until it carries output: a JSON reply's
body, or, for a stream, the first event with text, a tool call, a finish
reason or an error (the opening role-only event is held too). A replica that
dies before that is retried on another one (`retries` times, then an
OpenAI-style 503); a stream that had begun ends with an error event and
`[DONE]`, never a hang. GET /metrics merges every replica's page with a
`replica` label (metrics_merge.py); GET /health is ok when every replica is."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from agentserve.router.metrics_merge import merge_pages
from agentserve.server.api_errors import APIError
from agentserve.server.request_run import DONE, sse
from agentserve.server.tenants import Tenants

log = logging.getLogger("agentserve.router")

ROUTED_POSTS = ("/v1/chat/completions", "/v1/completions")
# the routing logic of this process's request routers, by deployment (ray_router.py fills it)
ROUTING_LOGIC: dict[str, Any] = {}
_PROGRAM_PATH = "/v1/programs/"


def carries_output(chunk: bytes) -> bool:
    """Whether a body chunk of an event stream holds anything a client must not get twice: every
    event but a role-only or empty delta (text, tool calls, a finish reason, usage, an error, [DONE])."""
    for block in chunk.split(b"\n\n"):
        data = block.strip()
        if not data:
            continue
        if not data.startswith(b"data:"):
            return True
        try:
            event = json.loads(data[5:])
        except ValueError:
            return True  # [DONE], or something we do not know: treat it as output
        if not isinstance(event, dict) or "error" in event or event.get("usage") or not event.get("choices"):
            return True
        for choice in event["choices"]:
            delta = choice.get("delta") or {}
            if choice.get("finish_reason") or choice.get("text") or delta.get("content") or delta.get("tool_calls"):
                return True
    return False


def _replica_gone_error() -> APIError:
    return APIError(503, "no engine replica could take the request (a replica failed); retry", "server_error",
                    code="replica_unavailable")


class Ingress:
    """A Ray Serve deployment class; `cluster_app.py` binds it to the replicas' handle."""

    def __init__(self, replicas: Any, api_keys: dict[str, str], max_body_bytes: int, num_replicas: int,
                 retries: int = 2) -> None:
        self.replicas = replicas
        self.tenants = Tenants(api_keys)
        self.max_body_bytes = max_body_bytes
        self.num_replicas = num_replicas
        self.retries = retries
        self.counts = {"retries": 0, "failed_streams": 0, "unavailable": 0}

    async def __call__(self, request: Request) -> Response:
        method, path = request.method, request.url.path
        headers = [(k, v) for k, v in request.headers.items()]
        if method == "GET" and path == "/metrics":
            return await self._metrics(headers)
        if method == "GET" and path == "/health":
            return await self._health()
        body = await self._read_body(request)
        route = self._route(method, path, body, request.headers)
        try:
            return await self._forward(method, path, request.url.query.encode(), headers, body, route)
        except Exception as e:  # a failure of the plumbing, never the app's own errors (those are replies)
            log.exception("forwarding %s %s failed", method, path)
            return APIError(500, f"internal server error: {type(e).__name__}", "server_error").response()

    async def _read_body(self, request: Request) -> bytes:
        """The body, cut one byte past the limit (the replica's app then answers 413 as `serve` does)."""
        out = bytearray()
        async for chunk in request.stream():
            out += chunk
            if len(out) > self.max_body_bytes:
                return bytes(out[: self.max_body_bytes + 1])
        return bytes(out)

    def _route(self, method: str, path: str, body: bytes, headers) -> Any:
        from agentserve.router.route_key import route_key

        if method != "POST":
            return None
        if path in ROUTED_POSTS:
            try:
                obj = json.loads(body)
            except (ValueError, RecursionError):
                obj = {}
        elif path.startswith(_PROGRAM_PATH) and path.endswith(("/release", "/end")):
            # to the program's replica; an end makes the router forget the program
            obj = {"program_id": path[len(_PROGRAM_PATH):].rsplit("/", 1)[0], "messages": [],
                   "end_program": path.endswith("/end")}
        else:
            return None
        try:
            return route_key(obj if isinstance(obj, dict) else {}, headers, self._scope(headers))
        except ValueError:  # a malformed identity field: any replica answers the 400
            return None

    def _scope(self, headers) -> str | None:
        if not self.tenants.enabled:
            return None
        scheme, _, token = headers.get("authorization", "").partition(" ")
        tenant = self.tenants.authenticate(token.strip()) if scheme.lower() == "bearer" else None
        return self.tenants.scope(tenant)

    async def _forward(self, method: str, path: str, query: bytes, headers: list, body: bytes, route: Any) -> Response:
        tried: list[str] = []
        for attempt in range(self.retries + 1):
            gen = self.replicas.options(stream=True).handle.remote(method, path, query, headers, body,
                                                                    route=route, avoid=tried or None)
            head: dict | None = None
            held: list[bytes] = []
            try:
                async for message in gen:
                    if isinstance(message, dict):
                        head = message
                        continue
                    held.append(message)
                    if not _is_stream(head) or carries_output(message):
                        break
            except RayActorError as e:
                gen.cancel()
                if head is not None:
                    tried.append(head["replica"])
                log.warning("replica %s failed before any output (%s); attempt %d of %d",
                            head["replica"] if head else "?", type(e).__name__, attempt + 1, self.retries + 1)
                if attempt < self.retries:
                    self.counts["retries"] += 1
                continue
            except BaseException:  # the client left (cancelled), or the replica's code raised
                gen.cancel()
                raise
            if head is None:  # the app answered nothing at all: should not happen
                return _replica_gone_error().response()
            return StreamingResponse(self._rest(gen, held, head), status_code=head["status"],
                                     headers=dict(head["headers"]))
        self.counts["unavailable"] += 1
        return _replica_gone_error().response()

    async def _rest(self, gen: Any, held: list[bytes], head: dict) -> AsyncIterator[bytes]:
        try:
            for chunk in held:
                yield chunk
            async for message in gen:
                if isinstance(message, bytes):
                    yield message
        except RayActorError as e:
            self.counts["failed_streams"] += 1
            log.warning("replica %s failed mid-response: %s", head["replica"], type(e).__name__)
            if _is_stream(head):
                yield sse(APIError(503, "the engine replica serving this stream failed; retry the request",
                                   "server_error", code="replica_failed").body()).encode()
                yield DONE.encode()
        finally:
            gen.cancel()

    async def _probe_all(self, path: str, headers: list) -> list[tuple[str, int, bytes]]:
        try:
            results = await self.replicas.broadcast("probe", path, headers).results_async(timeout_s=10,
                                                                                          return_exceptions=True)
        except DeploymentUnavailableError:  # no replica up yet (starting): none answers, not a failure
            return []
        return [r for r in results if isinstance(r, tuple)]

    async def _metrics(self, headers: list) -> Response:
        pages = []
        for replica, status, body in sorted(await self._probe_all("/metrics", headers)):
            if status != 200:  # e.g. 401 without a valid key: the replica's own answer
                return Response(body, status_code=status, media_type="application/json")
            pages.append((replica, body.decode()))
        text = merge_pages(pages) + self._own_metrics(len(pages))
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    def _own_metrics(self, answering: int) -> str:
        lines = [
            "# HELP agentserve:cluster_replicas_answering Engine replicas that answered this scrape.",
            "# TYPE agentserve:cluster_replicas_answering gauge",
            f"agentserve:cluster_replicas_answering {answering}",
        ]
        docs = {"retries": "Requests retried on another replica after one failed before any output.",
                "failed_streams": "Responses cut by a replica failure after output had begun (ended with an error).",
                "unavailable": "Requests answered 503 after every retry failed."}
        for key, doc in docs.items():
            lines += [f"# HELP agentserve:cluster_{key}_total {doc}", f"# TYPE agentserve:cluster_{key}_total counter",
                      f"agentserve:cluster_{key}_total {self.counts[key]}"]
        counters = {dep: logic.counters() for dep, logic in list(ROUTING_LOGIC.items())}
        if counters:
            lines += ["# HELP agentserve:router_counters The request router's counts: decisions by reason "
                      "(affinity, escapes, prefix_matches, placements, fallbacks), programs lost with a replica, "
                      "programs and prefix keys remembered.", "# TYPE agentserve:router_counters gauge"]
            lines += [f'agentserve:router_counters{{deployment="{dep}",counter="{name}"}} {value}'
                      for dep, values in sorted(counters.items()) for name, value in sorted(values.items())]
        return "\n".join(lines) + "\n"

    async def _health(self) -> Response:
        results = await self._probe_all("/health", [])
        ok = sum(1 for _, status, _ in results if status == 200)
        if ok >= self.num_replicas:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": f"{ok} of {self.num_replicas} engine replicas healthy"}, status_code=503,
                            headers={"Retry-After": "1"})


def _is_stream(head: dict | None) -> bool:
    if head is None:
        return False
    ctype = next((v for k, v in head["headers"] if k.lower() == "content-type"), "")
    return ctype.startswith("text/event-stream")
