"""Running a checked request: submitting it (through the response cache when
one is on), collecting its finished output while watching for the client to
go away, or streaming it as server-sent events. Whatever ends a response, a
`finally` closes the request's stream, so a request nobody listens to any
more is aborted and its KV blocks are freed."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse

from agentserve.engine.llm_engine import RequestOutput
from agentserve.engine.sampling_params import SamplingParams
from agentserve.server.api_errors import APIError, engine_failure
from agentserve.server.identity import ProgramIdentity
from agentserve.server.protocol import Usage
from agentserve.server.request_stream import EngineError, EngineStopped, QueueFullError, RequestStream
from agentserve.server.response_cache import hit_hints
from agentserve.server.server_state import ServerState
from agentserve.server.tool_output import ToolChoice

log = logging.getLogger("agentserve.server")


async def open_request(st: ServerState, request: Request, ids: list[int], params: SamplingParams, rid: str,
                       ident: ProgramIdentity, prompt_param: str, choice: ToolChoice | None = None) -> RequestStream:
    """The request's outputs: from the response cache when it holds them, else from the engine."""
    rc = st.response_cache
    if rc is None:
        return await submit_request(st, ids, params, rid, ident, prompt_param)
    variant = "" if choice is None else repr((choice.mode, sorted(choice.allowed), choice.parallel))
    return await rc.open(ids, params, request_id=rid, model=f"{st.model_name}\0{st.llm.model_source}",
                         headers=request.headers,
                         submit=lambda p: submit_request(st, ids, p, rid, ident, prompt_param),
                         on_hit=lambda: hit_hints(st.engine, ident), variant=variant, salt=ident.cache_salt)


async def submit_request(st: ServerState, ids: list[int], params: SamplingParams, rid: str,
                         ident: ProgramIdentity, prompt_param: str) -> RequestStream:
    try:
        return await st.engine.submit(ids, params, request_id=rid, program_id=ident.program_id,
                                      ttl_hint=ident.ttl, is_last_turn=ident.is_last_turn,
                                      release_after=ident.release_after, cache_salt=ident.cache_salt)
    except QueueFullError as e:
        raise APIError(503, str(e), "server_error", code="queue_full") from None
    except EngineStopped as e:
        raise APIError(503, str(e), "server_error", code="engine_unavailable") from None
    except ValueError as e:  # the scheduler refused it: it can never fit
        raise APIError(400, str(e), param=prompt_param, code="context_length_exceeded") from None


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client has gone away (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(stream: RequestStream, request: Request, rid: str, ident: ProgramIdentity) -> RequestOutput | None:
    """The finished output (logged), or None if the client disconnected first (the
    request is aborted). An engine failure is raised as its API error."""
    try:
        out = await _last_unless_gone(stream, request)
    except (EngineError, EngineStopped) as e:
        raise engine_failure(e) from None
    if out is not None:
        log_done(rid, ident, out)
    return out


async def _last_unless_gone(stream: RequestStream, request: Request) -> RequestOutput | None:

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


class EventStream(StreamingResponse):
    """Server-sent events for one request. Whatever ends the response (the last
    event, a client gone before or during the stream, a shutdown), the events
    generator is closed and the request's stream too, which aborts a request
    nobody listens to any more."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], stream: RequestStream, *, done: bool = True,
                 error: Callable[[APIError], str] | None = None) -> None:
        """`done`: end with OpenAI chat's `data: [DONE]` (APIs whose streams end with an event of their own
        pass False). `error`: the event that tells of an engine failure mid-stream, in the API's own shape
        (default: OpenAI's error object as a data line)."""
        events = self._ended(events, done, error or _openai_error_event)
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._stream = stream

    @staticmethod
    async def _ended(events: AsyncIterator[str], done: bool,
                     error: Callable[[APIError], str]) -> AsyncIterator[str]:
        """`events`, then [DONE] (when `done`); an engine failure mid-stream becomes an error event first."""
        try:
            async for event in events:
                yield event
            if done:
                yield DONE
        except (EngineError, EngineStopped) as e:
            yield error(engine_failure(e))
            if done:
                yield DONE
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()  # first: a generator that never started has no finally to run
            await self._events.aclose()  # type: ignore[attr-defined]


def sse(obj: BaseModel | dict, event: str | None = None) -> str:
    """One server-sent event; `event`: its `event:` line (the Responses and Messages APIs name each event)."""
    data = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n" if event is None else f"event: {event}\ndata: {data}\n\n"


DONE = "data: [DONE]\n\n"


def _openai_error_event(err: APIError) -> str:
    return sse(err.body())


def usage_of(out: RequestOutput, cached_tokens_report: str = "exact") -> Usage:
    """The usage a client sees; `cached_tokens_report` "none" (the server's flag) reports no prefix hits,
    for operators who would rather not tell clients what the cache holds."""
    cached = out.num_cached_tokens if cached_tokens_report == "exact" else 0
    return Usage.of(out.num_prompt_tokens, len(out.token_ids), cached)


def log_done(rid: str, ident: ProgramIdentity, out: RequestOutput) -> None:
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s program=%s prompt=%d cached=%d completion=%d finish=%s e2e=%.3fs", rid,
                  ident.program_id or "-", out.num_prompt_tokens, out.num_cached_tokens, len(out.token_ids),
                  out.finish_reason, (out.finish_time or out.arrival_time) - out.arrival_time)
