"""The prompt-deterministic response cache (stateful-inference-tool-calling.txt,
section 3.5), opt-in with `agentserve serve --response-cache N`.

Agents repeat requests exactly: retries, polling, idempotent fan-out across
sub-agents. With the cache on, a request whose exact prompt token ids,
sampling parameters, API key, cache salt and model match a stored response gets that
response back without reaching the engine; a streamed request gets the
original's chunks again, one for one.

So that a repeat is *the same answer* even after the entry was evicted, a
request that carries no `seed` is sampled with a seed derived from its prompt
ids: identical prompts give identical outputs at any temperature. That changes
sampling semantics (two identical unseeded requests at temperature 1 no longer
differ), which is why the cache is off by default. A client that wants a fresh
sample sends a `seed` of its own, or `Cache-Control: no-cache` (or `no-store`),
which bypasses the cache for that request: no lookup, no derived seed, nothing
stored.

Only outputs that finished (stop or length) are stored, never an aborted one
or one cut short by an engine error or a client that went away. A key is a
digest; a hit also compares the stored prompt length and ids and the
parameters in full, so a digest collision is a miss, not a wrong answer."""

from __future__ import annotations

import hashlib
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from agentserve.engine.llm_engine import RequestOutput
from agentserve.engine.sampling_params import SamplingParams

Stream = Any  # a RequestStream, or one of the wrappers below: async-iterable RequestOutputs with close()


@dataclass(frozen=True)
class ResponseCacheStats:
    hits: int = 0  # requests answered from the cache
    misses: int = 0  # requests looked up and not found (they went to the engine)
    stores: int = 0  # finished outputs stored
    bypassed: int = 0  # requests that skipped the cache (Cache-Control, a constraint without a key)
    entries: int = 0


@dataclass(frozen=True)
class CachedResponse:
    prompt: array  # 'i': the exact prompt ids (the collision guard)
    signature: str  # everything else the key covers, in full
    pieces: tuple[tuple[tuple[int, ...], str], ...]  # (new_token_ids, new_text) of each output, in order
    finish_reason: str
    stop_reason: str | int | None


def signature(params: SamplingParams, tenant: str | None, model: str, variant: str = "",
              salt: Hashable = None) -> str | None:
    """What besides the prompt decides the output; None if the request cannot be keyed
    (a constraint that does not say what it constrains to). `variant`: whatever else
    of the request the output depends on (a chat request's tool choice). `salt`: the
    request's prefix-cache salt, which scopes its answers as it scopes its prefix hits."""
    constraint = params.constraint
    ckey = None if constraint is None else getattr(constraint, "key", None)
    if constraint is not None and not isinstance(ckey, str):
        return None
    # a streaming tool-call validator acts as the server's flags and the request's tool choice (the
    # variant) say; one that depends on more names it in a `cache_key` string
    validator = getattr(params, "tool_validator", None)
    vkey = None if validator is None else getattr(validator, "cache_key", type(validator).__qualname__)
    tenant_digest = None if tenant is None else hashlib.blake2b(tenant.encode(), digest_size=16).hexdigest()
    salt_digest = None if salt is None else hashlib.blake2b(repr(salt).encode(), digest_size=16).hexdigest()
    return repr((model, tenant_digest, salt_digest, params.max_tokens, params.temperature, params.top_p, params.top_k,
                 params.seed, tuple(params.stop), tuple(params.stop_token_ids), params.ignore_eos, ckey, vkey, variant))


def prompt_seed(ids: list[int] | array) -> int:
    """A 63-bit sampling seed from the prompt ids alone (so a longer max_tokens
    continues the same sample)."""
    data = (ids if isinstance(ids, array) else array("i", ids)).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=b"agentserve-seed").digest(), "little") >> 1


def bypassed(headers: Mapping[str, str]) -> bool:
    """`Cache-Control: no-cache` or `no-store` on the request."""
    value = headers.get("cache-control", "")
    return any(d.strip().split("=")[0].lower() in ("no-cache", "no-store") for d in value.split(","))


