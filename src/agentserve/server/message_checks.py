"""The rules of a chat request that span several fields, as OpenAI's API
enforces them: tool results answer calls, and tool names are unique; and one
of this server's own: a tool's parameter schema nests at most
MAX_SCHEMA_DEPTH levels.

A conversation that breaks them has no one right rendering: a tool result
that answers no call, or a call left without its result, would be shown to
the model as something the agent never did, and a tool declared twice under
one name makes the call the model writes ambiguous (and the constrained
grammar's branches indistinguishable). Pydantic checks each message alone
(protocol.py); these checks look at the sequence. The depth limit is there
because compiling a schema's grammar grows much faster than its depth (about
0.2 s at 64 levels, minutes at 900, under a lock other constrained requests
wait for), while real tools nest a few levels (OpenAI's strict mode allows 10)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentserve.server.input_checks import InputError
from agentserve.server.protocol import AssistantMessageIn, ChatCompletionRequest, ToolDef, ToolMessage


MAX_SCHEMA_DEPTH = 64  # nested objects and arrays in one tool's parameters


def check_tools(tools: Sequence[ToolDef] | None) -> None:
    seen: dict[str, int] = {}
    for i, t in enumerate(tools or ()):
        name = t.function.name
        if name in seen:
            raise InputError(f"tools[{i}]: the tool name {name!r} is already declared by tools[{seen[name]}]; "
                             "tool names must be unique", f"tools[{i}].function.name")
        seen[name] = i
        if json_depth(t.function.parameters) > MAX_SCHEMA_DEPTH:
            raise InputError(f"tools[{i}].function.parameters nests objects and arrays more than "
                             f"{MAX_SCHEMA_DEPTH} levels deep", f"tools[{i}].function.parameters")


def json_depth(value: Any) -> int:
    """How many levels of objects and arrays nest in a parsed JSON value (a scalar: 0, {}: 1)."""
    depth, level = 0, [value]
    while True:
        containers = [x for x in level if isinstance(x, (dict, list))]
        if not containers:
            return depth
        depth += 1
        level = [v for x in containers for v in (x.values() if isinstance(x, dict) else x)]


def check_tool_messages(messages: Sequence[object]) -> None:
    """Each assistant message with `tool_calls` is followed by one tool message
    per call (any order, nothing in between), and every tool message is one of those."""
    pending: dict[str, int] = {}  # call id -> the assistant message that made it, still unanswered
    caller: int | None = None  # the assistant message whose results are being read
    for i, m in enumerate(messages):
        if isinstance(m, ToolMessage):
            if caller is None:
                raise InputError(f"messages[{i}]: a message with role 'tool' must answer a call of the "
                                 "assistant message before it (one with 'tool_calls')", f"messages[{i}]")
            if m.tool_call_id not in pending:
                raise InputError(f"messages[{i}].tool_call_id: {m.tool_call_id!r} is not an unanswered call of "
                                 f"messages[{caller}]", f"messages[{i}].tool_call_id")
            del pending[m.tool_call_id]
            continue
        _unanswered(pending, caller)
        pending, caller = {}, None
        if isinstance(m, AssistantMessageIn) and m.tool_calls:
            for j, call in enumerate(m.tool_calls):
                if call.id in pending:
                    raise InputError(f"messages[{i}].tool_calls[{j}].id: {call.id!r} is used twice",
                                     f"messages[{i}].tool_calls[{j}].id")
                pending[call.id] = i
            caller = i
    _unanswered(pending, caller)


def _unanswered(pending: dict[str, int], caller: int | None) -> None:
    if pending:
        ids = ", ".join(repr(k) for k in pending)
        raise InputError(f"messages[{caller}]: an assistant message with 'tool_calls' must be followed by tool "
                         f"messages answering each call; no answer for {ids}", f"messages[{caller}].tool_calls")


def check_chat(req: ChatCompletionRequest) -> None:
    check_tools(req.tools)
    check_tool_messages(req.messages)
