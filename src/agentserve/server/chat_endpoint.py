"""POST /v1/chat/completions: the request is checked, rendered and run by
chat_run.py (the path the Responses and Messages APIs share); here it is only
formatted, whole or streamed as chunks with incremental `tool_calls`."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from agentserve.server.chat_run import ChatRun, PromptNames, reply_deltas, start_chat, whole_reply
from agentserve.server.protocol import (AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk,
                                        ChatCompletionRequest, ChunkChoice, Delta)
from agentserve.server.request_checks import accept, program_identity, reject
from agentserve.server.request_run import EventStream, sse, usage_of
from agentserve.server.tool_output import finish_reason


async def chat_completions(request: Request) -> Response:
    st, req, model = await accept(request, ChatCompletionRequest)
    reject(bool(req.logprobs) or bool(req.top_logprobs), "logprobs are not supported", "logprobs")
    ident = program_identity(req, request)
    max_tokens, names = ((req.max_completion_tokens, PromptNames(max_tokens="max_completion_tokens"))
                         if req.max_completion_tokens is not None else (req.max_tokens, PromptNames()))
    run = await start_chat(st, request, req, f"chatcmpl-{uuid.uuid4().hex}", ident, names, max_tokens=max_tokens)
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return EventStream(_chat_events(run, model, usage, st.config.cached_tokens_report), run.stream)
    reply = await whole_reply(run, request)
    if reply is None:
        return Response(status_code=499)  # nobody is listening
    message = AssistantMessage(content=reply.content, tool_calls=[c.to_message() for c in reply.calls] or None)
    body = ChatCompletion(id=run.rid, created=run.created, model=model,
                          usage=usage_of(reply.out, st.config.cached_tokens_report),
                          choices=[ChatChoice(message=message, finish_reason=reply.finish_reason,
                                              stop_reason=reply.out.stop_reason)])
    return Response(body.model_dump_json(), media_type="application/json")


async def _chat_events(run: ChatRun, model: str, include_usage: bool, cached_report: str) -> AsyncIterator[str]:
    def chunk(delta: Delta, finish: str | None = None) -> str:
        return sse(ChatCompletionChunk(id=run.rid, created=run.created, model=model,
                                       choices=[ChunkChoice(delta=delta, finish_reason=finish)]))

    n_calls = 0
    yield chunk(Delta(role="assistant", content=""))
    async for d in reply_deltas(run):
        if d.content:
            yield chunk(Delta(content=d.content))
        if d.calls:
            yield chunk(Delta(tool_calls=[c.to_delta(n_calls + i) for i, c in enumerate(d.calls)]))
            n_calls += len(d.calls)
        if d.out.finished:
            yield chunk(Delta(), finish_reason(d.out.finish_reason, n_calls > 0))
            if include_usage:
                yield sse(ChatCompletionChunk(id=run.rid, created=run.created, model=model, choices=[],
                                              usage=usage_of(d.out, cached_report)))
