"""A chat request on the engine, whichever API it came in by.

Chat completions, the Responses API and Anthropic's Messages API each
translate their body into a `ChatCompletionRequest` and run it here: the
cross-field checks, `tool_choice` and its grammar, `response_format` and its
grammar (structured_output.py), rendering through the
model's chat template (and the render cache), the sampling values and length
checks, the streaming tool-call validator, the response cache and the
re-generation of undeclared calls. What comes back is one stream of
`ReplyDelta`s (text that is now certain, and whole parsed tool calls), which
each API only formats, so a streamed reply adds up to the whole one in every
API. `PromptNames` lets error messages name the caller's own fields
(`input` and `max_output_tokens` for the Responses API)."""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from agentserve.engine.llm_engine import RequestOutput
from agentserve.engine.sampling_params import SamplingParams
from agentserve.server.api_errors import APIError
from agentserve.server.chat_template import ChatTemplate, TemplateError
from agentserve.server.identity import ProgramIdentity
from agentserve.server.input_checks import InputError
from agentserve.server.message_checks import check_chat
from agentserve.server.protocol import ChatCompletionRequest, NamedToolChoice, ResponseFormat, now_s
from agentserve.server.request_checks import input_error, sampling_params
from agentserve.server.request_run import collect, log_done, open_request, submit_request
from agentserve.server.server_state import ServerState
from agentserve.server.structured_output import constrain_output, json_format, without_bare_json_calls
from agentserve.server.tool_output import (OutputDelta, ParsedCall, ToolChoice, ToolChoiceError, ToolCallStreamer,
                                           finish_reason, parse_tool_output, tool_choice_for)
from agentserve.server.tool_validation import RegeneratingStream, with_validator

log = logging.getLogger("agentserve.server")


@dataclass(frozen=True)
class PromptNames:
    """The caller's names for the prompt and for the output cap, in error messages."""

    prompt: str = "messages"
    max_tokens: str = "max_tokens"


@dataclass
class ChatRun:
    """A chat request that is in the engine (or answered from the response cache)."""

    rid: str
    ident: ProgramIdentity
    choice: ToolChoice | None
    stream: Any  # a RequestStream, or a RegeneratingStream around one: iterate, then close()
    num_prompt_tokens: int
    created: int


@dataclass
class ReplyDelta:
    """What one engine output adds to the reply; `out` is that output (finished on the last)."""

    content: str
    calls: list[ParsedCall]
    out: RequestOutput


@dataclass
class Reply:
    """A finished reply: content (None when the reply is calls only), calls, and the engine's output."""

    content: str | None
    calls: list[ParsedCall]
    out: RequestOutput

    @property
    def finish_reason(self) -> str | None:
        return finish_reason(self.out.finish_reason, bool(self.calls))


def chat_tool_choice(req: ChatCompletionRequest) -> ToolChoice | None:
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
        if grammar_library_missing(e):
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


def grammar_library_missing(e: RuntimeError) -> bool:
    # runner/structured.py's StructuredOutputUnavailable, known by name: this layer never imports the runner
    return any(c.__name__ == "StructuredOutputUnavailable" for c in type(e).__mro__)


def render_chat(st: ServerState, req: ChatCompletionRequest, scope: Hashable = None,
                prompt_param: str = "messages", continue_final: bool = False) -> list[int]:
    """The prompt's token ids. `continue_final`: the last message is an assistant's text that the reply
    continues (Anthropic's prefill): it is rendered without its end of turn, and no new turn is opened."""
    messages = []
    for m in req.messages:
        d = m.model_dump(exclude_none=True)
        if d["role"] == "developer":  # OpenAI's newer name for the system role
            d["role"] = "system"
        messages.append(d)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    try:
        if continue_final:  # not through the render cache: a prefill is rare, and its text ends mid-turn
            prompt = continued_prompt(st.llm.chat_template, messages, tools)
        elif st.render_cache is not None:
            return st.render_cache.encode_chat(messages, tools, scope)
        else:
            prompt = st.llm.chat_template.render(messages, tools=tools)
    except TemplateError as e:
        raise APIError(400, str(e), param=prompt_param) from None
    return st.llm.tokenizer.encode(prompt)


