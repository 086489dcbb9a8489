"""Checks on a request's raw input that its pydantic types cannot make: every
string in the body is valid Unicode text, every id within MAX_ID_LENGTH
wherever it comes from (headers, path), and a pydantic error turned into an
OpenAI-style parameter name.

JSON may spell a lone UTF-16 surrogate (`"\\ud800"`), which Python decodes
into a str that cannot be encoded as UTF-8: the tokenizer, the chat template
and even the 404 reply that repeats the model name would fail on it, far from
the field that held it. So the whole body is walked once, right after
parsing, and the first such string is named in a 400."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from agentserve.server.identity import MAX_ID_LENGTH

_SURROGATE = re.compile("[\ud800-\udfff]")
ID_HEADERS = ("X-Program-Id", "X-Session-Id", "x-claude-code-session-id", "x-claude-code-agent-id")


class InputError(ValueError):
    """Input that must be refused; `param` names where it is."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def invalid_text_at(obj: Any) -> str | None:
    """Where in a parsed JSON value the first string (key or value) with a lone
    surrogate is (`messages[0].content`), or None when every string is valid."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        value, at = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and _SURROGATE.search(value):
                return at or "body"
        elif isinstance(value, dict):
            for k, v in reversed(value.items()):
                where = f"{at}.{k}" if at else str(k)
                if not k.isascii() and _SURROGATE.search(k):
                    return where
                stack.append((v, where))
        elif isinstance(value, list):
            stack.extend((v, f"{at}[{i}]") for i, v in reversed(list(enumerate(value))))
    return None


def check_text(obj: Any) -> None:
    at = invalid_text_at(obj)
    if at is not None:
        at = _SURROGATE.sub("\ufffd", at)  # a key may hold the surrogate: the reply must be writable
        raise InputError(f"{at}: the string is not valid Unicode text (it holds a lone UTF-16 surrogate such "
                         "as \\ud800, which has no UTF-8 encoding)", at)


def check_id(value: str, name: str) -> None:
    if len(value) > MAX_ID_LENGTH:
        raise InputError(f"{name} is longer than {MAX_ID_LENGTH} characters", name)


def check_id_headers(headers: Mapping[str, str]) -> None:
    """Every id header, not only the one that names the program, is within the limit."""
    for name in ID_HEADERS:
        value = headers.get(name.lower())
        if value is not None:
            check_id(value, name)


# An id in a path (percent-decoded, so `a%2Fb` is `a/b`): no control characters (C0, DEL, C1), and one
# character at least that is not a space. Spelled out rather than with \s, so that Python's re and the
# OpenAPI document's (ECMA-262) regexes read it alike.
_CONTROL = r"\x00-\x1f\x7f-\x9f"
_SPACES = r" \u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
PATH_ID_PATTERN = rf"^[^{_CONTROL}]*[^{_CONTROL}{_SPACES}][^{_CONTROL}]*$"
_PATH_ID = re.compile(PATH_ID_PATTERN)


def check_path_id(value: str, name: str = "program_id") -> None:
    if not value.strip():
        raise InputError(f"{name} must not be empty", name)
    if not _PATH_ID.fullmatch(value):
        raise InputError(f"{name} must hold a character other than a space, and no control characters", name)
    check_id(value, name)


# --- pydantic's errors, told as OpenAI tells them ---------------------------------

_ROLE_TAGS = {"system", "developer", "user", "assistant", "tool"}
_TYPE_LABELS = {"str", "int", "float", "bool", "none", "dict", "list"}


def param_of(loc: tuple[Any, ...]) -> str:
    """`messages[1].tool_call_id` for pydantic's ("messages", 1, "tool", "tool_call_id"):
    the labels pydantic adds for the branches of a union (a message's role, a
    type name) are no part of the client's body, so they are left out."""
    out = ""
    prev: Any = None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_label(part, prev):
            out += f".{part}" if out else str(part)
        prev = part
    return out


def _is_label(part: str, prev: Any) -> bool:
    if isinstance(prev, int) and part in _ROLE_TAGS:
        return True
    return part in _TYPE_LABELS or part[:1].isupper() or any(c in part for c in "[]'-")


def error_text(msg: str) -> str:
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix):]
    return msg
