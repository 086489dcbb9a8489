"""Which program a request belongs to, the client's retention hints, and the
request's prefix-cache salt.

The scheduler keeps KV and orders work by *program* (docs/architecture.md, "Request
identity"), so the server has to name the program of every request. Clients
differ in how they say it; the first of these that is present wins:

| # | source | sent by |
|---|---|---|
| 1 | body `program_id` | agentserve's own field |
| 2 | header `X-Program-Id` | agentserve's own header |
| 3 | the Responses-API chain (`previous_response_id`): the program of the response it continues (recorded on each stored response); a stored response that continues none, and that nothing else in this table names, is the program named by its own id | OpenAI Agents SDK, Codex |
| 4 | body `prompt_cache_key` | OpenAI's cache-scope field (Codex sets it to its conversation) |
| 5 | header `x-claude-code-session-id`, with `x-claude-code-agent-id` for a subagent (`session/agent`) | Claude Code |
| 6 | header `session-id` / `session_id`, then `conversation-id` / `conversation_id` | Codex CLI |
| 7 | body `metadata.user_id` | Anthropic's Messages API (Claude Code puts its session in it) |
| 8 | body `session_id`, then header `X-Session-Id` | vLLM's names |
| 9 | the agent-hint spellings of other engines (below) | Continuum, vLLM's RFC, SGLang |
| 10 | body `user` | OpenAI's end-user field |

agentserve's own spellings come first because a client that sends them means
exactly that; the protocols' own identities come next because an unmodified
agent sends them without being asked.

Without any, the request is its own program: it ends when the request ends,
so nothing is pinned for a follow-up that cannot be recognised (its blocks
still stay in the prefix cache for whoever sends the same prefix).

Hints, all optional: a TTL in seconds (body `ttl`, header `X-Program-TTL`, or
Anthropic's `cache_control.ttl` on a block, "5m" or "1h", the largest given) that
overrides the policy's learned TTL where the policy honours hints; an explicit
release after this turn (body `release_program: true`, header
`X-Program-Release`); and the end of the program (body `end_program: true`,
header `X-Program-End`), after which its pin is dropped and its job completion
time recorded. Body fields win over headers, and ours over the spellings below.
A request that names no program has no hints: a TTL or release sent with it is
ignored (the request ends its own program).

Other engines' spellings, accepted so that their clients need no change:

| field | from | means here |
|---|---|---|
| `job_id` | Continuum (its vLLM fork) | program id |
| `is_last_step: true` | Continuum | end of the program after this turn |
| `agent_hint.session_id` | vLLM's agent-hint RFC (vllm#52113) | program id |
| `agent_hint.cache_control.ttl` | vLLM's agent-hint RFC | TTL, seconds |
| `agent_hints.workflow_id`, `.agent_id` | SGLang's agent hints (sglang#24656) | program id `workflow/agent` |
| `agent_hints.cache_ttl_ms` | SGLang's agent hints | TTL, milliseconds |

(SGLang's: either id alone when only one is sent.) Their other fields (vLLM's
`context_management` edits, SGLang's step ids, `expected_tool_duration_ms` and
`reuse_hint`) are ignored.

With several tenants (tenants.py) a program id is scoped by its tenant
(`tenant/id` in the engine), so a client can neither reach nor detect another
tenant's programs, and the tenant salts the prefix cache together with the
body's `cache_salt` (vLLM's name): requests share prefix-cache hits only when
both are equal."""

from __future__ import annotations

import math
import re
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

MAX_ID_LENGTH = 256
MAX_SALT_LENGTH = 256
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
# the header hints' exact forms, as the OpenAPI document states them (an HTTP parser strips a value's
# spaces and tabs; a client library may not): a flag is one of _TRUE / _FALSE in any case, a TTL a
# plain decimal number of seconds (no sign, exponent or underscores, which Python's float would take)
HEADER_FLAG_PATTERN = (r"^[ \t]*([Tt][Rr][Uu][Ee]|[Ff][Aa][Ll][Ss][Ee]|[Yy][Ee][Ss]|[Nn][Oo]|[Oo][Nn]|[Oo][Ff][Ff]|1|0)?"
                       r"[ \t]*$")
