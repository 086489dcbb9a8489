"""The rules of a request body that no JSON Schema can state, for the
fuzzer's generator (fuzz_api.py): schemathesis draws a body valid by
the OpenAPI document, and `consistent()` makes it keep these rules too, as
the document's descriptions state them and the server enforces them (OpenAI
and Anthropic refuse the same):

- tool names are unique within a request, and a tool_choice that names a tool
  names a declared one (of the kind it says, on the Responses API);
- chat: an assistant message with `tool_calls` (ids unique in it) is followed
  by one tool message per call, and every tool message answers one of those;
- Messages: a user message answers each `tool_use` of the assistant message
  right before it with a `tool_result`, and holds no other tool_result; a
  conversation that ends with the assistant's text is a prefill, and a
  prefill cannot be combined with `output_config.format`;
- Responses: each function_call / custom_tool_call item (call_id unique in the
  conversation) is answered by an output item with its call_id before the
  next message or call group, and each output answers such a call;
- the prompt fits the model's context (`PromptBudget`), and so does the
  prompt with its output cap.

A generated body is mended, not thrown away, where an edit keeps it valid by
the document (an id changed to the one a call has, a result added for an
unanswered call, a call added for an orphan result); only a body too long
for the context is filtered out. Negative cases are never touched: their
point is to break the document."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# the output caps the server refuses beyond the context's room (Messages' max_tokens is cut to it instead)
CAPS = {"/v1/chat/completions": ("max_tokens", "max_completion_tokens"), "/v1/completions": ("max_tokens",),
        "/v1/responses": ("max_output_tokens",)}
# the fields a prompt is made of (the server ignores unknown fields, which the document allows: they cost nothing)
RENDERED = ("messages", "tools", "system", "prompt", "input", "instructions")
# the fields of the objects inside them (messages, content blocks and parts, calls, items, tools), of every API
KNOWN = frozenset(("role", "content", "name", "tool_calls", "tool_call_id", "id", "type", "function", "arguments",
                   "text", "input", "tool_use_id", "is_error", "call_id", "output", "namespace", "description",
                   "parameters", "input_schema", "strict", "tools", "format", "syntax", "definition"))
WHOLE = frozenset(("parameters", "input_schema", "input"))  # rendered as they are, whatever they hold
CUSTOM_TOOL_TOKENS = 256  # a custom tool is rendered as a function with a one-string parameter schema


@dataclass(frozen=True)
class PromptBudget:
    """An upper bound on a body's prompt in tokens: `fixed` + the JSON bytes of what the body `shown()`
    holds (as json.dumps writes them, which is how schemathesis sends them) + CUSTOM_TOOL_TOKENS per custom
    tool. It holds because a token is at least one byte of text (byte-level BPE, SentencePiece with byte fallback), every string and
    structure of the body is rendered at most as long as its JSON (escapes only lengthen the JSON; a
    message's or call's JSON is longer than the template's markers around it), and `fixed` is measured on
    the server: the tokens of the smallest prompt with one tool (the template's fixed text, the tools
    preamble); `context` is the model's (max_model_len)."""

    context: int
    fixed: int

    def bound(self, path: str, body: dict[str, Any]) -> int:
        customs = sum(1 for t in _flat_tools(body.get("tools")) if t.get("type") == "custom") \
            if path == "/v1/responses" else 0
        return self.fixed + len(json.dumps(shown(body)).encode()) + CUSTOM_TOOL_TOKENS * customs

    def fits(self, path: str, body: dict[str, Any]) -> bool:
        """Whether the prompt surely fits with room for one output token, its caps cut to the room left."""
        room = self.context - self.bound(path, body)
        if room < 1:
            return False
        for cap in CAPS.get(path, ()):
            if isinstance(body.get(cap), (int, float)) and not isinstance(body.get(cap), bool) and body[cap] > room:
                body[cap] = room
        return self.context - self.bound(path, body) >= 1  # a shorter cap never lengthens the body


def shown(value: Any, key: str | None = None) -> Any:
    """What of a body can reach the prompt: its RENDERED fields, and in them the fields the API's objects
    have (the server drops the others, which the document allows, before rendering); a tool's parameter
    schema or a call's input is rendered whole."""
    if key is None:
        return {k: shown(v, "") for k, v in value.items() if k in RENDERED}
    if key in WHOLE:
        return value
    if isinstance(value, list):
        return [shown(v, "") for v in value]
    if isinstance(value, dict):
        return {k: shown(v, k) for k, v in value.items() if k in KNOWN}
    return value


def consistent(path: str, body: Any, budget: PromptBudget | None = None) -> Any | None:
    """`body` (drawn valid by the document for POST `path`) mended to keep the rules above, in place;
    None when its prompt would not fit `budget`."""
    if not isinstance(body, dict):
        return body
    fix = _FIXES.get(path)
    if fix is not None:
        fix(body)
    if budget is not None and path in _PROMPTED and not budget.fits(path, body):
        return None
    return body


def register(schema: Any, budget: PromptBudget | None = None) -> Counter:
    """Hooks on a schemathesis schema: each positive case's body is mended by `consistent()`
    (map_case), and one whose prompt would not fit `budget` is not sent (flatmap_case: no case).
    Negative cases pass untouched. The counts (mended, too long) are returned and kept up to date."""
    from hypothesis import strategies as st

    counts: Counter = Counter()
    verdicts: dict[int, bool] = {}  # id(case) -> fits, from map_case to flatmap_case

    def positive(case: Any) -> bool:
        meta = getattr(case, "meta", None)
        return (meta is not None and meta.generation.mode.is_positive and case.operation.method.upper() == "POST"
                and isinstance(case.body, dict))

    @schema.hook("map_case")
    def mend(ctx: Any, case: Any) -> Any:
        if positive(case):
            before = json.dumps(case.body, sort_keys=True)
            fixed = consistent(case.operation.path, case.body, budget)
            verdicts[id(case)] = fixed is not None
            if fixed is None:
                counts["too long"] += 1
            else:
                case.body = fixed
                counts["mended"] += json.dumps(fixed, sort_keys=True) != before
        return case

    @schema.hook("flatmap_case")
    def too_long(ctx: Any, case: Any) -> Any:
        return st.just(case) if verdicts.pop(id(case), True) else st.nothing()

    return counts


# --- ids -------------------------------------------------------------------------------


class _Ids:
    """Fresh ids for the request: none equal to one it already holds."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self.used, self.n = prefix, set(), 0

    def fresh(self) -> str:
        while True:
            self.n += 1
            new = f"{self.prefix}{self.n}"
            if new not in self.used:
                self.used.add(new)
                return new

    def note(self, *held: Any) -> None:
        """Ids the request holds (other fields' values, which extra properties may make anything, skipped)."""
        self.used.update(x for x in held if isinstance(x, str))

    def unique(self, wanted: str, taken: set[str]) -> str:
        """`wanted` if `taken` does not hold it, else a fresh id."""
        self.used.add(wanted)
        return wanted if wanted not in taken else self.fresh()


# --- tools ----------------------------------------------------------------------------


def _flat_tools(tools: Any) -> list[dict[str, Any]]:
    """The declared tools, a Responses namespace's own tools in its place."""
    out = []
    for t in tools or ():
        if isinstance(t, dict) and t.get("type") == "namespace":
            out.extend(x for x in t.get("tools") or () if isinstance(x, dict))
        elif isinstance(t, dict):
            out.append(t)
    return out


def _unique_names(tools: list[dict[str, Any]], name_of: Callable[[dict], str],
                  rename: Callable[[dict, str], None]) -> list[str]:
    """Tools declared twice under one name get a name of their own; the names, in order."""
    seen: list[str] = []
    for t in tools:
        name = name_of(t)
        if name in seen:
            k = 2
            while f"{name[:240]}_{k}" in seen:
                k += 1
            name = f"{name[:240]}_{k}"
            rename(t, name)
        seen.append(name)
    return seen


# --- chat ------------------------------------------------------------------------------


def _chat(body: dict[str, Any]) -> None:
    tools = [t for t in body.get("tools") or () if isinstance(t, dict)]
    names = _unique_names(tools, lambda t: t["function"]["name"], lambda t, n: t["function"].__setitem__("name", n))
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("function", {}).get("name") not in names:
        if names:
            choice["function"]["name"] = names[0]
        else:
            body.pop("tool_choice")
    messages = body.get("messages")
    if isinstance(messages, list):
        body["messages"] = _chat_messages(messages, names[0] if names else "f")


def _chat_messages(messages: list[dict[str, Any]], tool: str) -> list[dict[str, Any]]:
    ids = _Ids("call_")
    for m in messages:
        # a message the schema gives no tool_calls may carry one as an extra property: any value
        calls = m.get("tool_calls")
        ids.note(*(c.get("id") for c in calls if isinstance(c, dict)) if isinstance(calls, list) else ())
        if m.get("role") == "tool":
            ids.note(m.get("tool_call_id"))
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # calls of the last assistant message not yet answered

    def answer_all() -> None:
        out.extend({"role": "tool", "content": "", "tool_call_id": cid} for cid in pending)
        pending.clear()

    for m in messages:
        if m.get("role") == "tool":
            if pending:
                if m.get("tool_call_id") not in pending:
                    m["tool_call_id"] = pending[0]
                pending.remove(m["tool_call_id"])
            elif out and out[-1].get("role") in ("tool", "assistant"):
                # a result beyond the calls: its call joins the last assistant message's
                caller = next(x for x in reversed(out) if x.get("role") == "assistant")
                calls = caller["tool_calls"] = caller.get("tool_calls") or []
                if any(c["id"] == m["tool_call_id"] for c in calls):
                    m["tool_call_id"] = ids.fresh()
                calls.append(_chat_call(m["tool_call_id"], tool))
            else:
                out.append({"role": "assistant", "tool_calls": [_chat_call(m["tool_call_id"], tool)]})
            out.append(m)
            continue
        answer_all()
        if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list) and m["tool_calls"]:
            seen: set[str] = set()
            for call in m["tool_calls"]:
                call["id"] = ids.unique(call["id"], seen)
                seen.add(call["id"])
            pending[:] = [c["id"] for c in m["tool_calls"]]
        out.append(m)
    answer_all()
    return out


def _chat_call(cid: str, tool: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": tool, "arguments": "{}"}}


# --- Anthropic's Messages ------------------------------------------------------------------


def _messages(body: dict[str, Any]) -> None:
    tools = [t for t in body.get("tools") or () if isinstance(t, dict)]
    names = _unique_names(tools, lambda t: t["name"], lambda t, n: t.__setitem__("name", n))
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "tool" and choice.get("name") not in names:
        if names:
            choice["name"] = names[0]
        else:
            body.pop("tool_choice")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return
    tool = names[0] if names else "f"
    ids = _Ids("toolu_")
    for m in messages:
        for b in _blocks(m):
            ids.note(b.get("id") if b.get("type") == "tool_use" else
                     b.get("tool_use_id") if b.get("type") == "tool_result" else None)
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("role") == "assistant":
            if out and out[-1].get("role") == "assistant" and _uses(out[-1]):
                out.append({"role": "user", "content": [_result(u) for u in _uses(out[-1])]})
            seen: set[str] = set()
            for b in _blocks(m):
                if b.get("type") == "tool_use":
                    b["id"] = ids.unique(b["id"], seen)
                    seen.add(b["id"])
            out.append(m)
            continue
        prev = out[-1] if out and out[-1].get("role") == "assistant" else None
        uses = _uses(prev) if prev is not None else []
        results = [b for b in _blocks(m) if b.get("type") == "tool_result"]
        open_ = [u for u in uses]
        orphans = []
        for r in results:
            if r.get("tool_use_id") in open_:
                open_.remove(r["tool_use_id"])
            else:
                orphans.append(r)
        for r in orphans:
            if open_:
                r["tool_use_id"] = open_.pop(0)
                continue
            if prev is None:
                prev = {"role": "assistant", "content": []}
                out.append(prev)
            if isinstance(prev["content"], str):
                prev["content"] = [{"type": "text", "text": prev["content"]}] if prev["content"] else []
            r["tool_use_id"] = ids.fresh() if r["tool_use_id"] in uses else r["tool_use_id"]
            prev["content"].append({"type": "tool_use", "id": r["tool_use_id"], "name": tool, "input": {}})
            uses.append(r["tool_use_id"])
        if open_:
            if isinstance(m["content"], str):
                m["content"] = [{"type": "text", "text": m["content"]}]
            m["content"] = [_result(u) for u in open_] + m["content"]
        out.append(m)
    if out[-1].get("role") == "assistant" and (_uses(out[-1]) or (body.get("output_config") or {}).get("format")):
        # a prefill is text, and one with a JSON format cannot be decoded: the user speaks last
        out.append({"role": "user", "content": [_result(u) for u in _uses(out[-1])] or "go on"})
    body["messages"] = out


def _blocks(m: dict[str, Any]) -> list[dict[str, Any]]:
    content = m.get("content")
    return [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []


def _uses(m: dict[str, Any]) -> list[str]:
    return [b["id"] for b in _blocks(m) if b.get("type") == "tool_use"]


def _result(use_id: str) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": use_id, "content": ""}


# --- OpenAI's Responses ---------------------------------------------------------------------

_CALLS = {"function_call": "function_call_output", "custom_tool_call": "custom_tool_call_output"}
_OUTPUTS = {v: k for k, v in _CALLS.items()}


def _responses(body: dict[str, Any]) -> None:
    tools = [t for t in _flat_tools(body.get("tools")) if "name" in t]
    names = _unique_names(tools, lambda t: t["name"], lambda t, n: t.__setitem__("name", n))
    kinds = {t["name"]: t.get("type") for t in tools}
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        if choice.get("name") not in kinds and names:
            choice["name"] = names[0]
        if choice.get("name") in kinds:
            choice["type"] = kinds[choice["name"]]
        else:
            body.pop("tool_choice")
    items = body.get("input")
    if isinstance(items, list):
        body["input"] = _items(items, names[0] if names else "f")


def _items(items: list[Any], tool: str) -> list[Any]:
    ids = _Ids("call_")
    for it in items:
        if isinstance(it, dict) and it.get("type") in (*_CALLS, *_OUTPUTS):
            ids.note(it.get("call_id"))
    out: list[Any] = []
    pending: dict[str, str] = {}  # call id -> its type, of the current call group
    answering = False  # an output of the group has come: a call now starts a new group
    called: set[str] = set()

    def answer_all() -> None:
        for cid, kind in pending.items():
            out.append({"type": _CALLS[kind], "call_id": cid, "output": ""})
        pending.clear()

    for it in items:
        t = it.get("type", "message") if isinstance(it, dict) else None
        if t in _CALLS:
            if answering:
                answer_all()
            answering = False
            it["call_id"] = ids.unique(it["call_id"], called)
            called.add(it["call_id"])
            pending[it["call_id"]] = t
        elif t in _OUTPUTS:
            if it["call_id"] in pending:
                pass
            elif pending:
                it["call_id"] = next(iter(pending))
            else:
                if it["call_id"] in called:
                    it["call_id"] = ids.fresh()
                called.add(it["call_id"])
                kind = _OUTPUTS[t]
                out.append({"type": kind, "call_id": it["call_id"], "name": tool,
                            **({"arguments": "{}"} if kind == "function_call" else {"input": ""})})
                pending[it["call_id"]] = kind
            del pending[it["call_id"]]
            answering = True
        elif t != "reasoning":
            answer_all()
            answering = False
        out.append(it)
    answer_all()
    return out


_FIXES: dict[str, Callable[[dict[str, Any]], None]] = {
    "/v1/chat/completions": _chat, "/v1/messages": _messages, "/v1/messages/count_tokens": _messages,
    "/v1/responses": _responses}
_PROMPTED = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses")
