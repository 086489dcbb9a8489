"""The agent-workload runner of `python -m benchmarks agentic`: the paper's novel
workloads (benchmarks/novel_workloads.py) and its repeated-prompt patterns against
any OpenAI-compatible server, with the server's Prometheus counters read
before and after.

Novel workloads (bugfix6, deepcoding35). `concurrency` agent runs at a time
(default 1: the paper measures one agent's per-turn latency), each a loop of
streamed POST /v1/chat/completions with the run's `tools`, temperature 0,
`max_tokens` (default 128, as in the paper; stops are natural, so early stop
and speculation can show), header X-Program-Id = the run id and `end_program`
on its last turn. `tool_choice` is "required" on the turns the script expects
a call (default: one valid call each, ending where the call does; agentserve
speculates under the grammar too) and "auto" on its prose turns;
`tool_choice="auto"` leaves every turn free, as the paper's servers ran, and
lets early stop show, but SmolLM2-135M then rarely calls a tool (it writes
prose that repeats the prompt up to max_tokens). The model's reply joins the
conversation as it came back (content and parsed `tool_calls`); the script's
tool result answers the reply's call as a `tool` message, or follows as a
`user` message naming the tool when the reply made no call, so a model that
writes no call still walks the whole workflow. max_tokens is lowered near the
server's max_model_len; a run whose prompt no longer fits ends early
(`context_full`). Warm-up runs (own names) go first and are not counted; the
/metrics counters are read after them and after the measured runs.

Per turn: latency = request sent -> last byte of the stream (the paper's
per-turn latency), TTFT = first content or tool-call delta, prompt/cached/
completion tokens from the usage chunk, the call the reply made.

Repeated prompts: for each pattern (sequential, interleaved, round-robin over
3 agents x 5 turns; novel_workloads.dispatch_order), the 15 fully scripted
prompts are sent one at a time, once cold and then `iterations` times again;
each pattern has its own agents, so every pattern starts cold."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from benchmarks.novel_workloads import AgentRun, dispatch_order, repeat_agents, scripted_prompt
from agentserve.bench.replay_stream import ReplayError, StreamAccumulator, base_url, server_info, stream_post

# ---------------------------------------------------------------------------
# Prometheus counters

REPLY_CHARS = 300  # of the reply's text kept in a turn's record
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value summed over label sets. Counters lose their
    `_total` suffix (the name they were declared with); `_created` and
    histogram `_bucket` samples are left out."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name = m.group(1)
        if name.endswith(("_created", "_bucket")):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        name = name[:-6] if name.endswith("_total") else name
        out[name] = out.get(name, 0.0) + value
    return out


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before for every sample present after (absent before: 0)."""
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items())}


async def scrape(client) -> dict[str, float]:
    """GET /metrics, parsed; {} when the server has none."""
    try:
        r = await client.get("/metrics")
        if r.status_code != 200:
            return {}
        return parse_prometheus(r.text)
    except Exception:  # noqa: BLE001 - a server without metrics
        return {}


# ---------------------------------------------------------------------------
# streaming with tool calls


class ToolStream(StreamAccumulator):
    """StreamAccumulator that also folds the tool-call deltas (by index)."""

    def __init__(self, t_send: float) -> None:
        super().__init__(t_send)
        self._calls: dict[int, dict] = {}

    def feed(self, line: str, now: float) -> None:
        super().feed(line, now)
        data = line[5:].strip() if line.startswith("data:") else ""
        if not data or data == "[DONE]":
            return
        for ch in json.loads(data).get("choices") or ():
            for d in (ch.get("delta") or {}).get("tool_calls") or ():
                c = self._calls.setdefault(d.get("index", len(self._calls)), {"id": None, "name": "", "arguments": ""})
                fn = d.get("function") or {}
                c["id"] = d.get("id") or c["id"]
                c["name"] += fn.get("name") or ""
                c["arguments"] += fn.get("arguments") or ""

    @property
    def calls(self) -> list[dict]:
        return [self._calls[k] for k in sorted(self._calls)]


