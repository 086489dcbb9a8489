"""The OpenAI-compatible HTTP app (Starlette), in front of an `AsyncEngine`.

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
POST /v1/programs/{id}/release and /end (explicit retention control, DESIGN.md
"Request identity"), GET /health, GET /metrics.

Every error is OpenAI's JSON shape `{"error": {"message", "type", "param",
"code"}}`, so clients raise their usual exception types. A request is checked
completely (auth, size, JSON, schema, model, tools, sampling values, prompt
length) before it reaches the engine; once it is in the engine, a `finally`
closes its stream on every path, so a client that goes away mid-request
aborts it and its KV blocks are freed.

The body is parsed by hand rather than by FastAPI's dependency injection: the
error replies must be OpenAI's 400s, not FastAPI's 422s, and the body limit
must hold before anything is parsed. The app takes any object with the `LLM`
attributes it reads (`engine`, `scheduler`, `tokenizer`, `chat_template`,
`config`, `max_model_len`, `model_source`), so this layer never imports torch."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agentserve.engine.llm_engine import RequestOutput
from agentserve.engine.sampling_params import SamplingParams
from agentserve.server.async_engine import AsyncEngine
from agentserve.server.chat_template import TemplateError
from agentserve.server.engine_thread import EngineThread
from agentserve.server.identity import IdentityError, ProgramIdentity, resolve_identity
from agentserve.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from agentserve.server.request_stream import EngineError, EngineStopped, QueueFullError, RequestStream
from agentserve.server.protocol import (AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk,
                                        ChatCompletionRequest, ChunkChoice, Completion, CompletionChoice,
                                        CompletionRequest, Delta, ErrorBody, ErrorResponse, ModelCard, ModelList,
                                        NamedToolChoice, Usage, now_s)
from agentserve.server.render_cache import DEFAULT_ENTRIES as RENDER_CACHE_ENTRIES
from agentserve.server.render_cache import RenderCache
from agentserve.server.response_cache import ResponseCache, hit_hints
from agentserve.server.tool_output import (OutputDelta, ToolChoice, ToolChoiceError, ToolCallStreamer,
                                           finish_reason, parse_tool_output, tool_choice_for)
from agentserve.server.tool_validation import RegeneratingStream, ValidatorConfig, with_validator

log = logging.getLogger("agentserve.server")


@dataclass
class ServerConfig:
    served_model_names: list[str]  # the first is reported; any of them is accepted as `model`
    api_key: str | None = None  # Bearer token required on /v1/* when set
    max_queue: int | None = None  # requests waiting for admission at most (None: no limit); beyond: 503
    max_body_bytes: int = 16 * 2**20  # beyond: 413
    stats_interval: float | None = None  # seconds between the engine's stats log lines (None: none)
    tool_calls: ValidatorConfig = field(default_factory=ValidatorConfig)  # the streaming tool-call validator
    render_cache: int = RENDER_CACHE_ENTRIES  # chat prompts whose token ids are kept for reuse (0: off)
    response_cache: int = 0  # finished responses kept for exact repeats (0: off); see response_cache.py

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("at least one served model name is needed")


@dataclass
class ServerState:
    llm: Any
    engine: AsyncEngine
    metrics: ServerMetrics
    config: ServerConfig
    created: int = field(default_factory=now_s)
    warned_unconstrained: bool = False
    render_cache: RenderCache | None = None
    response_cache: ResponseCache | None = None

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]


class APIError(Exception):
    """An error reply in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def create_app(llm: Any, config: ServerConfig, *, engine: AsyncEngine | None = None,
               thread: EngineThread | None = None) -> Starlette:
    """The app for `llm`. The engine loop starts with the app's lifespan and stops with it,
    on `thread` if given (the thread that built `llm`: see engine_thread.py);
    `app.state.server` (a ServerState) gives tests the engine and the metrics."""
    metrics = ServerMetrics(config.served_model_names[0])
    if engine is None:
        engine = AsyncEngine(llm, max_queue=config.max_queue, listener=metrics, thread=thread,
                             stats_interval=config.stats_interval)
    state = ServerState(llm, engine, metrics, config)
    if config.render_cache > 0:
        state.render_cache = engine.render_cache = RenderCache(llm.chat_template, llm.tokenizer, config.render_cache)
    if config.response_cache > 0:
        state.response_cache = engine.response_cache = ResponseCache(config.response_cache)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await run_in_threadpool(state.engine.stop)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/programs/{program_id:path}/release", release_program, methods=["POST"]),
        Route("/v1/programs/{program_id:path}/end", end_program, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        APIError: _api_error, HTTPException: _http_error, Exception: _internal_error})
    app.state.server = state
    return app