HEADER_SECONDS_PATTERN = r"^[ \t]*[0-9]+(\.[0-9]+)?[ \t]*$"
_SECONDS = re.compile(HEADER_SECONDS_PATTERN)


class IdentityError(ValueError):
    """A malformed identity field or hint; `param` names it for the 400 reply."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ProgramIdentity:
    program_id: str | None  # None: the request is its own program
    source: str  # where the id came from ("program_id", "X-Program-Id", ..., or "request")
    ttl: float | None = None
    release_after: bool = False
    end_program: bool = False
    cache_salt: Hashable = None  # the engine's prefix-cache salt: (tenant scope, body cache_salt), or None

    @property
    def explicit(self) -> bool:
        return self.program_id is not None

    @property
    def is_last_turn(self) -> bool:
        """An anonymous request is a one-turn program; an explicit one ends when told."""
        return self.end_program or not self.explicit


def resolve_identity(body: Any, headers: Mapping[str, str], scope: str | None = None, *,
                     chain: str | None = None, cache_ttl: float | None = None) -> ProgramIdentity:
    """`body` is a parsed request (attributes `program_id`, `session_id`, `user`,
    `ttl`, `release_program`, `end_program`, `cache_salt`, `prompt_cache_key`,
    `metadata` and the spellings of other engines); `headers` is
    case-insensitive. `scope`: the tenant that program ids and the cache salt
    are scoped by (None: not scoped). `chain`: the client's program id of the
    Responses chain the request continues (unscoped); `cache_ttl`: Anthropic's
    `cache_control.ttl` in seconds, a hint honoured only when a program is named
    (clients send cache_control on every request, named or not)."""
    vllm_hint = getattr(body, "agent_hint", None)
    sgl_hints = getattr(body, "agent_hints", None)
    pid, source = None, "request"
    for value, name in ((getattr(body, "program_id", None), "program_id"),
                        (headers.get("x-program-id"), "X-Program-Id"),
                        (chain, "previous_response_id"),
                        (getattr(body, "prompt_cache_key", None), "prompt_cache_key"),
                        (_claude_code_program(headers), "x-claude-code-session-id"),
                        (_first_header(headers, "session-id", "session_id"), "session-id"),
                        (_first_header(headers, "conversation-id", "conversation_id"), "conversation_id"),
                        (_metadata_user(body), "metadata.user_id"),
                        (getattr(body, "session_id", None), "session_id"),
                        (headers.get("x-session-id"), "X-Session-Id"),
                        (getattr(body, "job_id", None), "job_id"),
                        (getattr(vllm_hint, "session_id", None), "agent_hint.session_id"),
                        (_sglang_program(sgl_hints), "agent_hints"),
                        (getattr(body, "user", None), "user")):
        if value is None:
            continue
        value = value.strip()
        if not value:
            continue  # an empty id names nothing: fall through to the next source
        if len(value) > MAX_ID_LENGTH and name not in _COMPOSITE:  # (a composite's parts are checked alone)
            raise IdentityError(f"{name} is longer than {MAX_ID_LENGTH} characters", name)
        pid, source = value, name
        break

    ttl, ttl_param, raw_ttl = _ttl(body, headers, vllm_hint, sgl_hints)
    if ttl is None and cache_ttl is not None and pid is not None:
        ttl, ttl_param, raw_ttl = cache_ttl, "cache_control.ttl", cache_ttl
    if ttl is not None and (not math.isfinite(ttl) or ttl < 0):
        raise IdentityError(f"{ttl_param} must be a finite number >= 0, got {raw_ttl!r}", ttl_param)

    # the headers are parsed whether or not the body decides, so a malformed one is always refused
    release_header = _flag(headers, "x-program-release", "X-Program-Release")
    end_header = _flag(headers, "x-program-end", "X-Program-End")
    release = bool(getattr(body, "release_program", False)) or release_header
    end = bool(getattr(body, "end_program", False)) or end_header or bool(getattr(body, "is_last_step", False))
    if pid is None:
        # A request that names no program is a program of one turn, ended with it: nothing to keep or
        # release, so its retention hints are moot. Accepted, not refused: the rule spans the body and the
        # headers, which no OpenAPI schema can state, and a client may send its hints on every request.
        ttl, release = None, False
    salt = getattr(body, "cache_salt", None)
    if salt is not None and not 0 < len(salt) <= MAX_SALT_LENGTH:
        raise IdentityError(f"cache_salt must be a non-empty string of at most {MAX_SALT_LENGTH} characters",
                            "cache_salt")
    cache_salt = None if scope is None and salt is None else (scope, salt)
    return ProgramIdentity(scoped_program_id(scope, pid), source, ttl, release, end, cache_salt)


def scoped_program_id(scope: str | None, program_id: str | None) -> str | None:
    """The engine's id for a client's program id: prefixed by the tenant when scoped. Tenant
    names hold no '/' (tenants.py), so two tenants' ids never meet."""
    return program_id if scope is None or program_id is None else f"{scope}/{program_id}"


