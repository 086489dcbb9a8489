"""A Responses-API request as the chat request that chat_run.py runs.

Input items become chat messages: `instructions` a system message first,
messages as they are (`developer` is chat's too), consecutive
`function_call` / `custom_tool_call` items the `tool_calls` of one assistant
message (after the text of an assistant message right before them), and each
`*_output` item a tool message answering its `call_id`. `reasoning` items are
kept in the store but never shown to the model (this server's models do not
read them back). Any other item type, or a content part that is not text, is
refused by name.

Tools: a `function` tool is chat's function; a `custom` tool (Codex's
freeform tools such as apply_patch) is offered as a function taking one
string, `{"input": "..."}`, whose calls go back to the client as
`custom_tool_call` items carrying that string. A regex grammar becomes the
string's `pattern`, so a call that `tool_choice` forces is decoded under it;
a Lark grammar is shown to the model in the tool's description but not
enforced (xgrammar does not read Lark; the server logs that once). A
`namespace` group's tools are offered one by one, their calls carrying the
namespace. Hosted tools (web search, file search, computer use, MCP, code
interpreter, image generation...) need a service this server does not run:
they are refused with a 400 naming the type.

The items are normalised once (ids given where the client sent none) into the
dicts the store keeps and `input_items` lists, and the messages are built from
those dicts, so a conversation continued from the store and the same
conversation sent in full render the same prompt."""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from agentserve.server.api_errors import APIError
from agentserve.server.input_checks import param_of
from agentserve.server.protocol import ChatCompletionRequest
from agentserve.server.responses_protocol import (TEXT_PART_TYPES, ContentPart, CustomTool, FunctionTool,
                                                  NamedToolChoice, NamespaceTool, OtherItem, OtherTool,
                                                  OtherToolChoice, ReasoningItem, ResponsesRequest)
from agentserve.server.tool_output import ParsedCall

log = logging.getLogger("agentserve.server")

