"""`agentserve bench run`: replay an agent workload against any OpenAI-compatible
server and measure job completion time (JCT), TTFT and prefix hits.

    agentserve serve --port 8011 &
    agentserve bench run --url http://127.0.0.1:8011 --workload swebench --programs 8 --rate 0.5 \\
        --token-scale 0.02 --time-scale 0.2 --json run.json --report run.md --plot run

What a program does (one asyncio task per program; programs start at the
workload's Poisson arrival times, the first at once):

* turn 0 sends [system, user]: the system prompt is the workload's shared
  prefix (`shared_prefix_tokens`), the same text for every program; the user
  message is the rest of call 0's prompt (the task).
* every turn is one streamed POST /v1/chat/completions with header
  `X-Program-Id`, temperature 0, `max_tokens` = the trace's output tokens
  (scaled, >= 1), `ignore_eos` (vLLM's name; servers that do not know it ignore
  it; `--no-ignore-eos` leaves it out) and `stream_options.include_usage`; the
  last turn adds `end_program: true`. TTFT = first non-empty content (or tool
  call) delta; latency = last byte of the stream.
* the model's ACTUAL output is appended as the assistant message, the client
  sleeps the call's `tool_duration` x `--time-scale`, then appends a tool-result
  message of `prompt_k - prompt_{k-1} - output_{k-1}` tokens (scaled; for a
  pure-append trace that is `new_tokens`) and sends the next turn. A tool result
  is a `user` message by default (mini-swe-agent's format, accepted by every
  server); `--tool-role tool` sends the assistant message with a synthetic tool
  call and a `tool` message answering it instead. When a trace's prompt
  shrinks (a compaction) the conversation restarts as [system, user] of the new
  prompt's length. A trace that rewrote part of its prompt (new_tokens larger
  than the growth) is replayed as a pure append of the same length.
* SWE-smith programs (Program.messages with message_index) send their real
  system/user/tool text, each message cut to `--token-scale` of its characters;
  assistant messages are still the model's own output.
* a subagent (Program.parent_id in the run) starts at its own arrival but not
  before its parent's spawning turn (parent_turn) has answered.

Text of a given token length is deterministic filler (seeded common words;
the seed is fresh per run unless `--text-seed` is given, so a second run
against the same server does not hit the first run's cached text).
Its tokens per word and the template's tokens per message are calibrated once
per run with three non-streamed probes (usage.prompt_tokens), unless
`--tokens-per-word` is given. Lengths are targets, so a turn's measured
prompt_tokens is close to, not equal to, the scaled trace.

`--max-context` (default: the server's `max_model_len` from /v1/models, if it
reports one): a program whose scaled prompt + output would not fit (with a 3%
margin) has its own tokens (task, outputs, tool results; not the shared system
prompt) multiplied by one more factor < 1 so it fits, keeping its turn count and
prefix structure (`clamp` in its result); at run time max_tokens is also capped
to the room left.

Per program: JCT = first request sent -> last response received (tool time
included). Per turn: TTFT, latency, prompt/cached/completion tokens. A request
that fails (HTTP error, error event, connection error, or `--request-timeout`
seconds in total) is recorded with its error and ends its program (counted in
`failed` / `errors`); the run goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from agentserve.workload.trace import Program, percentile

SUMMARY_KEYS = ("server", "workload", "rate", "programs", "mean_jct", "p50_jct", "p90_jct", "p95_jct",
                "mean_ttft", "throughput_jobs_s", "cached_ratio")


class ReplayError(Exception):
    """A failed request (its message goes into the results)."""


async def stream_chat(client, body: dict, pid: str, acc, now):
    """POST a streamed chat request for program `pid` and feed each SSE line to
    `acc` (with `now()`); an HTTP error becomes a ReplayError with the
    server's message. Returns `acc`."""
    async with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Program-Id": pid}) as r:
        if r.status_code >= 400:
            detail = (await r.aread()).decode("utf-8", "replace")
            try:
                detail = json.loads(detail)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            raise ReplayError(f"HTTP {r.status_code}: {str(detail)[:300]}")
        async for line in r.aiter_lines():
            acc.feed(line, now())
    return acc


# ---------------------------------------------------------------------------
# filler text and its calibration

WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not which one but all "
    "were when there can more if will each about how up out them then she many some so these would other into "
    "has her two like him see time could no make than first been its who now people my made over did down only "
    "way find use may water long little very after words called just where most know get through back much go "
    "good new write our me man too any day same right look think also around another came come work three word "
    "must because does part even place well such here take why things help put years different away again off "
    "went old number great tell men say small every found still between name should home big give air line set "
    "own under read last never us left end along while might next sound below saw something thought both few "
    "those always looked show large often together asked house world going want school important until form food "
    "keep children feet land side without boy once animals life enough took sometimes four head above kind began "
    "almost live page got earth need far hand high year mother light parts country father let night following "
    "picture being study second eyes soon times story boys since white days ever paper hard near sentence better "
    "best across during today others however sure means knew its try told young miles sun ways thing whole hear "
    "example heard several change answer room sea against top turned learn point city play toward five using "
    "himself usually file function return value test error module class import string list table index field "
    "server request program result output input config parser method object default option branch commit patch"
).split()