def call_ok(call: dict, expected: str | None) -> bool:
    """The call names the expected tool and its arguments are a JSON object."""
    try:
        args = json.loads(call.get("arguments") or "")
    except ValueError:
        return False
    return call.get("name") == expected and isinstance(args, dict)


def reply_messages(acc: ToolStream, turn_index: int, tool: str | None, result: str | None) -> list[dict]:
    """The model's reply as the assistant message, then the script's tool result
    (answering each call it made; a user message when it made none). On a prose
    turn (no result) each call the model made anyway is answered as not run."""
    msg: dict[str, Any] = {"role": "assistant", "content": acc.text}
    calls = acc.calls
    if calls:
        msg["tool_calls"] = [{"id": c["id"] or f"call_{turn_index}_{i}", "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"] or "{}"}}
                             for i, c in enumerate(calls)]
    out = [msg]
    if result is None:  # a prose turn: a call made anyway is answered, unrun (a call needs its answer)
        return out + [{"role": "tool", "tool_call_id": c["id"], "content": "Not run: answer in prose."}
                      for c in msg.get("tool_calls", [])]
    if not calls:
        return out + [{"role": "user", "content": f"Output of {tool}:\n{result}"}]
    for i, c in enumerate(msg["tool_calls"]):
        out.append({"role": "tool", "tool_call_id": c["id"],
                    "content": result if i == 0 else "Not run: one tool call per turn."})
    return out


def _chars(messages: list[dict]) -> int:
    return sum(len(json.dumps(m, ensure_ascii=False)) for m in messages)


def _estimate_tokens(messages: list[dict], chars_per_token: float) -> int:
    """A token estimate of messages not yet measured: their JSON length at the
    rate the server's last usage showed (a generous 3 before any), 8 a message more."""
    return sum(round(len(json.dumps(m, ensure_ascii=False)) / chars_per_token) + 8 for m in messages)


# ---------------------------------------------------------------------------
# the runner


@dataclass
class AgenticConfig:
    url: str
    model: str | None = None
    api_key: str | None = None
    label: str | None = None
    max_tokens: int = 128
    tool_choice: str = "required"  # on the turns the script expects a call; prose turns: "auto"
    concurrency: int = 1
    tool_time: float = 0.0  # seconds slept after a turn whose reply is followed by a tool result
    request_timeout: float = 600.0
    max_context: int | None = None  # None: the server's max_model_len from /v1/models
    progress: bool = True


