"""POST /v1/chat/completions: messages rendered with the model's chat template
(through the render cache when it is on), `tool_choice` resolved and, when a
call is forced, decoding held to the tools' grammar; the streaming tool-call
validator and the re-generation of undeclared calls (tool_validation.py);
the reply whole, or streamed as chunks with incremental `tool_calls`."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Hashable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from agentserve.engine.sampling_params import SamplingParams
from agentserve.server.api_errors import APIError
from agentserve.server.chat_template import TemplateError
from agentserve.server.identity import ProgramIdentity
from agentserve.server.input_checks import InputError
from agentserve.server.message_checks import check_chat
from agentserve.server.protocol import (AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk,
                                        ChatCompletionRequest, ChunkChoice, Delta, NamedToolChoice, now_s)
from agentserve.server.request_checks import accept, input_error, program_identity, reject, sampling_params
from agentserve.server.request_run import (EventStream, collect, log_done, open_request, sse, submit_request,
                                           usage_of)
from agentserve.server.request_stream import RequestStream
from agentserve.server.server_state import ServerState
from agentserve.server.tool_output import (OutputDelta, ToolChoice, ToolChoiceError, ToolCallStreamer,
                                           finish_reason, parse_tool_output, tool_choice_for)
from agentserve.server.tool_validation import RegeneratingStream, with_validator

log = logging.getLogger("agentserve.server")


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
    the request is refused (400): free text where a call was required would
    only fail later, in the client. A grammar that fails to build for another
    reason leaves the output parsed, not enforced, and the log says so once."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
    tools = [t for t in tools if t.get("function", {}).get("name") in choice.allowed]
    try:
        constraint = st.llm.tool_call_constraint(tools)
    except ValueError as e:
        raise APIError(400, str(e), param="tools") from None
    except RuntimeError as e:
        if _grammar_library_missing(e):
            what = "'required'" if choice.mode == "required" else "naming a function"
            raise APIError(400, f"tool_choice {what} needs constrained decoding, and this server lacks "
                                "xgrammar: install it where the server runs with pip install 'agentserve[structured]' "
                                "(or send tool_choice 'auto')", param="tool_choice",
                           code="structured_output_unavailable") from None
        if not st.warned_unconstrained:
            log.warning("%s; tool_choice %s is parsed, not enforced", e, choice.mode)
            st.warned_unconstrained = True
        return params
    return dataclasses.replace(params, constraint=constraint)


def _grammar_library_missing(e: RuntimeError) -> bool:
    # runner/structured.py's StructuredOutputUnavailable, known by name: this layer never imports the runner
    return any(c.__name__ == "StructuredOutputUnavailable" for c in type(e).__mro__)


def render_chat(st: ServerState, req: ChatCompletionRequest, scope: Hashable = None) -> list[int]:
    messages = []
    for m in req.messages:
        d = m.model_dump(exclude_none=True)
        if d["role"] == "developer":  # OpenAI's newer name for the system role
            d["role"] = "system"
        messages.append(d)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    try:
        if st.render_cache is not None:
            return st.render_cache.encode_chat(messages, tools, scope)
        prompt = st.llm.chat_template.render(messages, tools=tools)
    except TemplateError as e:
        raise APIError(400, str(e), param="messages") from None
    return st.llm.tokenizer.encode(prompt)


async def chat_completions(request: Request) -> Response:
    st, req, model = await accept(request, ChatCompletionRequest)
    try:
        check_chat(req)
    except InputError as e:
        raise input_error(e) from None
    reject(bool(req.logprobs) or bool(req.top_logprobs), "logprobs are not supported", "logprobs")
    reject(req.response_format is not None and req.response_format.type != "text",
           "response_format other than text is not supported yet", "response_format")
    choice = _chat_tool_choice(req)
    ident = program_identity(req, request)
    ids = await run_in_threadpool(render_chat, st, req, ident.cache_salt)
    max_tokens, max_param = ((req.max_completion_tokens, "max_completion_tokens")
                             if req.max_completion_tokens is not None else (req.max_tokens, "max_tokens"))
    params = sampling_params(st, req, len(ids), max_tokens, "messages", max_param)
    if choice is not None and choice.forced:
        params = await run_in_threadpool(_constrain_call, st, req, choice, params)
    params = with_validator(st.config.tool_calls, st.engine.tool_stats, choice, params)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    stream = await open_request(st, request, ids, params, rid, ident, "messages", choice)
    if choice is not None and params.tool_validator is not None and st.config.tool_calls.undeclared == "regenerate":
        stream = RegeneratingStream(  # an undeclared call is re-generated under the tools' grammar
            stream, ids, params, lambda ids2, p2: submit_request(st, ids2, p2, rid + "-regen", ident, "messages"),
            lambda p2: run_in_threadpool(_constrain_call, st, req, choice, p2), st.engine.tool_stats)
    created = now_s()
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return EventStream(_chat_events(stream, rid, created, model, choice, usage, ident,
                                        st.config.cached_tokens_report), stream)
    out = await collect(stream, request, rid, ident)
    if out is None:
        return Response(status_code=499)  # nobody is listening
    content, calls = parse_tool_output(out.text, choice)
    message = AssistantMessage(content=content, tool_calls=[c.to_message() for c in calls])
    usage = usage_of(out, st.config.cached_tokens_report)
    body = ChatCompletion(id=rid, created=created, model=model, usage=usage, choices=[
        ChatChoice(message=message, finish_reason=finish_reason(out.finish_reason, bool(calls)),
                   stop_reason=out.stop_reason)])
    return Response(body.model_dump_json(), media_type="application/json")


async def _chat_events(stream: RequestStream, rid: str, created: int, model: str, choice: ToolChoice | None,
                       include_usage: bool, ident: ProgramIdentity, cached_report: str) -> AsyncIterator[str]:
    def chunk(delta: Delta, finish: str | None = None) -> str:
        return sse(ChatCompletionChunk(id=rid, created=created, model=model,
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
            log_done(rid, ident, out)
            yield chunk(Delta(), finish_reason(out.finish_reason, n_calls > 0))
            if include_usage:
                yield sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                              usage=usage_of(out, cached_report)))
