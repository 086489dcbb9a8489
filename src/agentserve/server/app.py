"""The OpenAI-compatible HTTP app (Starlette), in front of an `AsyncEngine`.

Endpoints: POST /v1/chat/completions (chat_endpoint.py), POST /v1/completions
(completions_endpoint.py), POST /v1/responses, GET and DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items (OpenAI's Responses API:
responses_endpoint.py), POST /v1/messages and /v1/messages/count_tokens
(Anthropic's Messages API: messages_endpoint.py), GET /v1/models, POST
/v1/programs/{id}/release and /end (explicit retention control, docs/architecture.md
"Request identity"), GET /health,
GET /metrics (behind the API key when there is one: its counters describe
everyone's traffic), GET /openapi.json (openapi.py), GET /dashboard (a live page
of programs, KV and TTL decisions: dashboard_endpoint.py).

Every error is OpenAI's JSON shape, Anthropic's on the Messages API's paths
(api_errors.py). A request is checked completely (auth, size, JSON, schema, model, tools, sampling values, prompt
length: request_checks.py) before it reaches the engine; once it is in the
engine, a `finally` closes its stream on every path (request_run.py), so a
client that goes away mid-request aborts it and its KV blocks are freed.

The app takes any object with the `LLM` attributes it reads (`engine`,
`scheduler`, `tokenizer`, `chat_template`, `config`, `max_model_len`,
`model_source`), so this layer never imports torch."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.convertors import PathConvertor, register_url_convertor
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentserve.server.api_errors import (RETRY_AFTER_S, APIError, api_error_handler, http_error_handler,
                                          internal_error_handler)
from agentserve.server.async_engine import AsyncEngine
from agentserve.server.chat_endpoint import chat_completions
from agentserve.server.completions_endpoint import completions
from agentserve.server.dashboard_endpoint import dashboard_routes
from agentserve.server.dashboard_view import DashboardSource
from agentserve.server.engine_listeners import Listeners
from agentserve.server.engine_thread import EngineThread
from agentserve.server.http_limits import HttpLimits
from agentserve.server.input_checks import InputError, check_path_id
from agentserve.server.learned_state import LearnedState, model_identity
from agentserve.server.messages_endpoint import count_tokens, messages
from agentserve.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from agentserve.server.openapi import openapi_document
from agentserve.server.protocol import Health, ModelCard, ModelList, ProgramEnded, ProgramReleased
from agentserve.server.render_cache import RenderCache
from agentserve.server.identity import scoped_program_id
from agentserve.server.request_checks import authorize, input_error, tenant_scope
from agentserve.server.response_cache import ResponseCache
from agentserve.server.responses_endpoint import create_response, delete_response, get_response, list_input_items
from agentserve.server.responses_store import ResponsesStore
from agentserve.server.server_state import ServerConfig, ServerState, server_state


class _ProgramIdConvertor(PathConvertor):
    """Starlette's path convertor, line feeds included (its `.*` stops at one, which made a 404 of
    an id holding one): what a program id may hold is check_path_id's to say, in a 400."""

    regex = "(?s:.*)"


register_url_convertor("program_id", _ProgramIdConvertor())


