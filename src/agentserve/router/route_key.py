"""What a request is routed by: `RouteKey` (its program, the prefix-chain keys
of its prompt, a size estimate) and `route_key`, which builds one from an
OpenAI chat or completions body with the server's own identity rules.

Prefix-chain keys: the prompt's leading chunks (CHUNK_CHARS characters of
text, CHUNK_TOKENS tokens of a token-id prompt), each key a hash of the key
before it and its chunk, so key i stands for the whole prompt up to the end of
chunk i and two prompts share key i exactly when they share those chunks (up
to a hash collision, which only costs a worse route). Only whole chunks count:
a partial last chunk would be a key the conversation's next, longer request
never repeats. A request without a program id is routed by these keys: the
next request of the same conversation extends the same prompt, so it has the
same leading keys and lands where the last one went.

Chat messages are serialized one by one (JSON, sorted keys, after the tools),
so an earlier request's messages are a prefix of the next request's text."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

from agentserve.server.identity import resolve_identity

CHUNK_CHARS = 256  # characters of text a key covers (about 64 tokens at 4 characters a token)
CHUNK_TOKENS = 64  # tokens a key covers, for a prompt of token ids
MAX_KEYS = 64  # keys of the leading chunks: enough to tell conversations apart past a shared system prompt
CHARS_PER_TOKEN = 4  # the size estimate of text: English prose and code average about 4 characters a token

# The body fields the identity rules read, with the JSON types they must have
# (the server's pydantic models check these before resolve_identity; a router
# gets the raw body).
_STR, _NUM, _BOOL, _OBJ = (str,), (int, float), (bool,), (dict,)
_FIELDS = {
    ("program_id",): _STR, ("session_id",): _STR, ("job_id",): _STR, ("user",): _STR, ("cache_salt",): _STR,
    ("ttl",): _NUM, ("release_program",): _BOOL, ("end_program",): _BOOL, ("is_last_step",): _BOOL,
    ("agent_hint",): _OBJ, ("agent_hint", "session_id"): _STR, ("agent_hint", "cache_control"): _OBJ,
    ("agent_hint", "cache_control", "ttl"): _NUM, ("agent_hints",): _OBJ, ("agent_hints", "workflow_id"): _STR,
    ("agent_hints", "agent_id"): _STR, ("agent_hints", "cache_ttl_ms"): _NUM,
    ("prompt_cache_key",): _STR, ("metadata",): _OBJ, ("metadata", "user_id"): _STR,
}


@dataclass(frozen=True)
class RouteKey:
    program_id: str | None  # the engine's (tenant-scoped) program id; None: the request is its own program
    prefix_keys: tuple[str, ...]  # chained hashes of the prompt's leading chunks
    size_hint: int  # tokens the request will hold in KV: prompt estimate + max_tokens
    end_program: bool = False  # the client says this is the program's last turn


def route_key(body: dict, headers: Mapping[str, str], tenant: str | None = None) -> RouteKey:
    """The route key of a chat (`messages`) or completions (`prompt`) body.
    `headers` in any case; `tenant`: the tenant program ids and prefix keys are
    scoped by (None: none), as the engine scopes them. Raises ValueError
    (identity.IdentityError for a bad identity field or hint) for a body it
    cannot route."""
    if not isinstance(body, Mapping):
        raise ValueError(f"a request body is a JSON object, got {type(body).__name__}")
    _check_types(body)
    lowered = {str(k).lower(): v for k, v in headers.items()}
    ident = resolve_identity(_Fields(body), lowered, tenant)
    # The engine shares prefix-cache blocks only between requests of the same
    # salt (tenant and cache_salt), so the keys start from it.
    seed = repr(ident.cache_salt).encode()
    if "messages" in body:
        text = _chat_text(body)
        keys = text_prefix_keys(text, seed)
        prompt_tokens = -(-len(text) // CHARS_PER_TOKEN)
    elif "prompt" in body:
        prompt = _first_prompt(body["prompt"])
        if isinstance(prompt, str):
            keys = text_prefix_keys(prompt, seed)
            prompt_tokens = -(-len(prompt) // CHARS_PER_TOKEN)
        else:
            keys = token_prefix_keys(prompt, seed)
            prompt_tokens = len(prompt)
    else:
        raise ValueError("a request to route has 'messages' (chat) or 'prompt' (completions)")
    return RouteKey(ident.program_id, keys, prompt_tokens + _max_tokens(body), ident.end_program)


def text_prefix_keys(text: str, seed: bytes = b"") -> tuple[str, ...]:
    whole = min(len(text) // CHUNK_CHARS, MAX_KEYS)
    return chain_keys((text[i * CHUNK_CHARS:(i + 1) * CHUNK_CHARS].encode() for i in range(whole)), seed)


def token_prefix_keys(token_ids: Sequence[int], seed: bytes = b"") -> tuple[str, ...]:
    whole = min(len(token_ids) // CHUNK_TOKENS, MAX_KEYS)
    # decimal text: token ids are any ints (the simulator's reach past 64 bits)
    return chain_keys((",".join(map(str, token_ids[i * CHUNK_TOKENS:(i + 1) * CHUNK_TOKENS])).encode() + b";"
                       for i in range(whole)), seed)


def chain_keys(chunks: Iterable[bytes], seed: bytes = b"") -> tuple[str, ...]:
    """Key i = hash(key i-1, chunk i); the first chains from `seed`."""
    keys = []
    prev = blake2b(seed, digest_size=12).digest()
    for chunk in chunks:
        prev = blake2b(prev + chunk, digest_size=12).digest()
        keys.append(prev.hex())
    return tuple(keys)


class _Fields:
    """A JSON object read as attributes (what resolve_identity reads off a parsed
    body); a missing field is None."""

    def __init__(self, d: Mapping[str, Any]) -> None:
        self._d = d

    def __getattr__(self, name: str) -> Any:
        v = self._d.get(name)
        return _Fields(v) if isinstance(v, Mapping) else v


def _check_types(body: Mapping[str, Any]) -> None:
    for path, types in _FIELDS.items():
        v: Any = body
        for part in path:
            v = v.get(part) if isinstance(v, Mapping) else None
        if v is None:
            continue
        if not isinstance(v, types) or (types is _NUM and isinstance(v, bool)):
            want = {_STR: "a string", _NUM: "a number", _BOOL: "true or false", _OBJ: "an object"}[types]
            raise ValueError(f"{'.'.join(path)} must be {want}, got {v!r}")


def _chat_text(body: Mapping[str, Any]) -> str:
    messages = body["messages"]
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise ValueError("messages must be a list of objects")
    parts = [] if body.get("tools") is None else [body["tools"]]
    try:
        return "".join(json.dumps(p, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n"
                       for p in parts + messages)
    except (TypeError, ValueError) as e:
        raise ValueError(f"messages are not JSON: {e}") from None


def _first_prompt(prompt: Any) -> str | list[int]:
    """A completions prompt: text, token ids, or a batch of either (routed by its first)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise ValueError("prompt must be a string, a list of token ids, or a non-empty list of those")


def _max_tokens(body: Mapping[str, Any]) -> int:
    for name in ("max_completion_tokens", "max_tokens"):
        v = body.get(name)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
            return v
    return 0