def filler_text(n_words: int, seed: str) -> str:
    """`n_words` (>= 1) seeded common words, a line break every 16 words."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(max(1, n_words))]
    return "\n".join(" ".join(words[i:i + 16]) for i in range(0, len(words), 16))


@dataclass(frozen=True)
class TextModel:
    """How many tokens filler text and chat messages take on the target server."""

    tokens_per_word: float
    message_overhead: float = 4.0  # template tokens a message adds beyond its content

    def words_for(self, tokens: float) -> int:
        """Words of filler for a message of `tokens` tokens, template included (>= 1)."""
        return max(1, round((tokens - self.message_overhead) / self.tokens_per_word))

    def text(self, tokens: float, seed: str) -> str:
        return filler_text(self.words_for(tokens), seed)


# probe sizes (words): base/more use W_A, longer W_B
W_A, W_SYS = 16, 8


def probe_messages(w_b: int) -> dict[str, list[dict]]:
    """The three calibration prompts: base = [system X, user Y_a]; longer = the
    user message of w_b words; more = base + [assistant Y_a, user Y_a]."""
    sys_text = filler_text(W_SYS, "calibrate:system")
    y_a = filler_text(W_A, "calibrate:user")
    y_b = filler_text(w_b, "calibrate:user")  # same seed: Y_a's words are Y_b's first words
    base = [{"role": "system", "content": sys_text}, {"role": "user", "content": y_a}]
    return {
        "base": base,
        "longer": [base[0], {"role": "user", "content": y_b}],
        "more": base + [{"role": "assistant", "content": y_a}, {"role": "user", "content": y_a}],
    }


def fit_text_model(counts: dict[str, int], w_b: int) -> TextModel:
    """TextModel from the probes' prompt token counts:
    tokens/word = (longer - base) / (w_b - W_A); overhead = ((more - base) - 2 W_A tpw) / 2."""
    tpw = (counts["longer"] - counts["base"]) / (w_b - W_A)
    if not tpw > 0:
        raise ReplayError(f"calibration failed: prompt tokens did not grow with the text ({counts}); "
                          "pass --tokens-per-word")
    overhead = ((counts["more"] - counts["base"]) - 2 * W_A * tpw) / 2
    return TextModel(tpw, max(0.0, overhead))


def probe_words(max_context: int | None) -> int:
    """w_b: 112 words, fewer for a small context (the longer probe stays well inside it)."""
    if max_context is None:
        return 112
    return max(W_A + 16, min(112, max_context // 10))


async def calibrate(count_prompt: Callable[[list[dict]], Awaitable[int]],
                    max_context: int | None = None) -> TextModel:
    """Measure the TextModel with `count_prompt` (messages -> prompt tokens)."""
    w_b = probe_words(max_context)
    counts = {name: int(await count_prompt(msgs)) for name, msgs in probe_messages(w_b).items()}
    return fit_text_model(counts, w_b)


# ---------------------------------------------------------------------------
# plans: what each turn sends


@dataclass
class TurnPlan:
    turn: int
    append: list[dict]  # messages added before this turn's request (turn 0 / reset: the whole list)
    reset: bool  # the conversation restarts with `append` (turn 0 or a compaction)
    planned_prompt_tokens: int  # the scaled trace prompt (a target)
    max_tokens: int
    sleep_s: float  # tool time after this turn's response (scaled); 0 on the last turn
    tool_name: str | None
    tool_call_ids: list[str] = field(default_factory=list)  # --tool-role tool: calls the next turn answers


@dataclass
class ProgramPlan:
    program_id: str
    arrival: float  # seconds after the run's start
    turns: list[TurnPlan]
    parent_id: str | None = None
    parent_turn: int | None = None
    clamp: float = 1.0  # extra token factor applied to fit --max-context (1: none)


@dataclass
class _Targets:
    system: int  # scaled shared prefix (not clamped)
    task: float
    outputs: list[float]
    steps: list[tuple[str, float]]  # per turn k >= 1: ("append", tool tokens) or ("reset", prompt - system)


def _targets(p: Program, scale: float) -> _Targets:
    calls = p.calls
    shared = min(calls[0].shared_prefix_tokens, calls[0].prompt_tokens)
    steps: list[tuple[str, float]] = []
    for prev, c in zip(calls, calls[1:]):
        delta = c.prompt_tokens - prev.prompt_tokens - prev.output_tokens
        if delta >= 0:
            steps.append(("append", delta * scale))
        else:
            steps.append(("reset", max(0, c.prompt_tokens - shared) * scale))
    return _Targets(round(shared * scale), (calls[0].prompt_tokens - shared) * scale,
                    [c.output_tokens * scale for c in calls], steps)


def _contexts(t: _Targets, f: float, overhead: float) -> list[tuple[int, int]]:
    """(planned prompt, max_tokens) per turn with the program factor f. A
    message's target includes its template tokens (a message takes at least
    overhead + 1); an assistant message adds its output + overhead; the
    generation prompt ~3 tokens."""
    def msg(n: float) -> float:
        return max(round(n), overhead + 1)

    out = []
    gen = 3
    ctx = (msg(t.system) if t.system else 0) + msg(max(1, round(t.task * f)))
    for k, o in enumerate(t.outputs):
        if k > 0:
            kind, n = t.steps[k - 1]
            if kind == "append":
                ctx += msg(max(1, round(n * f)))
            else:
                ctx = (msg(t.system) if t.system else 0) + msg(max(1, round(n * f)))
        out.append((round(ctx + gen), max(1, round(o * f))))
        ctx += out[-1][1] + overhead  # the assistant message joins the next prompt
    return out


def fit_factor(t: _Targets, max_context: int | None, overhead: float) -> float:
    """1.0, or the largest factor (steps of 3%) that makes every turn's prompt +
    output fit in max_context minus a 3% margin. Raises ReplayError when even
    the shared system prompt plus one-token messages do not fit."""
    if max_context is None:
        return 1.0
    room = max_context - max(8, math.ceil(0.03 * max_context))
    f = 1.0
    for _ in range(400):
        if max(p + o for p, o in _contexts(t, f, overhead)) <= room:
            return f
        f *= 0.97
    raise ReplayError(f"a program cannot fit --max-context {max_context}: the shared system prompt alone takes "
                      f"{t.system} tokens; lower --token-scale")


def _sanitize_tool(name: str | None) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", name or "tool")[:64] or "tool"


def _cut(text: str, s: float) -> str:
    if not text:
        return text
    return text[:max(1, round(len(text) * s))]


def _real_text_turns(p: Program) -> bool:
    return bool(p.messages) and all(c.message_index is not None for c in p.calls)


def plan_program(p: Program, tm: TextModel, *, token_scale: float = 1.0, time_scale: float = 1.0,
                 max_context: int | None = None, seed: int | str = 0, tool_role: str = "user",
                 arrival: float | None = None) -> ProgramPlan:
    """The messages and lengths program `p` sends (see the module doc)."""
    from agentserve.workload.swe_smith import message_text

    t = _targets(p, token_scale)
    f = fit_factor(t, max_context, tm.message_overhead)
    sizes = _contexts(t, f, tm.message_overhead)
    system_msg = ({"role": "system", "content": tm.text(t.system, f"{seed}:system")} if t.system else None)
    pid = p.program_id
    real = _real_text_turns(p)
    turns: list[TurnPlan] = []
    prev_ids: list[str] = []
    for k, c in enumerate(p.calls):
        last = k == len(p.calls) - 1
        ids: list[str] = []
        if real:
            lo = 0 if k == 0 else p.calls[k - 1].message_index + 1
            append = []
            n_tool = 0
            for i, m in enumerate(p.messages[lo:c.message_index]):
                role = m.get("role", "user")
                s = token_scale if (k == 0 and i == 0 and role == "system") else token_scale * f
                text = _cut(message_text(m) if role != "assistant" else (m.get("content") or ""), s)
                if role in ("system", "user", "assistant"):
                    append.append({"role": role, "content": text})
                else:  # a tool result
                    append.append(_tool_message(text, prev_ids, n_tool, tool_role))
                    n_tool += 1
            reset = k == 0
            if not last and tool_role == "tool":
                nxt = p.calls[k + 1].message_index
                n_tool = sum(1 for m in p.messages[c.message_index + 1:nxt] if m.get("role") == "tool")
                ids = [f"call_{k}_{j}" for j in range(n_tool)]
        elif k == 0:
            append = ([system_msg] if system_msg else []) + [
                {"role": "user", "content": tm.text(max(1, round(t.task * f)), f"{seed}:{pid}:task")}]
            reset = True
        else:
            kind, n = t.steps[k - 1]
            n = max(1, round(n * f))
            if kind == "append":
                append = [_tool_message(tm.text(n, f"{seed}:{pid}:{k}"), prev_ids, 0, tool_role)]
                reset = False
            else:
                append = ([system_msg] if system_msg else []) + [
                    {"role": "user", "content": tm.text(n, f"{seed}:{pid}:{k}:compacted")}]
                reset = True
        if not real and not last and tool_role == "tool":
            nxt_kind = t.steps[k][0]
            ids = [f"call_{k}_0"] if nxt_kind == "append" else []
        turns.append(TurnPlan(
            turn=k, append=append, reset=reset, planned_prompt_tokens=sizes[k][0], max_tokens=sizes[k][1],
            sleep_s=0.0 if last else max(0.0, c.tool_duration) * time_scale,
            tool_name=c.tool_name, tool_call_ids=ids,
        ))
        prev_ids = ids
    return ProgramPlan(pid, p.arrival if arrival is None else arrival, turns, p.parent_id, p.parent_turn, f)


def _tool_message(text: str, call_ids: list[str], i: int, tool_role: str) -> dict:
    if tool_role == "tool" and i < len(call_ids):
        return {"role": "tool", "tool_call_id": call_ids[i], "content": text}
    return {"role": "user", "content": text}


def plan_workload(programs: list[Program], tm: TextModel, *, token_scale: float = 1.0, time_scale: float = 1.0,
                  max_context: int | None = None, seed: int | str = 0,
                  tool_role: str = "user") -> list[ProgramPlan]:
    """Plans for every program; arrivals shifted so the first program starts at 0."""
    if not programs:
        return []
    t0 = min(p.arrival for p in programs)
    return [plan_program(p, tm, token_scale=token_scale, time_scale=time_scale, max_context=max_context,
                         seed=seed, tool_role=tool_role, arrival=p.arrival - t0) for p in programs]


# ---------------------------------------------------------------------------
# streaming


class StreamAccumulator:
    """Folds an OpenAI chat-completions or completions SSE stream: first-token
    time, the time of every chunk that carried tokens, text, usage.

    feed(line, now) takes one line of the stream; an `{"error": ...}` event
    raises ReplayError. (The same parsing turn_ttft.py does.) A chat chunk
    carries tokens when its delta has content or tool calls; a
    /v1/completions chunk (`text` instead of `delta`) does even with empty text
    (a token that ends inside a UTF-8 character), except an empty one with the
    finish reason after others (llama-cpp-python ends with one)."""

    def __init__(self, t_send: float) -> None:
        self.t_send = t_send
        self.t_first: float | None = None
        self.token_times: list[float] = []  # one per chunk that carried tokens
        self.parts: list[str] = []
        self.usage: dict = {}
        self.done = False
        self.finish_reason: str | None = None

    def feed(self, line: str, now: float) -> None:
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if not data:
            return
        if data == "[DONE]":
            self.done = True
            return
        chunk = json.loads(data)
        if chunk.get("error"):
            err = chunk["error"]
            raise ReplayError(f"error event: {err.get('message', err) if isinstance(err, dict) else err}")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for ch in chunk.get("choices") or ():
            if "delta" in ch or "text" not in ch:  # chat completions
                delta = ch.get("delta") or {}
                piece = delta.get("content")
                tokens = bool(piece or delta.get("tool_calls"))
            else:  # completions
                piece = ch.get("text")
                tokens = bool(piece) or not ch.get("finish_reason") or not self.token_times
            if tokens:
                if self.t_first is None:
                    self.t_first = now
                self.token_times.append(now)
            if piece:
                self.parts.append(piece)
            if ch.get("finish_reason"):
                self.finish_reason = ch["finish_reason"]

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def prompt_tokens(self) -> int:
        return int(self.usage.get("prompt_tokens") or 0)

    @property
    def completion_tokens(self) -> int:
        return int(self.usage.get("completion_tokens") or 0)

    @property
    def cached_tokens(self) -> int:
        return int((self.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


# ---------------------------------------------------------------------------
# the replay


@dataclass
class ReplayConfig:
    url: str
    model: str | None = None
    api_key: str | None = None
    workload: str = "custom"
    rate: float = float("nan")
    seed: int = 0
    text_seed: str | None = None  # seed of the filler text; None: a fresh one per run (starts cold)
    token_scale: float = 1.0
    time_scale: float = 1.0
    max_context: int | None = None  # None: the server's max_model_len, if reported
    tokens_per_word: float | None = None  # None: calibrate
    request_timeout: float = 600.0
    ignore_eos: bool = True
    tool_role: str = "user"
    label: str | None = None
    progress: bool = True


def base_url(url: str) -> str:
    u = url.strip().rstrip("/")
    return u[:-3] if u.endswith("/v1") else u


class _Progress:
    """tqdm over turns when installed and wanted, else a throttled counter line on stderr."""

    def __init__(self, total_turns: int, programs: int, enabled: bool) -> None:
        self.total, self.programs, self.enabled = total_turns, programs, enabled
        self.turns = self.done = self.errors = 0
        self.bar = None
        self._last = 0.0
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total_turns, unit="turn", desc="replay", file=sys.stderr, leave=True,
                                mininterval=0.5)
            except ImportError:
                self.bar = None

    def update(self, turns: int = 0, program_done: bool = False, error: bool = False) -> None:
        self.turns += turns
        self.done += program_done
        self.errors += error
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(programs=f"{self.done}/{self.programs}", errors=self.errors, refresh=False)
            self.bar.update(turns)
            return
        now = time.monotonic()
        if now - self._last >= 0.5 or self.done == self.programs:
            self._last = now
            print(f"\rreplay: turns {self.turns}/{self.total}  programs {self.done}/{self.programs}  "
                  f"errors {self.errors}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        else:
            print(file=sys.stderr)


class Replayer:
    def __init__(self, cfg: ReplayConfig, client, model: str, max_context: int | None) -> None:
        self.cfg, self.client, self.model, self.max_context = cfg, client, model, max_context
        self.t0 = 0.0
        self.turns: list[dict] = []
        self.results: list[dict] = []
        self.events: dict[str, list[asyncio.Event]] = {}
        self.progress: _Progress | None = None
        self.overhead = 4.0  # template tokens a message adds (set from the TextModel)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def count_prompt(self, messages: list[dict]) -> int:
        body = {"model": self.model, "messages": messages, "max_tokens": 1, "temperature": 0, "stream": False,
                "end_program": True}
        r = await self.client.post("/v1/chat/completions", json=body,
                                   headers={"X-Program-Id": f"replay-probe-{uuid.uuid4().hex[:8]}"})
        if r.status_code >= 400:
            raise ReplayError(f"calibration probe: HTTP {r.status_code}: {r.text[:300]}")
        n = (r.json().get("usage") or {}).get("prompt_tokens")
        if not n:
            raise ReplayError("calibration probe: the server reports no usage.prompt_tokens; pass --tokens-per-word")
        return int(n)

    async def _stream(self, messages: list[dict], pid: str, max_tokens: int, end: bool,
                      t_send: float) -> StreamAccumulator:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        if self.cfg.ignore_eos:
            body["ignore_eos"] = True
        if end:
            body["end_program"] = True
        return await stream_chat(self.client, body, pid, StreamAccumulator(t_send), self.now)

    async def turn(self, messages: list[dict], pid: str, max_tokens: int, end: bool,
                   t_send: float) -> StreamAccumulator:
        import httpx

        try:
            return await asyncio.wait_for(self._stream(messages, pid, max_tokens, end, t_send),
                                          self.cfg.request_timeout)
        except asyncio.TimeoutError:
            raise ReplayError(f"timeout after {self.cfg.request_timeout:g} s") from None
        except httpx.HTTPError as e:
            raise ReplayError(f"{type(e).__name__}: {e}") from None
        except json.JSONDecodeError as e:
            raise ReplayError(f"bad stream event: {e}") from None

    async def run_program(self, plan: ProgramPlan) -> None:
        delay = plan.arrival - self.now()
        if delay > 0:
            await asyncio.sleep(delay)
        if plan.parent_id in self.events and plan.parent_turn is not None:
            evs = self.events[plan.parent_id]
            if 0 <= plan.parent_turn < len(evs):
                await evs[plan.parent_turn].wait()
        pid = plan.program_id
        res = {"program_id": pid, "arrival": plan.arrival, "start": None, "end": None, "jct": None,
               "turns": len(plan.turns), "turns_done": 0, "completed": False, "error": None,
               "tool_time": 0.0, "llm_time": 0.0, "clamp": plan.clamp, "parent_id": plan.parent_id}
        messages: list[dict] = []
        est = 0  # estimated prompt tokens of `messages`
        try:
            for tp in plan.turns:
                if tp.reset:
                    messages = list(tp.append)
                    est = tp.planned_prompt_tokens
                else:
                    messages.extend(tp.append)
                    prev = plan.turns[tp.turn - 1]
                    est += max(0, round(tp.planned_prompt_tokens - prev.planned_prompt_tokens - prev.max_tokens
                                        - self.overhead))
                max_tokens = tp.max_tokens
                if self.max_context is not None and est + max_tokens > self.max_context:
                    max_tokens = max(1, self.max_context - est)
                last = tp.turn == len(plan.turns) - 1
                rec = {"program_id": pid, "turn": tp.turn, "t_send": self.now(), "t_first": None, "t_end": None,
                       "ttft": None, "latency": None, "prompt_tokens": 0, "cached_tokens": 0,
                       "completion_tokens": 0, "planned_prompt_tokens": tp.planned_prompt_tokens,
                       "max_tokens": max_tokens, "sleep_s": tp.sleep_s, "tool_name": tp.tool_name,
                       "end_program": last, "error": None}
                if res["start"] is None:
                    res["start"] = rec["t_send"]
                try:
                    acc = await self.turn(messages, pid, max_tokens, last, rec["t_send"])
                except ReplayError as e:
                    rec["t_end"] = self.now()
                    rec["latency"] = rec["t_end"] - rec["t_send"]
                    rec["error"] = str(e)
                    self.turns.append(rec)
                    res["error"] = f"turn {tp.turn}: {e}"
                    self.progress.update(turns=len(plan.turns) - tp.turn, program_done=True, error=True)
                    await self._end_quietly(pid)
                    return
                t_end = self.now()
                rec.update(t_first=acc.t_first if acc.t_first is not None else t_end,
                           t_end=t_end, prompt_tokens=acc.prompt_tokens, cached_tokens=acc.cached_tokens,
                           completion_tokens=acc.completion_tokens)
                rec["ttft"] = rec["t_first"] - rec["t_send"]
                rec["latency"] = t_end - rec["t_send"]
                self.turns.append(rec)
                res["turns_done"] += 1
                res["llm_time"] += rec["latency"]
                res["end"] = t_end
                if acc.prompt_tokens:
                    est = acc.prompt_tokens
                est += round((acc.completion_tokens or max_tokens) + self.overhead)
                assistant: dict[str, Any] = {"role": "assistant", "content": acc.text}
                if tp.tool_call_ids:
                    name = _sanitize_tool(tp.tool_name)
                    assistant["tool_calls"] = [{"id": i, "type": "function",
                                                "function": {"name": name, "arguments": "{}"}}
                                               for i in tp.tool_call_ids]
                messages.append(assistant)
                self.events[pid][tp.turn].set()
                self.progress.update(turns=1, program_done=last)
                if not last and tp.sleep_s > 0:
                    await asyncio.sleep(tp.sleep_s)
                    res["tool_time"] += tp.sleep_s
            res["completed"] = True
            res["jct"] = res["end"] - res["start"]
        finally:
            for ev in self.events.get(pid, ()):
                ev.set()
            self.results.append(res)

    async def _end_quietly(self, pid: str) -> None:
        """Best effort: tell agentserve a failed program is over (other servers: a 404, ignored)."""
        try:
            await asyncio.wait_for(self.client.post(f"/v1/programs/{pid}/end"), 5.0)
        except Exception:  # noqa: BLE001 - best effort only
            pass

    async def run(self, plans: list[ProgramPlan]) -> None:
        for pl in plans:
            self.events[pl.program_id] = [asyncio.Event() for _ in pl.turns]
        self.progress = _Progress(sum(len(p.turns) for p in plans), len(plans), self.cfg.progress)
        self.t0 = time.perf_counter()
        try:
            await asyncio.gather(*(self.run_program(p) for p in plans))
        finally:
            self.progress.close()


async def _server_info(client) -> tuple[str | None, int | None]:
    """(first model id, its max_model_len) from GET /v1/models; (None, None) when unavailable."""
    try:
        r = await client.get("/v1/models")
        r.raise_for_status()
        data = r.json().get("data") or []
    except Exception:  # noqa: BLE001 - a server without /v1/models
        return None, None
    if not data:
        return None, None
    card = data[0]
    mml = card.get("max_model_len") or card.get("context_length")
    return card.get("id"), int(mml) if mml else None


async def replay_async(programs: list[Program], cfg: ReplayConfig) -> dict:
    """Replay `programs` against cfg.url; the results dict (see `summarize`)."""
    import httpx

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=max(100, 2 * len(programs)), max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=base_url(cfg.url), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(cfg.request_timeout)) as client:
        model, mml = await _server_info(client)
        model = cfg.model or model
        if model is None:
            raise ReplayError(f"cannot list models at {cfg.url}/v1/models; pass --model")
        max_context = cfg.max_context if cfg.max_context is not None else mml
        rep = Replayer(cfg, client, model, max_context)
        t_cal = time.perf_counter()
        text_seed = cfg.text_seed if cfg.text_seed is not None else uuid.uuid4().hex[:8]
        if cfg.tokens_per_word is not None:
            tm = TextModel(cfg.tokens_per_word)
        else:
            tm = await calibrate(rep.count_prompt, max_context)
        t_cal = time.perf_counter() - t_cal
        rep.overhead = tm.message_overhead
        plans = plan_workload(programs, tm, token_scale=cfg.token_scale, time_scale=cfg.time_scale,
                              max_context=max_context, seed=text_seed, tool_role=cfg.tool_role)
        t_run = time.perf_counter()
        await rep.run(plans)
        wall = time.perf_counter() - t_run
    meta = {
        "server": cfg.label or base_url(cfg.url), "url": base_url(cfg.url), "model": model,
        "workload": cfg.workload, "rate": cfg.rate, "wall_s": wall, "calibration_s": t_cal,
        "config": {"seed": cfg.seed, "text_seed": text_seed, "token_scale": cfg.token_scale, "time_scale": cfg.time_scale,
                   "max_context": max_context, "tokens_per_word": tm.tokens_per_word,
                   "message_overhead": tm.message_overhead, "calibrated": cfg.tokens_per_word is None,
                   "request_timeout": cfg.request_timeout, "ignore_eos": cfg.ignore_eos,
                   "tool_role": cfg.tool_role},
    }
    return summarize(rep.turns, rep.results, meta)


def replay(programs: list[Program], cfg: ReplayConfig) -> dict:
    return asyncio.run(replay_async(programs, cfg))


# ---------------------------------------------------------------------------
# metrics


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def summarize(turns: list[dict], results: list[dict], meta: dict | None = None) -> dict:
    """The results dict: meta, then SUMMARY_KEYS and more, then per-program
    results (`program_results`) and per-turn records (`turns`), both sorted.

    JCT percentiles, mean TTFT/latency and throughput are over completed
    programs / successful turns; throughput_jobs_s = completed programs /
    (last completion - first request sent); cached_ratio = sum of cached
    tokens / sum of prompt tokens over successful turns."""
    turns = sorted(turns, key=lambda r: (r["program_id"], r["turn"]))
    results = sorted(results, key=lambda r: (r["arrival"], r["program_id"]))
    ok = [t for t in turns if t["error"] is None]
    done = [r for r in results if r["completed"]]
    jct = [r["jct"] for r in done]
    ttft = [t["ttft"] for t in ok]
    lat = [t["latency"] for t in ok]
    starts = [r["start"] for r in results if r["start"] is not None]
    ends = [r["end"] for r in done]
    makespan = (max(ends) - min(starts)) if ends and starts else 0.0
    prompt = sum(t["prompt_tokens"] for t in ok)
    cached = sum(t["cached_tokens"] for t in ok)
    errors: dict[str, int] = {}
    for t in turns:
        if t["error"] is not None:
            key = re.sub(r"(?<!HTTP )\b\d+(\.\d+)?", "N", t["error"])[:120]  # group by kind
            errors[key] = errors.get(key, 0) + 1
    out: dict[str, Any] = dict(meta or {})
    out.setdefault("server", "?")
    out.setdefault("workload", "?")
    out.setdefault("rate", float("nan"))
    out.update({
        "programs": len(results), "completed": len(done), "failed": len(results) - len(done),
        "errors": sum(errors.values()), "error_kinds": errors,
        "mean_jct": _mean(jct), "p50_jct": percentile(jct, 50), "p90_jct": percentile(jct, 90),
        "p95_jct": percentile(jct, 95), "p99_jct": percentile(jct, 99),
        "mean_ttft": _mean(ttft), "p50_ttft": percentile(ttft, 50), "p90_ttft": percentile(ttft, 90),
        "p99_ttft": percentile(ttft, 99), "mean_latency": _mean(lat),
        "throughput_jobs_s": len(done) / makespan if makespan > 0 else 0.0, "makespan_s": makespan,
        "cached_ratio": cached / prompt if prompt else 0.0, "turns_sent": len(turns), "turns_ok": len(ok),
        "prompt_tokens": prompt, "cached_tokens": cached,
        "completion_tokens": sum(t["completion_tokens"] for t in ok),
        "clamped_programs": sum(1 for r in results if r.get("clamp", 1.0) < 1.0),
        "program_results": results, "turns": turns,
    })
    return out


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def write_json(result: dict, path: str) -> None:
    """The results as JSON (NaN/inf written as null)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_jsonable(result), f, indent=1)


