"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API
(what Claude Code speaks), a thin translation onto chat's engine request.

The body (messages_protocol.py) becomes a `ChatCompletionRequest` and runs on
chat_run.py's path (tool rendering, call parsing, constrained decoding, the
streaming validator, limits, tenants, the response cache); only the shape of
the reply is Anthropic's. The translation:

- `system` (a string or text blocks) is the system message, its blocks joined
  by blank lines; message content blocks likewise. `thinking` and
  `redacted_thinking` blocks are not shown to the model; `thinking` in the
  body is accepted and ignored (logged once per server).
- An assistant's `tool_use` blocks are its `tool_calls` (input as the
  arguments); a user message's `tool_result` blocks become tool messages
  placed right after that assistant message, before the user's own text
  (chat's order), with `is_error` rendered as an "Error: " prefix. A
  `tool_result` that answers no `tool_use` of the assistant message before
  it, or a `tool_use` left unanswered by the next message, is a 400 naming
  `messages[i].content[j]`.
- `tool_choice` `auto`, `any` (chat's "required"), `tool` (a named function),
  `none`; `disable_parallel_tool_use` is `parallel_tool_calls: false`.
- `max_tokens` is required. One beyond the room the prompt leaves in the
  model's context is cut to that room (as Anthropic's newer models do; Claude
  Code asks for 32000 whatever the model), and a reply that reaches it ends
  with stop_reason `model_context_window_exceeded`. A prompt longer than the
  context is a 400 naming the model and the context that would fit.
- A conversation that ends with an assistant message is Anthropic's prefill:
  the reply continues that message's text (its turn is rendered without its
  end, chat_run.continued_prompt) and its content holds only the new text.
  Only text can be continued: a final assistant message with a `tool_use`
  is refused (the call needs its result first), and so is a prefill with
  `output_config.format` (the JSON grammar decodes a whole document from the
  reply's start, not from inside a prefilled one).
- `output_config.format` (`{"type": "json_schema", "schema": ...}`, Anthropic's
  structured outputs) is chat's strict json_schema `response_format`: the reply
  is decoded under the schema's grammar (structured_output.py).

Claude Code starts its system prompt with an attribution block,
`x-anthropic-billing-header: cc_version=...; cc_entrypoint=...; cch=...;`,
whose `cch` changes on every request. It is billing metadata for Anthropic's
servers, meaningless to a local model, and at the head of the prompt it would
make every request miss the prefix cache; so a system block (or a system
string's first line) starting with `x-anthropic-billing-header:` is dropped.

Program identity is identity.py's order, read from the Anthropic body and
headers: `x-claude-code-session-id` (with `x-claude-code-agent-id` a subagent
is a program of its own), then `metadata.user_id`. `cache_control` breakpoints
change nothing about what is cached (every prefix is); the largest `ttl` given
("5m" or "1h") is the program's retention hint. Usage follows Anthropic's
arithmetic: the prompt is `input_tokens` (computed for this request) +
`cache_read_input_tokens` (read from the prefix cache) +
`cache_creation_input_tokens` (always 0: nothing is written to a cache on
request here). Errors on these paths are Anthropic's shape (api_errors.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentserve.engine.llm_engine import RequestOutput
from agentserve.server.api_errors import APIError, anthropic_error_event
from agentserve.server.chat_run import ChatRun, ReplyDelta, checked_prompt, reply_deltas, start_chat, whole_reply
from agentserve.server.messages_protocol import (MAX_STOP_SEQUENCES, CacheControl, ContentBlockDeltaEvent,
                                                 ContentBlockStartEvent, ContentBlockStopEvent, CountTokensRequest, InputJsonDelta,
                                                 MessageDelta, MessageDeltaEvent, MessageResponse, MessagesRequest,
                                                 MessageStartEvent, MessageStopEvent, MessageUsage, PingEvent,
                                                 RedactedThinkingBlock, TextBlock, TextContent, TextDelta,
                                                 ThinkingBlock, ToolChoiceAny, ToolChoiceTool,
                                                 ToolResultBlock, ToolUseBlock, ToolUseContent, TokensCount)
from agentserve.server.protocol import ChatCompletionRequest
from agentserve.server.request_checks import authorize, check_model, program_identity, read_json, validate_body
from agentserve.server.request_run import EventStream, sse, usage_of
from agentserve.server.server_state import ServerState, server_state
from agentserve.server.tool_output import ParsedCall

log = logging.getLogger("agentserve.server")

BILLING_PREFIX = "x-anthropic-billing-header:"
PING_EVERY_S = 5.0  # a ping after this long without an event keeps proxies and clients from timing out
_TTL_S = {"5m": 300.0, "1h": 3600.0}


def claude_code_model_hint(st: ServerState) -> str:
    name = st.model_name
    return (f". Claude Code sends its own model names unless told otherwise: start it with ANTHROPIC_MODEL={name} "
            f"(and ANTHROPIC_DEFAULT_OPUS_MODEL, ANTHROPIC_DEFAULT_SONNET_MODEL, ANTHROPIC_DEFAULT_HAIKU_MODEL and "
            f"CLAUDE_CODE_SUBAGENT_MODEL set to {name} too, for the models it picks by itself)")


async def _accept(request: Request, body_model: type[CountTokensRequest]) -> tuple[ServerState, Any, str]:
    """request_checks.accept's steps for an Anthropic body: key, body, model."""
    st = server_state(request)
    authorize(st, request)
    body = validate_body(body_model, await read_json(st, request))
    model = check_model(st, body.model, hint=claude_code_model_hint(st))
    if body.thinking is not None and "messages.thinking" not in st.warned:
        st.warned.add("messages.thinking")
        log.info("Messages API: `thinking` is accepted and ignored: the model served here does not think on request "
                 "(said once)")
    return st, body, model


# --- the request, as chat's -------------------------------------------------------


def _joined(texts: list[str]) -> str:
    return "\n\n".join(texts)


def _system_text(system: str | list[TextBlock] | None) -> str | None:
    if system is None:
        return None
    if isinstance(system, str):
        head, _, rest = system.partition("\n")
        return rest if head.lstrip().startswith(BILLING_PREFIX) else system
    return _joined([b.text for b in system if not b.text.lstrip().startswith(BILLING_PREFIX)]) or None


def _result_text(b: ToolResultBlock) -> str:
    if b.content is None:
        text = ""
    elif isinstance(b.content, str):
        text = b.content
    else:
        text = _joined([p.text for p in b.content])
    return "Error: " + text if b.is_error else text


def _refuse(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def _messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """Chat's messages for the body's, checking that each tool_result answers a tool_use of the assistant
    message right before it and that each tool_use is answered by the message right after it."""
    out: list[dict[str, Any]] = []
    system = _system_text(body.system)
    if system is not None:
        out.append({"role": "system", "content": system})
    pending: dict[str, str] = {}  # tool_use id -> where it is, of the assistant message before this one

    def unanswered(i: int) -> None:
        if pending:
            use_id, at = next(iter(pending.items()))
            raise _refuse(f"{at}: tool_use {use_id!r} has no tool_result in messages[{i}]: the user message after an "
                          "assistant's tool_use blocks must answer each with a tool_result block", at)

    for i, m in enumerate(body.messages):
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        if m.role == "assistant":
            unanswered(i)
            texts, calls = [], []
            for j, b in enumerate(blocks):
                at = f"messages[{i}].content[{j}]"
                if isinstance(b, TextBlock):
                    texts.append(b.text)
                elif isinstance(b, ToolUseBlock):
                    if b.id in pending:
                        raise _refuse(f"{at}: the tool_use id {b.id!r} is used twice in this message", at)
                    pending[b.id] = at
                    calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
                elif not isinstance(b, (ThinkingBlock, RedactedThinkingBlock)):
                    raise _refuse(f"{at}: a {b.type} block belongs in a user message", at)
            out.append({"role": "assistant", "content": _joined(texts), **({"tool_calls": calls} if calls else {})})
            continue
        texts, results = [], []
        for j, b in enumerate(blocks):
            at = f"messages[{i}].content[{j}]"
            if isinstance(b, ToolResultBlock):
                if b.tool_use_id not in pending:
                    before = (f"messages[{i - 1}]" if i > 0 and body.messages[i - 1].role == "assistant"
                              else "there is none")
                    raise _refuse(f"{at}: tool_result for tool_use_id {b.tool_use_id!r} answers no unanswered tool_use "
                                  f"of the assistant message right before it ({before})", at)
                del pending[b.tool_use_id]
                results.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b)})
            elif isinstance(b, TextBlock):
                texts.append(b.text)
            else:
                raise _refuse(f"{at}: a {b.type} block belongs in an assistant message", at)
        unanswered(i)
        out.extend(results)  # the results first, right after the calls they answer (chat's order)
        if texts or not results:
            out.append({"role": "user", "content": _joined(texts)})
    if pending:
        use_id, at = next(iter(pending.items()))
        raise _refuse(f"{at}: tool_use {use_id!r} has no tool_result: a conversation that ends with an assistant's "
                      "tool_use cannot be continued (a prefill is text); go on with a user message that answers it",
                      at)
    return out


