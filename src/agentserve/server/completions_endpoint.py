"""POST /v1/completions: a text prompt or token ids, the reply whole or
streamed."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from agentserve.server.api_errors import APIError
from agentserve.server.identity import ProgramIdentity
from agentserve.server.protocol import Completion, CompletionChoice, CompletionRequest, now_s
from agentserve.server.request_checks import accept, program_identity, reject, sampling_params
from agentserve.server.request_run import EventStream, collect, log_done, open_request, sse, usage_of
from agentserve.server.request_stream import RequestStream
from agentserve.server.server_state import ServerState


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
    st, req, model = await accept(request, CompletionRequest)
    reject(req.echo, "echo is not supported", "echo")
    reject(bool(req.suffix), "suffix is not supported", "suffix")
    reject(req.best_of is not None and req.best_of != 1, "best_of is not supported", "best_of")
    reject(req.logprobs is not None, "logprobs are not supported", "logprobs")
    ident = program_identity(req, request)
    ids = await run_in_threadpool(_completion_ids, st, req)
    params = sampling_params(st, req, len(ids), req.max_tokens, "prompt", "max_tokens")
    rid = f"cmpl-{uuid.uuid4().hex}"
    stream = await open_request(st, request, ids, params, rid, ident, "prompt")
    created = now_s()
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return EventStream(_completion_events(stream, rid, created, model, usage, ident,
                                              st.config.cached_tokens_report), stream)
    out = await collect(stream, request, rid, ident)
    if out is None:
        return Response(status_code=499)
    usage = usage_of(out, st.config.cached_tokens_report)
    body = Completion(id=rid, created=created, model=model, usage=usage, choices=[
        CompletionChoice(text=out.text, finish_reason=out.finish_reason, stop_reason=out.stop_reason)])
    return Response(body.model_dump_json(), media_type="application/json")


async def _completion_events(stream: RequestStream, rid: str, created: int, model: str, include_usage: bool,
                             ident: ProgramIdentity, cached_report: str) -> AsyncIterator[str]:
    async for out in stream:
        if out.new_text or out.finished:
            yield sse(Completion(id=rid, created=created, model=model, choices=[
                CompletionChoice(text=out.new_text, finish_reason=out.finish_reason if out.finished else None,
                                 stop_reason=out.stop_reason)]))
        if out.finished:
            log_done(rid, ident, out)
            if include_usage:
                yield sse(Completion(id=rid, created=created, model=model, choices=[],
                                     usage=usage_of(out, cached_report)))