# --- errors -----------------------------------------------------------------------


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    msg = f"{request.method} {request.url.path}: {exc.detail}"
    return APIError(exc.status_code, msg, code=kind).response()


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}", "server_error").response()


# --- request checks ---------------------------------------------------------------


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _authorize(st: ServerState, request: Request) -> None:
    key = st.config.api_key
    if key is None:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                       code="invalid_api_key")
    if not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "incorrect API key provided", code="invalid_api_key")


async def _read_json(st: ServerState, request: Request) -> dict:
    limit = st.config.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {declared} bytes; the limit is {limit} (--max-body-bytes)",
                       code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"the request body exceeds {limit} bytes (--max-body-bytes)",
                           code="request_too_large")
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise APIError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(obj, dict):
        raise APIError(400, "the request body must be a JSON object")
    return obj


def _validate(model: type[BaseModel], obj: dict) -> Any:
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        first = errs[0]
        loc = ".".join(str(x) for x in first["loc"])
        more = f" (and {len(errs) - 1} more problems)" if len(errs) > 1 else ""
        raise APIError(400, f"{loc or 'body'}: {first['msg']}{more}", param=loc or None) from None


def _check_model(st: ServerState, name: str | None) -> str:
    if name is not None and name not in st.config.served_model_names:
        raise APIError(404, f"the model `{name}` does not exist; this server serves "
                            f"{', '.join(st.config.served_model_names)}", param="model", code="model_not_found")
    return st.model_name


def _reject(cond: bool, message: str, param: str) -> None:
    if cond:
        raise APIError(400, message, param=param, code="unsupported_parameter")


def _check_common(req: Any) -> None:
    _reject(req.n is not None and req.n != 1, f"n={req.n}: only n=1 is supported", "n")
    _reject(bool(req.presence_penalty), "presence_penalty is not supported (send 0 or leave it out)",
            "presence_penalty")
    _reject(bool(req.frequency_penalty), "frequency_penalty is not supported (send 0 or leave it out)",
            "frequency_penalty")
    _reject(bool(req.logit_bias), "logit_bias is not supported", "logit_bias")


def _identity(req: Any, request: Request) -> ProgramIdentity:
    try:
        return resolve_identity(req, request.headers)
    except IdentityError as e:
        raise APIError(400, str(e), param=e.param) from None


def _sampling(st: ServerState, req: Any, num_prompt: int, max_tokens: int | None, prompt_param: str,
              max_param: str) -> SamplingParams:
    """Sampling parameters, with the length checks OpenAI makes (prompt + completion within context)."""
    limit = st.llm.max_model_len
    if num_prompt >= limit:
        raise APIError(400, f"this model's maximum context length is {limit} tokens, but the prompt is "
                            f"{num_prompt} tokens; shorten the {prompt_param}", param=prompt_param,
                       code="context_length_exceeded")
    kv = st.llm.scheduler.kv
    room = limit - num_prompt
    if max_tokens is None:
        max_tokens = min(room, kv.num_blocks * kv.block_size - num_prompt)
        if max_tokens < 1:
            raise APIError(400, f"the prompt of {num_prompt} tokens does not fit the KV cache "
                                f"({kv.num_blocks * kv.block_size} tokens)", param=prompt_param,
                           code="context_length_exceeded")
    elif max_tokens > room:
        raise APIError(400, f"this model's maximum context length is {limit} tokens, but {num_prompt + max_tokens} "
                            f"were requested ({num_prompt} in the {prompt_param}, {max_tokens} in the completion); "
                            f"reduce the {prompt_param} or {max_param}", param=max_param,
                       code="context_length_exceeded")
    if req.seed is not None and not -2**63 <= req.seed < 2**64:
        raise APIError(400, "seed must fit in 64 bits", param="seed")
    vocab = st.llm.config.vocab_size
    bad = [t for t in req.stop_token_ids or () if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"stop_token_ids: {bad[0]} is not a token id (vocabulary of {vocab})",
                       param="stop_token_ids")
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, seed=req.seed,
                              stop=req.stop or [], stop_token_ids=list(req.stop_token_ids or ()),
                              ignore_eos=req.ignore_eos)
    except ValueError as e:
        msg = str(e)
        param = next((f for f in _SAMPLING_FIELDS if f in msg), None)
        raise APIError(400, msg, param=max_param if param == "max_tokens" else param) from None