# ---------------------------------------------------------------------------
# command line


def add_run_parser(subparsers) -> argparse.ArgumentParser:
    """Register `run` (replay a workload against a server) on `subparsers`."""
    p = subparsers.add_parser(
        "run", help="replay an agent workload against an OpenAI-compatible server",
        description="Replay an agent workload against any OpenAI-compatible server: programs arrive as a "
                    "Poisson process, each sends its turns in order (streaming, X-Program-Id header, the "
                    "model's own output appended, tool time slept between turns, end_program on the last "
                    "turn), and the client reports per-program JCT and per-turn TTFT, latency and "
                    "prompt/cached tokens as a table, JSON, a Markdown report and plots.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (a trailing /v1 is accepted)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--workload", default="swebench",
                   help="swebench, bfcl, claude-code, swe-smith, or a JSONL trace file")
    p.add_argument("--traces", default=None, help="recorded trace file/folder (default: the shared traces)")
    p.add_argument("--programs", type=int, default=20, help="programs to replay")
    p.add_argument("--rate", type=float, default=0.5, help="program arrival rate (jobs/s, Poisson)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and its arrivals")
    p.add_argument("--text-seed", default=None,
                   help="seed of the filler text; the default, a fresh one per run, keeps an earlier run's "
                        "text from hitting the server's prefix cache (give one to send identical text)")
    p.add_argument("--token-scale", type=float, default=1.0, help="multiply every token count of the trace")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply every tool duration")
    p.add_argument("--max-context", type=int, default=None,
                   help="clamp each program to this many tokens (default: the server's max_model_len if reported)")
    p.add_argument("--tokens-per-word", type=float, default=None,
                   help="tokens per filler word (default: calibrate with three probe requests)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take in total before it counts as an error")
    p.add_argument("--tool-role", choices=("user", "tool"), default="user",
                   help="send tool results as user messages, or as tool messages answering a synthetic tool call")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (outputs may then end before max_tokens)")
    p.add_argument("--label", default=None, help="name of this server in tables and plots (default: the URL)")
    p.add_argument("--json", default=None, help="write the results (summary + per-turn records) here")
    p.add_argument("--report", default=None, help="write a Markdown report here")
    p.add_argument("--plot", default=None,
                   help="PNG prefix: writes PREFIX_jct_cdf.png and PREFIX_timeline.png")
    p.add_argument("--compare", nargs="+", default=[], metavar="JSON",
                   help="earlier result JSONs to overlay in the JCT CDF, table and report")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=cmd_run)
    return p