class AgenticClient:
    def __init__(self, cfg: AgenticConfig, client, model: str, max_context: int | None) -> None:
        self.cfg, self.client, self.model, self.max_context = cfg, client, model, max_context
        self.t0 = time.perf_counter()
        self.turns: list[dict] = []
        self.runs: list[dict] = []
        self._done = 0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def _stream(self, body: dict, pid: str, t_send: float) -> ToolStream:
        return await stream_post(self.client, "/v1/chat/completions", body, {"X-Program-Id": pid}, ToolStream(t_send),
                                 self.now)

    async def request(self, messages: list[dict], tools, pid: str, max_tokens: int, end: bool,
                      rec: dict) -> ToolStream | None:
        """One streamed turn; fills `rec` (timings, usage, the call made, or the error)."""
        import httpx

        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        if tools:  # a turn the script answers in prose stays free
            body["tools"] = list(tools)
            body["tool_choice"] = self.cfg.tool_choice if rec.get("expected_tool") else "auto"
        if end:
            body["end_program"] = True
        rec.update(t_send=self.now(), max_tokens=max_tokens, error=None)
        try:
            acc = await asyncio.wait_for(self._stream(body, pid, rec["t_send"]), self.cfg.request_timeout)
        except asyncio.TimeoutError:
            rec["error"] = f"timeout after {self.cfg.request_timeout:g} s"
        except httpx.HTTPError as e:
            rec["error"] = f"{type(e).__name__}: {e}"
        except (ReplayError, json.JSONDecodeError) as e:
            rec["error"] = str(e)
        rec["t_end"] = self.now()
        rec["latency"] = rec["t_end"] - rec["t_send"]
        if rec["error"] is not None:
            return None
        calls = acc.calls
        rec.update(ttft=(acc.t_first if acc.t_first is not None else rec["t_end"]) - rec["t_send"],
                   prompt_tokens=acc.prompt_tokens, cached_tokens=acc.cached_tokens,
                   completion_tokens=acc.completion_tokens, finish_reason=acc.finish_reason,
                   calls=[c["name"] for c in calls], reply=acc.text[:REPLY_CHARS],
                   call_ok=bool(calls) and call_ok(calls[0], rec.get("expected_tool")))
        return acc

    async def run_agent(self, run: AgentRun, index: int, warmup: bool) -> None:
        res = {"run_id": run.run_id, "index": index, "warmup": warmup, "turns": len(run.turns), "turns_done": 0,
               "start": None, "end": None, "wall_s": None, "error": None, "context_full": False}
        messages = run.first_messages()
        known, pending = 0, list(messages)  # measured prompt tokens; messages added since
        rate = 3.0  # JSON characters of messages and tools per prompt token, as last measured
        tool_chars = _chars(list(run.tools))
        for k, t in enumerate(run.turns):
            if t.user is not None:
                messages.append({"role": "user", "content": t.user})
                pending.append(messages[-1])
            est = known + _estimate_tokens(pending, rate) + (0 if known else round(tool_chars / rate))
            max_tokens = self.cfg.max_tokens
            if self.max_context is not None:
                room = self.max_context - round(1.03 * est) - 16  # a margin for the estimate
                if room < min(8, max_tokens):
                    res["context_full"] = True
                    break
                max_tokens = min(max_tokens, room)
            last = k == len(run.turns) - 1
            rec = {"run_id": run.run_id, "run": index, "warmup": warmup, "turn": k, "expected_tool": t.tool,
                   "ttft": None, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0,
                   "finish_reason": None, "calls": [], "call_ok": False}
            acc = await self.request(messages, run.tools, run.run_id, max_tokens, last, rec)
            self.turns.append(rec)
            res["start"] = rec["t_send"] if res["start"] is None else res["start"]
            res["end"] = rec["t_end"]
            if acc is None:
                res["error"] = f"turn {k}: {rec['error']}"
                break
            res["turns_done"] += 1
            added = reply_messages(acc, k, t.tool, t.result)
            if acc.prompt_tokens:
                rate = max(0.5, (_chars(messages) + tool_chars) / acc.prompt_tokens)
            messages.extend(added)  # (after the rate: `messages` was this request's prompt)
            known, pending = (acc.prompt_tokens or est) + (acc.completion_tokens or max_tokens), added[1:]
            if t.result is not None and self.cfg.tool_time > 0:
                await asyncio.sleep(self.cfg.tool_time)
        res["wall_s"] = res["end"] - res["start"] if res["start"] is not None else None
        self.runs.append(res)
        self._done += 1
        if self.cfg.progress:
            print(f"\r{self.cfg.label or 'agentic'}: {self._done} runs done, {len(self.turns)} turns",
                  end="", file=sys.stderr, flush=True)

    async def run_all(self, runs: list[AgentRun], warmup: bool) -> None:
        """The runs, cfg.concurrency at a time (each worker takes the next run when its own ends)."""
        queue = list(enumerate(runs))

        async def worker() -> None:
            while queue:
                i, r = queue.pop(0)
                await self.run_agent(r, i, warmup)

        await asyncio.gather(*(worker() for _ in range(min(self.cfg.concurrency, len(runs)))))


def _http_client(cfg: AgenticConfig, n: int):
    import httpx

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    return httpx.AsyncClient(base_url=base_url(cfg.url), headers=headers, timeout=httpx.Timeout(cfg.request_timeout),
                             limits=httpx.Limits(max_connections=max(16, 2 * n), max_keepalive_connections=16))