CALL_TYPES = ("function_call", "custom_tool_call")
OUTPUT_TYPES = ("function_call_output", "custom_tool_call_output")
SERVED_ITEMS = ("message", *CALL_TYPES, *OUTPUT_TYPES, "reasoning")
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "custom_tool_call": "ctc",
              "custom_tool_call_output": "ctco", "reasoning": "rs"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def unsupported(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_value")


# --- tools ------------------------------------------------------------------------------


@dataclass(frozen=True)
class OfferedTool:
    kind: str  # "function" or "custom"
    namespace: str | None


def chat_tools(tools: list[Any] | None, warned: set[str]) -> tuple[list[dict[str, Any]], dict[str, OfferedTool]]:
    """The request's tools as chat's function tools, and what each offered name is."""
    out: list[dict[str, Any]] = []
    offered: dict[str, OfferedTool] = {}
    first: dict[str, str] = {}

    def offer(t: FunctionTool | CustomTool, namespace: str | None, where: str) -> None:
        if t.name in offered:
            raise APIError(400, f"{where}.name: the tool name {t.name!r} is already declared by {first[t.name]}; "
                                "tool names must be unique (namespaced tools included)", param=f"{where}.name")
        offered[t.name] = OfferedTool("custom" if isinstance(t, CustomTool) else "function", namespace)
        first[t.name] = where
        out.append(_custom_as_function(t, warned) if isinstance(t, CustomTool) else _function(t))

    for i, t in enumerate(tools or ()):
        if isinstance(t, OtherTool):
            raise unsupported(f"tools[{i}]: tools of type {t.type!r} are not supported: this server runs no hosted "
                              "tools; declare the tool as type 'function' (or 'custom') and run it in the client",
                              f"tools[{i}].type")
        if isinstance(t, NamespaceTool):
            for j, inner in enumerate(t.tools):
                offer(inner, t.name, f"tools[{i}].tools[{j}]")
        else:
            offer(t, None, f"tools[{i}]")
    return out, offered


def _function(t: FunctionTool) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": t.name}
    if t.description is not None:
        fn["description"] = t.description
    if t.parameters is not None:
        fn["parameters"] = t.parameters
    if t.strict is not None:
        fn["strict"] = t.strict
    return {"type": "function", "function": fn}


def _custom_as_function(t: CustomTool, warned: set[str]) -> dict[str, Any]:
    prop: dict[str, Any] = {"type": "string"}
    fmt = t.format
    if fmt is not None and fmt.type == "grammar":
        if fmt.syntax == "regex":
            prop["pattern"] = fmt.definition
        else:
            prop["description"] = f"Written in this Lark grammar:\n{fmt.definition}"
            if "responses.lark" not in warned:
                warned.add("responses.lark")
                log.warning("custom tool %r has a Lark grammar: it is shown to the model, not enforced (the "
                            "decoder takes JSON schemas and regular expressions); logged once", t.name)
    fn: dict[str, Any] = {"name": t.name, "parameters": {
        "type": "object", "properties": {"input": prop}, "required": ["input"], "additionalProperties": False}}
    if t.description is not None:
        fn["description"] = t.description
    return {"type": "function", "function": fn}


def chat_tool_choice(choice: Any, offered: dict[str, OfferedTool]) -> Any:
    if isinstance(choice, OtherToolChoice):
        raise unsupported(f"tool_choice of type {choice.type!r} is not supported; send 'auto', 'none', 'required', "
                          "or {'type': 'function' | 'custom', 'name': ...}", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        tool = offered.get(choice.name)
        if tool is not None and tool.kind != choice.type:
            raise APIError(400, f"tool_choice names the {choice.type} tool {choice.name!r}, but {choice.name!r} is "
                                f"declared as a {tool.kind} tool", param="tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def call_item(call: ParsedCall, offered: dict[str, OfferedTool], status: str) -> dict[str, Any]:
    """A parsed call as the output item a client expects: function_call, or custom_tool_call."""
    tool = offered.get(call.name, OfferedTool("function", None))
    if tool.kind == "custom":
        item = {"id": new_id("ctc"), "type": "custom_tool_call", "call_id": call.id, "name": call.name,
                "input": custom_input(call.arguments), "status": status}
    else:
        item = {"id": new_id("fc"), "type": "function_call", "call_id": call.id, "name": call.name,
                "arguments": call.arguments, "status": status}
    if tool.namespace is not None:
        item["namespace"] = tool.namespace
    return item


def custom_input(arguments: str) -> str:
    """A custom tool's string from the call's arguments (`{"input": ...}`; a model that named the
    field otherwise but wrote one string gets that string; anything else, the arguments' JSON)."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(args, dict):
        if isinstance(args.get("input"), str):
            return args["input"]
        strings = [v for v in args.values() if isinstance(v, str)]
        if len(args) == 1 and len(strings) == 1:
            return strings[0]
    return arguments


# --- input items ------------------------------------------------------------------------


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as the item dicts the store keeps (ids given where missing)."""
    if req.input is None:
        return []
    if isinstance(req.input, str):
        return [{"id": new_id("msg"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": req.input}]}]
    out = []
    for i, item in enumerate(req.input):
        if isinstance(item, OtherItem):
            raise unsupported(f"input[{i}]: items of type {item.type!r} are not supported; this server reads "
                              f"{', '.join(SERVED_ITEMS)}", f"input[{i}].type")
        d = item.model_dump(exclude_none=True, by_alias=True)
        if not isinstance(item, ReasoningItem):
            d["status"] = "completed"
        if d["type"] == "message":
            d["content"] = _parts(item.content, item.role, f"input[{i}]")
        elif d["type"] in OUTPUT_TYPES and not isinstance(item.output, str):
            _text(item.output, f"input[{i}].output")  # refuses what is not text
        if not d.get("id"):
            d["id"] = new_id(_ID_PREFIX[d["type"]])
        out.append(d)
    return out


def _parts(content: str | list[ContentPart], role: str, where: str) -> list[dict[str, Any]]:
    kind = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        parts = [{"type": kind, "text": content}]
    else:
        _text(content, f"{where}.content")
        parts = [p.model_dump(exclude_none=True) for p in content]
    if role == "assistant":
        parts = [{**p, "annotations": []} for p in parts]
    return parts


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    out = []
    for j, p in enumerate(content):
        kind = p.type if isinstance(p, ContentPart) else p.get("type")
        if kind not in TEXT_PART_TYPES:
            raise unsupported(f"{where}[{j}]: content of type {kind!r} is not supported: this server's models read "
                              "text only (input_text / output_text)", f"{where}[{j}].type")
        out.append(p.text if isinstance(p, ContentPart) else p.get("text", ""))
    return "".join(out)


def chat_messages(instructions: str | None, history: list[dict[str, Any]], new: list[dict[str, Any]],
                  continued: str | None) -> list[dict[str, Any]]:
    """The conversation as chat messages: `history` (the stored chain's items, from response
    `continued`) then `new` (the request's input). A call must be answered by an output item
    with its call_id before the next message or call group, and an output must answer one."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    pending: dict[str, str] = {}  # call id -> where the call is, for calls not yet answered
    answered: set[str] = set()

    def where(k: int) -> str:
        return f"input[{k - len(history)}]" if k >= len(history) else f"the output of response {continued!r}"

    def unanswered(k: int) -> APIError:
        cid, at = next(iter(pending.items()))
        before = f" before {where(k)}" if k < len(history) + len(new) else ""
        return APIError(400, f"no tool output found for the call {cid!r} ({at}): send a function_call_output (or "
                             f"custom_tool_call_output) item with that call_id{before}",
                        param=where(k) if k < len(history) + len(new) else "input")

    for k, item in enumerate((*history, *new)):
        t = item["type"]
        if t == "reasoning":
            continue
        if t in OUTPUT_TYPES:
            cid = item["call_id"]
            if cid not in pending:
                why = "it was answered already" if cid in answered else "no call before it has that call_id"
                raise APIError(400, f"{where(k)}: {t} with call_id {cid!r} answers no call: {why}",
                               param=f"{where(k)}.call_id")
            del pending[cid]
            answered.add(cid)
            messages.append({"role": "tool", "tool_call_id": cid, "content": _text(item["output"], where(k))})
            continue
        if t in CALL_TYPES:
            cid = item["call_id"]
            if cid in pending or cid in answered:
                raise APIError(400, f"{where(k)}: the call_id {cid!r} is used twice", param=f"{where(k)}.call_id")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not pending.keys() - _ids(last):
                target = last  # the same assistant turn: its text, then its calls
            elif pending:
                raise unanswered(k)
            else:
                target = {"role": "assistant", "content": None}
                messages.append(target)
            args = item["arguments"] if t == "function_call" else json.dumps({"input": item["input"]},
                                                                             ensure_ascii=False)
            target.setdefault("tool_calls", []).append(
                {"id": cid, "type": "function", "function": {"name": item["name"], "arguments": args}})
            pending[cid] = where(k)
            continue
        if pending:
            raise unanswered(k)
        messages.append({"role": item["role"], "content": _text(item["content"], f"{where(k)}.content")})
    if pending:
        raise unanswered(len(history) + len(new))
    return messages


def _ids(message: dict[str, Any]) -> set[str]:
    return {c["id"] for c in message.get("tool_calls") or ()}


# --- the chat request -------------------------------------------------------------------


def chat_request(req: ResponsesRequest, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                 tool_choice: Any) -> ChatCompletionRequest:
    body: dict[str, Any] = {"messages": messages}
    if tools:
        body["tools"] = tools
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    for name in ("parallel_tool_calls", "temperature", "top_p", "ignore_eos"):
        value = getattr(req, name)
        if value is not None:
            body[name] = value
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = {"name": fmt.name, "schema": fmt.schema_}
        schema.update({k: v for k, v in (("description", fmt.description), ("strict", fmt.strict)) if v is not None})
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # only what the Responses models let through and chat's do not
        first = e.errors(include_url=False)[0]
        raise APIError(400, f"the request cannot be run as a chat ({param_of(first['loc'])}): {first['msg']}",
                       param="input") from None


def droppable_starts(messages: list[dict[str, Any]]) -> list[int]:
    """Where the conversation may start when truncation drops its oldest turns: at a user
    message after the leading system/developer messages (never between a call and its output)."""
    head = 0
    while head < len(messages) and messages[head]["role"] in ("system", "developer"):
        head += 1
    return [k for k in range(head + 1, len(messages)) if messages[k]["role"] == "user"]


def without_turns(messages: list[dict[str, Any]], start: int) -> list[dict[str, Any]]:
    head = 0
    while head < len(messages) and messages[head]["role"] in ("system", "developer"):
        head += 1
    return messages[:head] + messages[start:]