_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "stop")  # named in SamplingParams' errors


async def _open(st: ServerState, request: Request, ids: list[int], params: SamplingParams, rid: str,
                ident: ProgramIdentity, prompt_param: str, choice: ToolChoice | None = None) -> RequestStream:
    """The request's outputs: from the response cache when it holds them, else from the engine."""
    rc = st.response_cache
    if rc is None:
        return await _submit(st, ids, params, rid, ident, prompt_param)
    variant = "" if choice is None else repr((choice.mode, sorted(choice.allowed), choice.parallel))
    return await rc.open(ids, params, request_id=rid, model=f"{st.model_name}\0{st.llm.model_source}",
                         headers=request.headers, submit=lambda p: _submit(st, ids, p, rid, ident, prompt_param),
                         on_hit=lambda: hit_hints(st.engine, ident), variant=variant)


async def _submit(st: ServerState, ids: list[int], params: SamplingParams, rid: str, ident: ProgramIdentity,
                  prompt_param: str) -> RequestStream:
    try:
        return await st.engine.submit(ids, params, request_id=rid, program_id=ident.program_id,
                                      ttl_hint=ident.ttl, is_last_turn=ident.is_last_turn,
                                      release_after=ident.release_after)
    except QueueFullError as e:
        raise APIError(503, str(e), "server_error", code="queue_full") from None
    except EngineStopped as e:
        raise APIError(503, str(e), "server_error", code="engine_unavailable") from None
    except ValueError as e:  # the scheduler refused it: it can never fit
        raise APIError(400, str(e), param=prompt_param, code="context_length_exceeded") from None