class ResponseCache:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a response cache needs at least one entry")
        self.capacity = capacity
        self._entries: OrderedDict[bytes, CachedResponse] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = self._misses = self._stores = self._bypassed = 0

    def stats(self) -> ResponseCacheStats:
        with self._lock:
            return ResponseCacheStats(self._hits, self._misses, self._stores, self._bypassed, len(self._entries))

    @staticmethod
    def key(prompt: array, sig: str) -> bytes:
        h = hashlib.blake2b(prompt.tobytes(), digest_size=20, person=b"agentserve-resp")
        h.update(sig.encode())
        return h.digest()

    def get(self, key: bytes, prompt: array, sig: str) -> CachedResponse | None:
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and (len(hit.prompt) != len(prompt) or hit.signature != sig or hit.prompt != prompt):
                hit = None  # a digest collision
            if hit is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return hit

    def put(self, key: bytes, entry: CachedResponse) -> None:
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            self._stores += 1
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def count_bypass(self) -> None:
        with self._lock:
            self._bypassed += 1

    async def open(self, ids: list[int], params: SamplingParams, *, request_id: str, model: str,
                   headers: Mapping[str, str], submit: Callable[[SamplingParams], Awaitable[Stream]],
                   on_hit: Callable[[], Awaitable[None]] | None = None, variant: str = "",
                   salt: Hashable = None) -> Stream:
        """The request's output stream: a replay of the stored response on a hit
        (after `on_hit()`), else `submit(params)`'s engine stream - seeded from
        the prompt when the request has no seed - recorded for the cache."""
        sig = None if bypassed(headers) else signature(params, headers.get("authorization"), model, variant, salt)
        if sig is None:
            self.count_bypass()
            return await submit(params)
        prompt = array("i", ids)
        key = self.key(prompt, sig)
        hit = self.get(key, prompt, sig)
        if hit is not None:
            if on_hit is not None:
                await on_hit()
            return ReplayStream(hit, request_id, len(ids))
        if params.seed is None:
            params = replace(params, seed=prompt_seed(prompt))
        return RecordingStream(await submit(params), self, key, prompt, sig, params)


async def hit_hints(engine: Any, ident: Any) -> None:
    """A hit still honours the request's program hints (an AsyncEngine, a ProgramIdentity):
    `end_program` ends the program, `release_program` drops its pin."""
    if ident.program_id is None:
        return
    try:
        if ident.end_program:
            await engine.end_program(ident.program_id)
        elif ident.release_after:
            await engine.release_program(ident.program_id)
    except RuntimeError:  # EngineStopped: nothing left to release
        pass


class ReplayStream:
    """A stored response as the RequestOutputs of its original stream (prompt tokens all cached)."""

    def __init__(self, entry: CachedResponse, request_id: str, num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self._entry = entry
        self._num_prompt = num_prompt_tokens
        self._i = 0
        self._ids: list[int] = []
        self._text = ""
        self._now = time.monotonic()
        self.finished = False

    def __aiter__(self) -> ReplayStream:
        return self

    async def __anext__(self) -> RequestOutput:
        pieces = self._entry.pieces
        if self.finished or self._i >= len(pieces):
            raise StopAsyncIteration
        new_ids, new_text = pieces[self._i]
        self._i += 1
        self._ids += new_ids
        self._text += new_text
        last = self._i == len(pieces)
        self.finished = last
        now = self._now
        return RequestOutput(
            request_id=self.request_id, program_id="", new_token_ids=list(new_ids), new_text=new_text,
            token_ids=list(self._ids) if last else [], text=self._text if last else "", finished=last,
            finish_reason=self._entry.finish_reason if last else None,
            stop_reason=self._entry.stop_reason if last else None, num_prompt_tokens=self._num_prompt,
            num_cached_tokens=self._num_prompt, arrival_time=now, first_token_time=now, finish_time=now if last
            else None, queue_time=0.0)

    def close(self) -> None:
        self.finished = True


class RecordingStream:
    """An engine stream, passed through; once it finishes (stop or length) its pieces are stored.
    Not when the request's tool-call validator stopped it at an undeclared call: the client's
    reply then goes on past this stream (a re-generation), so this stream is not the answer."""

    def __init__(self, inner: Stream, cache: ResponseCache, key: bytes, prompt: array, sig: str,
                 params: SamplingParams | None = None) -> None:
        self.inner = inner
        self.request_id = inner.request_id
        self._cache, self._key, self._prompt, self._sig = cache, key, prompt, sig
        self._validator = getattr(params, "tool_validator", None)
        self._pieces: list[tuple[tuple[int, ...], str]] = []

    @property
    def finished(self) -> bool:
        return self.inner.finished

    def __aiter__(self) -> RecordingStream:
        return self

    async def __anext__(self) -> RequestOutput:
        out = await self.inner.__anext__()
        self._pieces.append((tuple(out.new_token_ids), out.new_text))
        if (out.finished and out.finish_reason in ("stop", "length")
                and getattr(self._validator, "stop_reason", None) != "undeclared"):
            self._cache.put(self._key, CachedResponse(self._prompt, self._sig, tuple(self._pieces),
                                                      out.finish_reason, out.stop_reason))
        return out

    def close(self) -> None:
        self.inner.close()