def prefilled(body: CountTokensRequest) -> bool:
    """Whether the reply continues the last message (an assistant's: Anthropic's prefill)."""
    return body.messages[-1].role == "assistant"


def _cache_ttl(body: CountTokensRequest) -> float | None:
    """The largest `cache_control.ttl` on any block or tool, in seconds (a breakpoint without one: none)."""
    found: list[CacheControl] = []

    def add(block: Any) -> None:
        cc = getattr(block, "cache_control", None)
        if cc is not None and cc.ttl is not None:
            found.append(cc)

    add(body)  # the top-level one (automatic caching)
    for b in body.system if isinstance(body.system, list) else ():
        add(b)
    for t in body.tools or ():
        add(t)
    for m in body.messages:
        for b in m.content if isinstance(m.content, list) else ():
            add(b)
            for part in b.content if isinstance(b, ToolResultBlock) and isinstance(b.content, list) else ():
                add(part)
    return max((_TTL_S[cc.ttl] for cc in found), default=None)


def to_chat(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request this Messages request is, checked (a 400 in terms of the Messages body)."""
    fmt = body.output_config.format if body.output_config is not None else None
    if fmt is not None and (fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict)):
        raise _refuse('output_config.format: the format must be {"type": "json_schema", "schema": {...}}',
                      "output_config.format")
    if fmt is not None and prefilled(body):
        raise _refuse(f"messages[{len(body.messages) - 1}]: the conversation ends with an assistant message (a "
                      "prefill), and output_config.format decodes a whole JSON document from the reply's start: the "
                      "two cannot be combined; end with a user message, or leave out output_config.format",
                      f"messages[{len(body.messages) - 1}]")
    tools = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                               **({"description": t.description} if t.description else {})}}
             for t in body.tools or ()]
    chat: dict[str, Any] = {"model": body.model, "messages": _messages(body)}
    if tools:
        chat["tools"] = tools
    if fmt is not None:  # Anthropic's structured outputs always follow the schema: chat's strict json_schema
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}
    choice = body.tool_choice
    if not tools and choice is not None and choice.type in ("auto", "none"):
        choice = None  # nothing to choose from, nothing to refuse (chat's check would: it needs tools)
    if choice is not None:
        if isinstance(choice, ToolChoiceTool):
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            chat["tool_choice"] = "required" if isinstance(choice, ToolChoiceAny) else choice.type
        if getattr(choice, "disable_parallel_tool_use", None):
            chat["parallel_tool_calls"] = False
    if isinstance(body, MessagesRequest):
        stops = body.stop_sequences or []
        if len(stops) > MAX_STOP_SEQUENCES:
            raise _refuse(f"stop_sequences: at most {MAX_STOP_SEQUENCES} are supported, got {len(stops)}",
                          "stop_sequences")
        chat.update(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                    stop=stops or None, stream=body.stream, ignore_eos=body.ignore_eos or None)
    return validate_body(ChatCompletionRequest, {k: v for k, v in chat.items() if v is not None})


# --- endpoints --------------------------------------------------------------------


async def messages(request: Request) -> Response:
    st, body, model = await _accept(request, MessagesRequest)
    req = to_chat(body)
    ident = program_identity(body, request, cache_ttl=_cache_ttl(body))
    run = await start_chat(st, request, req, f"msg_{uuid.uuid4().hex}", ident, max_tokens=body.max_tokens,
                           clamp_max_tokens=True, continue_final=prefilled(body))
    report = st.config.cached_tokens_report
    if body.stream:
        return EventStream(_events(run, model, report, body.max_tokens), run.stream, done=False,
                           error=anthropic_error_event)
    reply = await whole_reply(run, request)
    if reply is None:
        return Response(status_code=499)  # nobody is listening
    content: list[Any] = [TextContent(text=reply.content)] if reply.content else []
    content += [_tool_use(c) for c in reply.calls]
    reason, sequence = _stop_reason(reply.out, bool(reply.calls), body.max_tokens)
    msg = MessageResponse(id=run.rid, model=model, content=content, stop_reason=reason, stop_sequence=sequence,
                          usage=_usage(reply.out, report))
    return Response(msg.model_dump_json(), media_type="application/json")


async def count_tokens(request: Request) -> Response:
    """The prompt's length as the real request would render it (the same template, tools and drops)."""
    st, body, _ = await _accept(request, CountTokensRequest)
    _, _, ids = await checked_prompt(st, to_chat(body), program_identity(body, request),
                                     continue_final=prefilled(body))
    return JSONResponse(TokensCount(input_tokens=len(ids)).model_dump())


# --- the reply, in Anthropic's shape --------------------------------------------------


def _tool_use(c: ParsedCall) -> ToolUseContent:
    return ToolUseContent(id="toolu_" + c.id.removeprefix("call_"), name=c.name, input=json.loads(c.arguments))


def _stop_reason(out: RequestOutput, made_calls: bool, max_tokens: int) -> tuple[str, str | None]:
    if made_calls:
        return "tool_use", None
    if out.finish_reason == "length":
        # cut short of the client's max_tokens: the context ran out first (the cap was clamped to it)
        return ("max_tokens" if len(out.token_ids) >= max_tokens else "model_context_window_exceeded"), None
    if out.finish_reason == "stop" and isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def _usage(out: RequestOutput, cached_tokens_report: str) -> MessageUsage:
    u = usage_of(out, cached_tokens_report)
    cached = u.prompt_tokens_details.cached_tokens
    return MessageUsage(input_tokens=u.prompt_tokens - cached, output_tokens=u.completion_tokens,
                        cache_read_input_tokens=cached)


_PING = sse(PingEvent(), "ping")


def _event(ev: Any) -> str:
    return sse(ev, ev.type)


async def _events(run: ChatRun, model: str, cached_tokens_report: str, max_tokens: int) -> AsyncIterator[str]:
    """Anthropic's event sequence. message_start goes out before the prompt is even scheduled, so its usage
    counts the whole prompt as input; message_delta carries the final split (cache reads known by then)."""
    start = MessageResponse(id=run.rid, model=model, content=[], stop_reason=None,
                            usage=MessageUsage(input_tokens=run.num_prompt_tokens, output_tokens=0))
    yield _event(MessageStartEvent(message=start))
    yield _PING
    index, text_open, made_calls = -1, False, False
    deltas = _with_pings(reply_deltas(run), PING_EVERY_S)
    try:
        async for d in deltas:
            if d is None:
                yield _PING
                continue
            if d.content:
                if not text_open:
                    index, text_open = index + 1, True
                    yield _event(ContentBlockStartEvent(index=index, content_block=TextContent(text="")))
                yield _event(ContentBlockDeltaEvent(index=index, delta=TextDelta(text=d.content)))
            for c in d.calls:
                if text_open:
                    yield _event(ContentBlockStopEvent(index=index))
                    text_open = False
                index += 1
                use = _tool_use(c)
                yield _event(ContentBlockStartEvent(index=index, content_block=use.model_copy(update={"input": {}})))
                yield _event(ContentBlockDeltaEvent(index=index, delta=InputJsonDelta(partial_json=c.arguments)))
                yield _event(ContentBlockStopEvent(index=index))
                made_calls = True
            if d.out.finished:
                if text_open:
                    yield _event(ContentBlockStopEvent(index=index))
                reason, sequence = _stop_reason(d.out, made_calls, max_tokens)
                yield _event(MessageDeltaEvent(delta=MessageDelta(stop_reason=reason, stop_sequence=sequence),
                                               usage=_usage(d.out, cached_tokens_report)))
                yield _event(MessageStopEvent())
    finally:
        await deltas.aclose()  # now, not when collected: its pending read must not outlive the response


async def _with_pings(deltas: AsyncIterator[ReplyDelta], every: float) -> AsyncIterator[ReplyDelta | None]:
    """`deltas`, with a None each time `every` seconds pass without one (a ping is due). The pending
    read is never cancelled by a ping, only when the stream ends early."""
    it = deltas.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield None
                continue
            task, pending = pending, None
            try:
                d = task.result()
            except StopAsyncIteration:
                return
            yield d
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await it.aclose()  # type: ignore[attr-defined]