def _first_header(headers: Mapping[str, str], *names: str) -> str | None:
    return next((v for v in (headers.get(n) for n in names) if v is not None and v.strip()), None)


def _claude_code_program(headers: Mapping[str, str]) -> str | None:
    """Claude Code's session; a subagent (its own agent id) is a program of its own beside its parent's."""
    session = _first_header(headers, "x-claude-code-session-id")
    if session is None:
        return None
    agent = _first_header(headers, "x-claude-code-agent-id")
    _check_part(session, "x-claude-code-session-id")
    if agent is None:
        return session.strip()
    _check_part(agent, "x-claude-code-agent-id")
    return f"{session.strip()}/{agent.strip()}"


def _metadata_user(body: Any) -> str | None:
    meta = getattr(body, "metadata", None)
    value = meta.get("user_id") if isinstance(meta, Mapping) else getattr(meta, "user_id", None)
    return value if isinstance(value, str) else None


def _sglang_program(hints: Any) -> str | None:
    workflow, agent = getattr(hints, "workflow_id", None), getattr(hints, "agent_id", None)
    for part, name in ((workflow, "agent_hints.workflow_id"), (agent, "agent_hints.agent_id")):
        if part is not None:
            _check_part(part, name)
    parts = [p.strip() for p in (workflow, agent) if p is not None and p.strip()]
    return "/".join(parts) or None


# ids made of two parts (`session/agent`, `workflow/agent`): each part within MAX_ID_LENGTH, as the
# document states each field's limit, so the whole may be longer
_COMPOSITE = ("x-claude-code-session-id", "agent_hints")


def _check_part(value: str, name: str) -> None:
    if len(value.strip()) > MAX_ID_LENGTH:
        raise IdentityError(f"{name} is longer than {MAX_ID_LENGTH} characters", name)


def _ttl(body: Any, headers: Mapping[str, str], vllm_hint: Any, sgl_hints: Any) -> tuple[float | None, str, Any]:
    """The TTL hint in seconds (None: none), the name of the field it came from, and its value as sent."""
    raw = headers.get("x-program-ttl")
    if raw is not None and not _SECONDS.fullmatch(raw):  # a malformed header is refused even where unused
        raise IdentityError(f"X-Program-TTL must be a number of seconds (digits, and a fraction after a "
                            f"'.'), got {raw!r}", "X-Program-TTL")
    if getattr(body, "ttl", None) is not None:
        return body.ttl, "ttl", body.ttl
    if raw is not None:
        return float(raw), "X-Program-TTL", raw
    cache_control = getattr(vllm_hint, "cache_control", None)
    if getattr(cache_control, "ttl", None) is not None:
        return cache_control.ttl, "agent_hint.cache_control.ttl", cache_control.ttl
    ms = getattr(sgl_hints, "cache_ttl_ms", None)
    if ms is not None:
        return ms / 1000.0, "agent_hints.cache_ttl_ms", ms
    return None, "ttl", None


def _flag(headers: Mapping[str, str], key: str, name: str) -> bool:
    raw = headers.get(key)
    if raw is None:
        return False
    v = raw.strip(" \t").lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise IdentityError(f"{name} must be true or false, got {raw!r}", name)