def continued_prompt(template: ChatTemplate, messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None) -> str:
    """The prompt whose continuation continues the last message, an assistant's text: the template renders
    the conversation with a marker after that text (no generation prompt) and the prompt ends where the
    marker begins. The template's own words around the turn are kept (Gemma's `model` role, a trimmed
    start), and what it writes after the content (the end of turn) is dropped. A template that does not
    show the text exactly once cannot be continued."""
    last = messages[-1]
    if last.get("role") != "assistant" or last.get("tool_calls"):
        raise TemplateError(f"messages[{len(messages) - 1}]: only an assistant message of text can be continued")
    marker = f"\x00continue-{secrets.token_hex(8)}\x00"  # nothing a client sends can be it by chance
    content = last.get("content")
    if isinstance(content, list):
        content = [*content, {"type": "text", "text": marker}]
    else:
        content = (content or "") + marker
    text = template.render([*messages[:-1], {**last, "content": content}], tools=tools, add_generation_prompt=False)
    at = text.find(marker)
    if at < 0 or text.find(marker, at + 1) >= 0:
        raise TemplateError(f"messages[{len(messages) - 1}]: the model's chat template does not show the final "
                            "assistant message once, so a reply cannot continue it")
    return text[:at]


async def checked_prompt(st: ServerState, req: ChatCompletionRequest, ident: ProgramIdentity,
                         names: PromptNames = PromptNames(), *, continue_final: bool = False,
                         ) -> tuple[ToolChoice | None, ResponseFormat | None, list[int]]:
    """`req` checked across its fields, its tool choice, its JSON format (None: text) and its prompt's
    token ids: what the engine would be given (count_tokens answers with exactly this).
    `continue_final`: the reply continues the last message (render_chat)."""
    try:
        check_chat(req)
        fmt = json_format(req)
    except InputError as e:
        raise input_error(e) from None
    choice = chat_tool_choice(req)
    if fmt is not None:
        choice = without_bare_json_calls(choice)
    ids = await run_in_threadpool(render_chat, st, req, ident.cache_salt, names.prompt, continue_final)
    return choice, fmt, ids


async def start_chat(st: ServerState, request: Request, req: ChatCompletionRequest, rid: str,
                     ident: ProgramIdentity, names: PromptNames = PromptNames(), *,
                     max_tokens: int | None = None, clamp_max_tokens: bool = False,
                     continue_final: bool = False) -> ChatRun:
    """Check `req`, render it and put it into the engine. `max_tokens`: the output cap
    (None: the room the context leaves), named `names.max_tokens` in errors; `clamp_max_tokens`:
    a cap beyond that room is cut to it rather than refused; `continue_final`: the reply continues
    the last message, an assistant's text (render_chat), and holds only what it adds."""
    choice, fmt, ids = await checked_prompt(st, req, ident, names, continue_final=continue_final)
    params = sampling_params(st, req, len(ids), max_tokens, names.prompt, names.max_tokens, clamp=clamp_max_tokens)
    if choice is not None and choice.forced:
        params = await run_in_threadpool(_constrain_call, st, req, choice, params)
    elif fmt is not None:
        params = await run_in_threadpool(constrain_output, st, req, fmt, choice, params)
    if choice is not None or fmt is None:  # a JSON answer is never cut at a ```bash block
        params = with_validator(st.config.tool_calls, st.engine.tool_stats, choice, params)
    stream = await open_request(st, request, ids, params, rid, ident, names.prompt, choice)
    if choice is not None and params.tool_validator is not None and st.config.tool_calls.undeclared == "regenerate":
        stream = RegeneratingStream(  # an undeclared call is re-generated under the tools' grammar
            stream, ids, params, lambda ids2, p2: submit_request(st, ids2, p2, rid + "-regen", ident, names.prompt),
            lambda p2: run_in_threadpool(_constrain_call, st, req, choice, p2), st.engine.tool_stats)
    return ChatRun(rid, ident, choice, stream, len(ids), now_s())


async def reply_deltas(run: ChatRun) -> AsyncIterator[ReplyDelta]:
    """The reply as it grows: one delta per engine output (often empty), the last one finished.
    The caller closes `run.stream` (EventStream does)."""
    streamer = ToolCallStreamer(run.choice) if run.choice is not None else None
    async for out in run.stream:
        if streamer is None:
            d = OutputDelta(out.new_text)
        else:
            d = streamer.feed(out.new_text)
            if out.finished:
                tail = streamer.finish(cut=out.finish_reason == "length")
                d = OutputDelta(d.content + tail.content, d.calls + tail.calls)
        if out.finished:
            log_done(run.rid, run.ident, out)
        yield ReplyDelta(d.content, d.calls, out)


async def whole_reply(run: ChatRun, request: Request) -> Reply | None:
    """The finished reply, or None when the client went away first (the request is aborted)."""
    out = await collect(run.stream, request, run.rid, run.ident)
    if out is None:
        return None
    content, calls = parse_tool_output(out.text, run.choice, cut=out.finish_reason == "length")
    return Reply(content, calls, out)