async def _open(cfg: AgenticConfig, client) -> AgenticClient:
    model, mml = await server_info(client)
    model = cfg.model or model
    if model is None:
        raise ReplayError(f"cannot list models at {base_url(cfg.url)}/v1/models; pass --model")
    return AgenticClient(cfg, client, model, cfg.max_context if cfg.max_context is not None else mml)


async def run_novel_async(runs: list[AgentRun], cfg: AgenticConfig, warmup_runs: list[AgentRun] = ()) -> dict:
    """Warm-up runs, then `runs` (cfg.concurrency at a time); the raw result."""
    async with _http_client(cfg, cfg.concurrency) as client:
        ac = await _open(cfg, client)
        await ac.run_all(list(warmup_runs), True)
        warm = len(ac.turns)
        before = await scrape(client)
        t = time.perf_counter()
        ac.runs.clear()
        await ac.run_all(list(runs), False)
        wall = time.perf_counter() - t
        after = await scrape(client)
    if cfg.progress:
        print(file=sys.stderr)
    return {"server": cfg.label or base_url(cfg.url), "url": base_url(cfg.url), "model": ac.model,
            "workload": runs[0].workload if runs else "?", "wall_s": wall,
            "config": {"max_tokens": cfg.max_tokens, "tool_choice": cfg.tool_choice, "concurrency": cfg.concurrency,
                       "tool_time": cfg.tool_time, "max_context": ac.max_context, "runs": len(runs),
                       "warmup_runs": len(warmup_runs)},
            "turns": ac.turns[warm:], "warmup_turns": ac.turns[:warm], "runs": ac.runs,
            "metrics_available": bool(after), "counters": counter_deltas(before, after)}


def run_novel(runs: list[AgentRun], cfg: AgenticConfig, warmup_runs: list[AgentRun] = ()) -> dict:
    return asyncio.run(run_novel_async(runs, cfg, warmup_runs))


async def run_repeat_async(cfg: AgenticConfig, patterns: list[str], iterations: int = 3, seed: int = 0,
                           salt: str | None = None, agents: int = 3, turns: int = 5) -> dict:
    """Each pattern's scripted prompts once cold, then `iterations` times again."""
    salt = salt if salt is not None else uuid.uuid4().hex[:8]
    out: dict[str, Any] = {"server": cfg.label or base_url(cfg.url), "url": base_url(cfg.url), "workload": "repeat",
                           "config": {"max_tokens": cfg.max_tokens, "tool_choice": cfg.tool_choice,
                                      "iterations": iterations, "agents": agents, "turns": turns, "salt": salt},
                           "patterns": {}}
    async with _http_client(cfg, 1) as client:
        ac = await _open(cfg, client)
        out["model"] = ac.model
        for pattern in patterns:
            runs = repeat_agents(seed, f"{salt}-{pattern}", agents, turns)
            order = dispatch_order(pattern, agents, turns, seed)
            before = await scrape(client)
            recs = []
            for it in range(iterations + 1):
                for a, t in order:
                    run = runs[a]
                    rec = {"pattern": pattern, "pass": it, "agent": a, "turn": t, "expected_tool": run.turns[t].tool,
                           "ttft": None, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0,
                           "finish_reason": None, "calls": [], "call_ok": False}
                    await ac.request(scripted_prompt(run, t), run.tools, f"{run.run_id}-p{it}", cfg.max_tokens,
                                     t == turns - 1, rec)
                    recs.append(rec)
            out["patterns"][pattern] = {"turns": recs, "counters": counter_deltas(before, await scrape(client))}
    return out


def run_repeat(cfg: AgenticConfig, patterns: list[str], iterations: int = 3, seed: int = 0,
               salt: str | None = None) -> dict:
    return asyncio.run(run_repeat_async(cfg, patterns, iterations, seed, salt))
