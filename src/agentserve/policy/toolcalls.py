"""Tool-call detection in a finished LLM response.

The tool-call handler (CacheTTL paper, section 5.1) needs the *name* of the tool a response
calls: it keys the tool-duration statistics and hence the TTL.  This module recognises the
formats agents actually produce:

* ``openai``  -- a structured ``tool_calls`` list (Chat Completions dicts/objects with a nested
  ``function``, or flat Responses-API items that carry ``name`` directly);
* ``hermes``  -- Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, any
  number of them;
* ``llama3``  -- Llama 3.x JSON tool calls: the whole response (optionally after
  ``<|python_tag|>``) is ``{"name": ..., "parameters": {...}}``, a JSON list of such objects,
  or several of them separated by ``;``;
* ``bash``    -- mini-swe-agent: exactly one fenced ```` ```bash ```` (or ```` ```sh ````) block;
  the tool name is the first word of the command.

Design rules: pure Python, never raises (any input -> a list, possibly empty), never returns a
call without a non-empty string name, and prefers missing a call to inventing one (ordinary prose
and JSON without a string ``name`` give nothing).  Every scan is linear in the text length (JSON
is decoded with ``json.JSONDecoder.raw_decode`` from known offsets; no backtracking regexes over
the whole text).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["ToolCall", "parse_tool_calls", "first_tool_name", "FORMATS"]

FORMATS = ("openai", "hermes", "llama3", "bash")

# strict=False: models (and grammar-constrained decoding) write raw control characters
# such as tabs inside strings; refusing the whole call over them helps nobody
_DECODER = json.JSONDecoder(strict=False)
_WS = " \t\r\n"

_HERMES_OPEN = "<tool_call>"
_HERMES_CLOSE = "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
# Special tokens a detokenizer may leave at the end of a Llama-3 tool-call turn.
_LLAMA_END_TOKENS = ("<|eom_id|>", "<|eot_id|>", "<|end_of_text|>")
_SHELL_LANGS = frozenset({"bash", "sh"})


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call.

    ``arguments`` is a dict when the arguments were (or decoded to) a JSON object, else the raw
    string (e.g. a bash command, or OpenAI arguments that are not valid JSON).  ``format`` is one
    of :data:`FORMATS`.
    """

    name: str
    arguments: dict | str
    format: str


# --------------------------------------------------------------------------- helpers


def _clean_name(name: Any) -> str | None:
    if not isinstance(name, str):
        return None
    name = name.strip()
    return name or None


def _norm_args(args: Any) -> dict | str:
    """Arguments as a dict when possible, else a string; never raises."""
    if args is None:
        return {}
    if isinstance(args, dict):
        return args
    if isinstance(args, str):
        s = args.strip()
        if s.startswith("{"):
            try:
                val = json.loads(s, strict=False)
            except (ValueError, RecursionError):
                return args
            if isinstance(val, dict):
                return val
        return args
    try:
        return json.dumps(args)
    except (TypeError, ValueError, RecursionError):
        return str(args)


def _call_from_obj(obj: Any, fmt: str) -> ToolCall | None:
    """``{"name": str, "arguments"|"parameters": ...}`` -> ToolCall, else None."""
    if not isinstance(obj, dict):
        return None
    name = _clean_name(obj.get("name"))
    if name is None:
        return None
    if "arguments" in obj:
        args = obj["arguments"]
    else:
        args = obj.get("parameters")
    return ToolCall(name, _norm_args(args), fmt)


def _get(item: Any, key: str) -> Any:
    """``item[key]`` for a mapping, ``item.key`` for an object, None when absent."""
    if isinstance(item, dict):
        return item.get(key)
    return getattr(item, key, None)


# --------------------------------------------------------------------------- openai


def _parse_openai(tool_calls: Any) -> list[ToolCall]:
    out: list[ToolCall] = []
    try:
        items = list(tool_calls)
    except Exception:
        return out
    for item in items:
        try:
            fn = _get(item, "function")
            # Chat Completions nests the call under "function"; Responses-API items
            # ({"type": "function_call", "name": ..., "arguments": ...}) are flat.
            src = fn if fn is not None else item
            name = _clean_name(_get(src, "name"))
            if name is None:
                continue
            out.append(ToolCall(name, _norm_args(_get(src, "arguments")), "openai"))
        except Exception:  # a hostile object (raising property, ...) is skipped
            continue
    return out


# --------------------------------------------------------------------------- hermes


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


def _parse_hermes(text: str) -> list[ToolCall]:
    out: list[ToolCall] = []
    n = len(text)
    pos = text.find(_HERMES_OPEN)
    while pos != -1:
        start = _skip_ws(text, pos + len(_HERMES_OPEN))
        nxt = pos + len(_HERMES_OPEN)
        try:
            obj, end = _DECODER.raw_decode(text, start)
        except (ValueError, RecursionError):
            obj, end = None, -1
        if end != -1:
            nxt = end
            after = _skip_ws(text, end)
            closed = text.startswith(_HERMES_CLOSE, after)
            # An unclosed tag is accepted only when it is the very end of the response and
            # the JSON decoded completely (a truncated object never decodes).
            if closed or after == n:
                call = _call_from_obj(obj, "hermes")
                if call is not None:
                    out.append(call)
                nxt = after + len(_HERMES_CLOSE) if closed else n
        # Resume after the decoded JSON (so a "<tool_call>" inside a JSON string is never
        # mistaken for a new tag) or, on failure, just after this opening tag.
        pos = text.find(_HERMES_OPEN, nxt)
    return out