def create_app(llm: Any, config: ServerConfig, *, engine: AsyncEngine | None = None,
               thread: EngineThread | None = None) -> Starlette:
    """The app for `llm`. The engine loop starts with the app's lifespan and stops with it,
    on `thread` if given (the thread that built `llm`: see engine_thread.py);
    `app.state.server` (a ServerState) gives tests the engine and the metrics."""
    metrics = ServerMetrics(config.served_model_names[0])
    dashboard = DashboardSource()
    if engine is None:  # (an engine given has its own listener: the dashboard sees live requests only)
        engine = AsyncEngine(llm, max_queue=config.max_queue, listener=Listeners(metrics, dashboard.timeline),
                             thread=thread, stats_interval=config.stats_interval, gc_policy=config.gc_policy)
    state = ServerState(llm, engine, metrics, config, dashboard=dashboard)
    if config.render_cache > 0:
        state.render_cache = engine.render_cache = RenderCache(llm.chat_template, llm.tokenizer, config.render_cache)
    if config.response_cache > 0:
        state.response_cache = engine.response_cache = ResponseCache(config.response_cache)
    state.responses_store = ResponsesStore(config.responses_store_max, config.responses_store_bytes)
    if config.state_file is not None:  # what an earlier run learned, taken up before the engine starts
        engine.learned_state = LearnedState(config.state_file, model_identity(llm), config.state_save_interval)
        engine.learned_state.load(llm.scheduler)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await run_in_threadpool(state.engine.stop)
            shared = getattr(llm, "shared_kv", None)
            if shared is not None:  # the turns written through, on disk for the servers that go on
                await run_in_threadpool(shared.close)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/openapi.json", openapi_endpoint, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"]),
        Route("/v1/programs/{program_id:program_id}/release", release_program, methods=["POST"]),
        Route("/v1/programs/{program_id:program_id}/end", end_program, methods=["POST"]),
        *dashboard_routes(),
    ]
    # the connection bounds and the body timeout hold on every route (http_limits.py)
    limits = Middleware(HttpLimits, body_timeout=config.request_body_timeout, max_connections=config.max_connections,
                        max_per_client=config.max_connections_per_client)
    app = Starlette(routes=routes, lifespan=lifespan, middleware=[limits], exception_handlers={
        APIError: api_error_handler, HTTPException: http_error_handler, Exception: internal_error_handler})
    app.state.server = state
    return app


async def health(request: Request) -> Response:
    st = server_state(request)
    if st.engine.alive:
        return JSONResponse(Health(status="ok").model_dump())
    return JSONResponse(Health(status="engine not running").model_dump(), status_code=503,
                        headers={"Retry-After": str(RETRY_AFTER_S)})


async def openapi_endpoint(request: Request) -> Response:
    st = server_state(request)
    if st.openapi is None:
        st.openapi = openapi_document(st.config.served_model_names, auth=st.config.tenants.enabled,
                                      vocab_size=st.llm.config.vocab_size, max_model_len=st.llm.max_model_len,
                                      max_body_bytes=st.config.max_body_bytes)
    return JSONResponse(st.openapi)


async def metrics_endpoint(request: Request) -> Response:
    st = server_state(request)
    authorize(st, request)
    snap = await st.engine.snapshot() if st.engine.alive else None
    return Response(st.metrics.render(snap), media_type=CONTENT_TYPE_LATEST)


async def list_models(request: Request) -> Response:
    st = server_state(request)
    authorize(st, request)
    # the file's name, not its path: where the server keeps its files is nobody's business
    root = Path(str(st.llm.model_source)).name
    cards = [ModelCard(id=name, created=st.created, max_model_len=st.llm.max_model_len, root=root)
             for name in st.config.served_model_names]
    return JSONResponse(ModelList(data=cards).model_dump())


async def release_program(request: Request) -> Response:
    st = server_state(request)
    authorize(st, request)
    pid = _path_program_id(request)
    # another tenant's program is out of reach, and answers exactly as an unknown one
    released = await st.engine.release_program(scoped_program_id(tenant_scope(st, request), pid))
    return JSONResponse(ProgramReleased(program_id=pid, released=released).model_dump())


async def end_program(request: Request) -> Response:
    st = server_state(request)
    authorize(st, request)
    pid = _path_program_id(request)
    known = await st.engine.end_program(scoped_program_id(tenant_scope(st, request), pid))
    return JSONResponse(ProgramEnded(program_id=pid, known=known).model_dump())


def _path_program_id(request: Request) -> str:
    pid = request.path_params["program_id"]
    try:
        check_path_id(pid)
    except InputError as e:
        raise input_error(e) from None
    return pid