# --- running a request ----------------------------------------------------------------


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client has gone away (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(stream: RequestStream, request: Request) -> RequestOutput | None:
    """The finished output, or None if the client disconnected first (the request is aborted)."""

    async def last() -> RequestOutput:
        out = None
        async for out in stream:
            pass
        assert out is not None and out.finished
        return out

    consumer = asyncio.ensure_future(last())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if consumer.done():
            return consumer.result()  # raises EngineError / EngineStopped
        return None
    finally:
        watcher.cancel()
        consumer.cancel()
        stream.close()


def _engine_failure(e: Exception) -> APIError:
    return APIError(503 if isinstance(e, EngineStopped) else 500, str(e), "server_error",
                    code="engine_unavailable" if isinstance(e, EngineStopped) else "engine_error")


class _EventStream(StreamingResponse):
    """Server-sent events for one request. Whatever ends the response (the last
    event, a client gone before or during the stream, a shutdown), the events
    generator is closed and the request's stream too, which aborts a request
    nobody listens to any more."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], stream: RequestStream) -> None:
        events = self._ended(events)
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._stream = stream

    @staticmethod
    async def _ended(events: AsyncIterator[str]) -> AsyncIterator[str]:
        """`events`, then [DONE]; an engine failure mid-stream becomes an error event first."""
        try:
            async for event in events:
                yield event
            yield _DONE
        except (EngineError, EngineStopped) as e:
            yield _sse(_engine_failure(e).body())
            yield _DONE
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()  # first: a generator that never started has no finally to run
            await self._events.aclose()  # type: ignore[attr-defined]


def _sse(obj: BaseModel | dict) -> str:
    data = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


_DONE = "data: [DONE]\n\n"


def _usage(out: RequestOutput) -> Usage:
    return Usage.of(out.num_prompt_tokens, len(out.token_ids), out.num_cached_tokens)


def _log_done(rid: str, ident: ProgramIdentity, out: RequestOutput) -> None:
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s program=%s prompt=%d cached=%d completion=%d finish=%s e2e=%.3fs", rid,
                  ident.program_id or "-", out.num_prompt_tokens, out.num_cached_tokens, len(out.token_ids),
                  out.finish_reason, (out.finish_time or out.arrival_time) - out.arrival_time)


# --- endpoints ----------------------------------------------------------------------------


async def health(request: Request) -> Response:
    st = _state(request)
    if st.engine.alive:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "engine not running"}, status_code=503)


async def metrics_endpoint(request: Request) -> Response:
    st = _state(request)
    snap = await st.engine.snapshot() if st.engine.alive else None
    return Response(st.metrics.render(snap), media_type=CONTENT_TYPE_LATEST)


async def list_models(request: Request) -> Response:
    st = _state(request)
    _authorize(st, request)
    cards = [ModelCard(id=name, created=st.created, max_model_len=st.llm.max_model_len,
                       root=str(st.llm.model_source)) for name in st.config.served_model_names]
    return JSONResponse(ModelList(data=cards).model_dump())


async def release_program(request: Request) -> Response:
    st = _state(request)
    _authorize(st, request)
    pid = request.path_params["program_id"]
    released = await st.engine.release_program(pid)
    return JSONResponse({"program_id": pid, "released": released})


async def end_program(request: Request) -> Response:
    st = _state(request)
    _authorize(st, request)
    pid = request.path_params["program_id"]
    known = await st.engine.end_program(pid)
    return JSONResponse({"program_id": pid, "ended": True, "known": known})


# --- chat ---


def _chat_tool_choice(req: ChatCompletionRequest) -> ToolChoice | None:
    names = [t.function.name for t in req.tools or ()]
    named = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None
    plain = req.tool_choice if isinstance(req.tool_choice, str) else None
    try:
        return tool_choice_for(names, plain, named, req.parallel_tool_calls)
    except ToolChoiceError as e:
        raise APIError(400, str(e), param="tool_choice") from None


def _constrain_call(st: ServerState, req: ChatCompletionRequest, choice: ToolChoice,
                    params: SamplingParams) -> SamplingParams:
    """tool_choice "required" or named: hold decoding to one valid call of an allowed
    tool (its arguments following the tool's schema). Without the grammar library
    the output is only parsed, and the server says so once in its log."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
    tools = [t for t in tools if t.get("function", {}).get("name") in choice.allowed]
    try:
        constraint = st.llm.tool_call_constraint(tools)
    except ValueError as e:
        raise APIError(400, str(e), param="tools") from None
    except RuntimeError as e:  # StructuredOutputUnavailable: xgrammar is not installed
        if not st.warned_unconstrained:
            log.warning("%s; tool_choice %s is parsed, not enforced", e, choice.mode)
            st.warned_unconstrained = True
        return params
    return dataclasses.replace(params, constraint=constraint)


def _render_chat(st: ServerState, req: ChatCompletionRequest) -> list[int]:
    messages = []
    for m in req.messages:
        d = m.model_dump(exclude_none=True)
        if d["role"] == "developer":  # OpenAI's newer name for the system role
            d["role"] = "system"
        messages.append(d)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    try:
        if st.render_cache is not None:
            return st.render_cache.encode_chat(messages, tools)
        prompt = st.llm.chat_template.render(messages, tools=tools)
    except TemplateError as e:
        raise APIError(400, str(e), param="messages") from None
    return st.llm.tokenizer.encode(prompt)


async def _accept(request: Request, body_model: type[BaseModel]) -> tuple[ServerState, Any, str]:
    """The checks every generation endpoint makes first: key, body, model, shared fields."""
    st = _state(request)
    _authorize(st, request)
    req = _validate(body_model, await _read_json(st, request))
    model = _check_model(st, req.model)
    _check_common(req)
    return st, req, model


async def chat_completions(request: Request) -> Response:
    st, req, model = await _accept(request, ChatCompletionRequest)
    _reject(bool(req.logprobs) or bool(req.top_logprobs), "logprobs are not supported", "logprobs")
    _reject(req.response_format is not None and req.response_format.type != "text",
            "response_format other than text is not supported yet", "response_format")
    choice = _chat_tool_choice(req)
    ident = _identity(req, request)
    ids = await run_in_threadpool(_render_chat, st, req)
    max_tokens, max_param = ((req.max_completion_tokens, "max_completion_tokens")
                             if req.max_completion_tokens is not None else (req.max_tokens, "max_tokens"))
    params = _sampling(st, req, len(ids), max_tokens, "messages", max_param)
    if choice is not None and choice.forced:
        params = await run_in_threadpool(_constrain_call, st, req, choice, params)
    params = with_validator(st.config.tool_calls, st.engine.tool_stats, choice, params)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    stream = await _open(st, request, ids, params, rid, ident, "messages", choice)
    if choice is not None and params.tool_validator is not None and st.config.tool_calls.undeclared == "regenerate":
        stream = RegeneratingStream(  # an undeclared call is re-generated under the tools' grammar
            stream, ids, params, lambda ids2, p2: _submit(st, ids2, p2, rid + "-regen", ident, "messages"),
            lambda p2: run_in_threadpool(_constrain_call, st, req, choice, p2), st.engine.tool_stats)
    created = now_s()
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return _EventStream(_chat_events(stream, rid, created, model, choice, usage, ident), stream)
    try:
        out = await _collect(stream, request)
    except (EngineError, EngineStopped) as e:
        raise _engine_failure(e) from None
    if out is None:
        return Response(status_code=499)  # nobody is listening
    _log_done(rid, ident, out)
    content, calls = parse_tool_output(out.text, choice)
    message = AssistantMessage(content=content, tool_calls=[c.to_message() for c in calls])
    body = ChatCompletion(id=rid, created=created, model=model, usage=_usage(out), choices=[
        ChatChoice(message=message, finish_reason=finish_reason(out.finish_reason, bool(calls)),
                   stop_reason=out.stop_reason)])
    return Response(body.model_dump_json(), media_type="application/json")


async def _chat_events(stream: RequestStream, rid: str, created: int, model: str, choice: ToolChoice | None,
                       include_usage: bool, ident: ProgramIdentity) -> AsyncIterator[str]:
    def chunk(delta: Delta, finish: str | None = None) -> str:
        return _sse(ChatCompletionChunk(id=rid, created=created, model=model,
                                        choices=[ChunkChoice(delta=delta, finish_reason=finish)]))

    streamer = ToolCallStreamer(choice) if choice is not None else None
    n_calls = 0
    yield chunk(Delta(role="assistant", content=""))
    async for out in stream:
        if streamer is None:
            d = OutputDelta(out.new_text)
        else:
            d = streamer.feed(out.new_text)
            if out.finished:
                tail = streamer.finish()
                d = OutputDelta(d.content + tail.content, d.calls + tail.calls)
        if d.content:
            yield chunk(Delta(content=d.content))
        if d.calls:
            yield chunk(Delta(tool_calls=[c.to_delta(n_calls + i) for i, c in enumerate(d.calls)]))
            n_calls += len(d.calls)
        if out.finished:
            _log_done(rid, ident, out)
            yield chunk(Delta(), finish_reason(out.finish_reason, n_calls > 0))
            if include_usage:
                yield _sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                               usage=_usage(out)))