# --------------------------------------------------------------------------- llama 3


def _parse_llama3(text: str) -> list[ToolCall]:
    s = text.strip()
    if s.startswith(_PYTHON_TAG):
        s = s[len(_PYTHON_TAG):].lstrip()
    changed = True
    while changed:
        changed = False
        for tok in _LLAMA_END_TOKENS:
            if s.endswith(tok):
                s = s[: -len(tok)].rstrip()
                changed = True
    if not s or s[0] not in "{[":
        return []
    if s[0] == "[":
        try:
            val = json.loads(s, strict=False)
        except (ValueError, RecursionError):
            return []
        if not isinstance(val, list) or not val:
            return []
        calls = [_call_from_obj(v, "llama3") for v in val]
        # All or nothing: a JSON list that is not entirely tool calls is data, not calls.
        return [] if any(c is None for c in calls) else calls  # type: ignore[misc]
    # One object, or several separated by ';' (decoded sequentially, so ';' inside strings
    # is harmless).
    out: list[ToolCall] = []
    i, n = 0, len(s)
    while True:
        try:
            obj, end = _DECODER.raw_decode(s, i)
        except (ValueError, RecursionError):
            return []
        call = _call_from_obj(obj, "llama3")
        if call is None:
            return []
        out.append(call)
        i = _skip_ws(s, end)
        if i == n:
            return out
        if s[i] != ";":
            return []
        i = _skip_ws(s, i + 1)
        if i == n:  # trailing ';'
            return out


# --------------------------------------------------------------------------- bash


def _shell_blocks(text: str) -> list[str]:
    """Bodies of complete ```bash / ```sh fenced blocks, in order (linear scan).

    Fences are paired sequentially; blocks in other languages are skipped but still consume
    their closing fence.  An unclosed block (truncated response) is not counted.
    """
    blocks: list[str] = []
    n = len(text)
    pos = text.find("```")
    while pos != -1:
        eol = text.find("\n", pos + 3)
        if eol == -1:
            break  # a fence opener with no body line: nothing complete after it
        info = text[pos + 3:eol]
        if "`" in info:
            # Inline code such as "use ```bash``` blocks": not a fence opener.
            pos = text.find("```", pos + 3)
            continue
        close = text.find("```", eol + 1)
        if close == -1:
            break
        words = info.split()
        if words and words[0].lower() in _SHELL_LANGS:
            blocks.append(text[eol + 1:close])
        pos = text.find("```", min(close + 3, n))
    return blocks


def _is_env_assignment(word: str) -> bool:
    name, eq, _ = word.partition("=")
    return bool(eq) and bool(name) and (name[0].isalpha() or name[0] == "_") and all(
        c.isalnum() or c == "_" for c in name
    )


def _command_name(command: str) -> str | None:
    """First word of a shell command.

    Choices: blank lines and ``#`` comment lines before the command are skipped, and leading
    ``VAR=value`` environment assignments are skipped (``PYTHONPATH=. python t.py`` -> ``python``)
    so one program groups with its plain invocations; a line made only of assignments keeps the
    first assignment as the name.  Everything else is literally the first word, as in the
    reference implementation: ``cd /testbed && pytest`` -> ``cd``.
    """
    for line in command.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        words = line.split()
        for w in words:
            if not _is_env_assignment(w):
                return w
        return words[0]
    return None


def _parse_bash(text: str) -> list[ToolCall]:
    blocks = _shell_blocks(text)
    if len(blocks) != 1:  # 0 or >= 2 blocks: mini-swe-agent treats it as a format error
        return []
    name = _command_name(blocks[0])
    if not name:
        return []
    return [ToolCall(name, blocks[0].strip(), "bash")]


# --------------------------------------------------------------------------- public API


def parse_tool_calls(text: str | None, tool_calls: list | None = None) -> list[ToolCall]:
    """Tool calls in a finished response; ``[]`` when it calls no tool.

    ``tool_calls`` (an OpenAI-style list) wins when it yields at least one valid call; when it
    is empty, or none of its entries has a usable name, the text is parsed instead.  Text
    formats are tried in order hermes, llama3, bash; the first that finds a call wins.
    Never raises.
    """
    try:
        if tool_calls:
            calls = _parse_openai(tool_calls)
            if calls:
                return calls
        if not isinstance(text, str) or not text:
            return []
        if _HERMES_OPEN in text:
            calls = _parse_hermes(text)
            if calls:
                return calls
        calls = _parse_llama3(text)
        if calls:
            return calls
        if "```" in text:
            return _parse_bash(text)
        return []
    except Exception:  # defensive: a parser bug must never take the scheduler down
        return []


def first_tool_name(text: str | None, tool_calls: list | None = None) -> str | None:
    """Name of the first tool call in the response, or None."""
    calls = parse_tool_calls(text, tool_calls)
    return calls[0].name if calls else None