def _check_args(a) -> None:
    from agentserve.cli_errors import CliError

    if a.programs < 1:
        raise CliError("--programs must be at least 1")
    if not a.rate > 0:
        raise CliError("--rate must be positive")
    if not a.token_scale > 0 or not a.time_scale >= 0:
        raise CliError("--token-scale must be > 0 and --time-scale >= 0")
    if a.max_context is not None and a.max_context < 16:
        raise CliError("--max-context must be at least 16")
    if a.tokens_per_word is not None and not a.tokens_per_word > 0:
        raise CliError("--tokens-per-word must be positive")
    if not a.request_timeout > 0:
        raise CliError("--request-timeout must be positive")


def cmd_run(a) -> int:
    from agentserve.cli_errors import CliError

    from . import replay_report as rr
    from agentserve.workload.load import load_workload

    _check_args(a)
    compare = []
    for path in a.compare:
        try:
            compare.append(rr.load_result(path))
        except (OSError, ValueError) as e:
            raise CliError(f"--compare {path}: {e}") from None
    try:
        programs = load_workload(a.workload, a.programs, a.rate, a.seed, path=a.traces)
    except (OSError, ValueError) as e:
        raise CliError(str(e)) from None
    cfg = ReplayConfig(url=a.url, model=a.model, api_key=a.api_key, workload=a.workload, rate=a.rate, seed=a.seed,
                       text_seed=a.text_seed, token_scale=a.token_scale, time_scale=a.time_scale, max_context=a.max_context,
                       tokens_per_word=a.tokens_per_word, request_timeout=a.request_timeout,
                       ignore_eos=a.ignore_eos, tool_role=a.tool_role, label=a.label, progress=a.progress)
    print(f"replaying {len(programs)} programs ({sum(p.num_turns for p in programs)} turns) of {a.workload} "
          f"at {a.rate:g} jobs/s against {base_url(a.url)}...", file=sys.stderr)
    try:
        result = replay(programs, cfg)
    except ReplayError as e:
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(f"cannot reach {a.url}: {e}") from None
    results = [result] + compare
    print(rr.format_table(results))
    print(rr.format_time_table(results))
    print()
    print(rr.format_turn_table(result))
    if result["errors"]:
        print(f"\n{result['errors']} failed requests: " +
              "; ".join(f"{n}x {k}" for k, n in result["error_kinds"].items()))
    plots = {}
    if a.plot:
        plots = rr.write_plots(results, a.plot)
        for path in plots.values():
            print(f"wrote {path}", file=sys.stderr)
    if a.json:
        write_json(result, a.json)
        print(f"wrote {a.json}", file=sys.stderr)
    if a.report:
        rr.write_markdown(results, a.report, plots)
        print(f"wrote {a.report}", file=sys.stderr)
    return 0 if result["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m agentserve.bench.replay ...` (the `run` subcommand's options)."""
    from agentserve.cli_errors import CliError

    ap = argparse.ArgumentParser(prog="python -m agentserve.bench.replay")
    sub = ap.add_subparsers(dest="command", required=True)
    add_run_parser(sub)
    from .replay_report import add_report_parser
    add_report_parser(sub)
    a = ap.parse_args(argv)
    try:
        return a.func(a)
    except CliError as e:
        print(f"agentserve bench {a.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