# --- completions ---


def _completion_ids(st: ServerState, req: CompletionRequest) -> list[int]:
    p = req.prompt
    if isinstance(p, list) and p and not isinstance(p[0], int):
        if len(p) != 1:
            raise APIError(400, f"prompt holds {len(p)} prompts; send one prompt per request", param="prompt")
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return st.llm.tokenizer.encode(p)
    if not p:
        raise APIError(400, "prompt must not be empty", param="prompt")
    vocab = st.llm.config.vocab_size
    bad = [t for t in p if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"prompt: {bad[0]} is not a token id (vocabulary of {vocab})", param="prompt")
    return list(p)


async def completions(request: Request) -> Response:
    st, req, model = await _accept(request, CompletionRequest)
    _reject(req.echo, "echo is not supported", "echo")
    _reject(bool(req.suffix), "suffix is not supported", "suffix")
    _reject(req.best_of is not None and req.best_of != 1, "best_of is not supported", "best_of")
    _reject(req.logprobs is not None, "logprobs are not supported", "logprobs")
    ident = _identity(req, request)
    ids = await run_in_threadpool(_completion_ids, st, req)
    params = _sampling(st, req, len(ids), req.max_tokens, "prompt", "max_tokens")
    rid = f"cmpl-{uuid.uuid4().hex}"
    stream = await _open(st, request, ids, params, rid, ident, "prompt")
    created = now_s()
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return _EventStream(_completion_events(stream, rid, created, model, usage, ident), stream)
    try:
        out = await _collect(stream, request)
    except (EngineError, EngineStopped) as e:
        raise _engine_failure(e) from None
    if out is None:
        return Response(status_code=499)
    _log_done(rid, ident, out)
    body = Completion(id=rid, created=created, model=model, usage=_usage(out), choices=[
        CompletionChoice(text=out.text, finish_reason=out.finish_reason, stop_reason=out.stop_reason)])
    return Response(body.model_dump_json(), media_type="application/json")


async def _completion_events(stream: RequestStream, rid: str, created: int, model: str, include_usage: bool,
                             ident: ProgramIdentity) -> AsyncIterator[str]:
    async for out in stream:
        if out.new_text or out.finished:
            yield _sse(Completion(id=rid, created=created, model=model, choices=[
                CompletionChoice(text=out.new_text, finish_reason=out.finish_reason if out.finished else None,
                                 stop_reason=out.stop_reason)]))
        if out.finished:
            _log_done(rid, ident, out)
            if include_usage:
                yield _sse(Completion(id=rid, created=created, model=model, choices=[], usage=_usage(out)))
