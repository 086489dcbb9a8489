"""The replay client: one asyncio task per program against the server, each
sending its planned turns in order (streamed, over the chat, Responses or
Messages API as replay_apis.py shapes them, the model's own output appended,
tool time slept, a subagent waiting for its parent's turn), with a progress
bar; `replay` runs a workload and returns its results (see replay.py's module
doc for the protocol, replay_results.py for the results)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from agentserve.bench.replay_apis import wire
from agentserve.bench.replay_plan import (ProgramPlan, clamp_summary, format_clamp, plan_workload, resolve_clamp,
                                          sanitize_tool)
from agentserve.bench.replay_results import summarize
from agentserve.bench.replay_stream import (ReplayError, StreamAccumulator, base_url, http_error, server_info,
                                            stream_post)
from agentserve.bench.replay_text import TextModel, calibrate
from agentserve.workload.trace import Program


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
    clamp: str = "auto"  # how a program is fitted to max_context (replay_plan.CLAMPS)
    max_output_tokens: int | None = None  # every turn's output bounded at this (None: the trace's)
    tokens_per_word: float | None = None  # None: calibrate
    request_timeout: float = 600.0
    ignore_eos: bool = True
    tool_role: str = "user"
    label: str | None = None
    progress: bool = True
    retry_failed_turns: int = 0  # resend a turn the server failed (5xx, cut stream) up to N times
    api: str = "chat"  # which API carries the turns (replay_apis.API_NAMES)
    # run beside the programs from the start (benchmarks/restart_replay.py restarts the server): while
    # it clears the Replayer's `up`, no turn is sent; cancelled if every program ends while `up` is set
    beside: Callable[[Replayer], Awaitable[None]] | None = None


def retryable(err: str) -> bool:
    """Whether a failed turn is worth sending again, as an agent framework's client would: the
    server failed it (a 5xx, a stream ended by an error event, a dropped connection), not the request."""
    return (err.startswith(("error event:", "HTTP 5")) or
            err.split(":", 1)[0] in ("RemoteProtocolError", "ReadError", "ConnectError", "WriteError"))


class _Progress:
    """tqdm over turns on stderr, programs done and errors beside it (nothing when not wanted)."""

    def __init__(self, total_turns: int, programs: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.programs, self.done, self.errors = programs, 0, 0
        self.bar = tqdm(total=total_turns, unit="turn", desc="replay", file=sys.stderr, leave=True,
                        mininterval=0.5) if enabled else None

    def update(self, turns: int = 0, program_done: bool = False, error: bool = False) -> None:
        self.done += program_done
        self.errors += error
        if self.bar is not None:
            self.bar.set_postfix(programs=f"{self.done}/{self.programs}", errors=self.errors, refresh=False)
            self.bar.update(turns)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Replayer:
    def __init__(self, cfg: ReplayConfig, client, model: str, max_context: int | None) -> None:
        self.cfg, self.client, self.model, self.max_context = cfg, client, model, max_context
        self.t0 = 0.0
        self.turns: list[dict] = []
        self.results: list[dict] = []
        self.events: dict[str, list[asyncio.Event]] = {}
        self.progress: _Progress | None = None
        self.overhead = 4.0  # template tokens a message adds (set from the TextModel)
        self.wire = wire(cfg.api, cfg.api_key)
        self.up = asyncio.Event()  # cleared (by `cfg.beside`) while the server is down: no turn is sent
        self.up.set()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def count_prompt(self, messages: list[dict]) -> int:
        """The prompt tokens of `messages`, from a one-token request over the run's API (never stored)."""
        w = self.wire.probe()
        req = w.request(self.model, messages, f"replay-probe-{uuid.uuid4().hex[:8]}", 1, stream=False,
                        ignore_eos=False, end=True)
        r = await self.client.post(req.path, json=req.body, headers=req.headers)
        if r.status_code >= 400:
            raise ReplayError(f"calibration probe: {http_error(r.status_code, r.text)}")
        n = w.usage(r.json())[0]
        if not n:
            raise ReplayError(f"calibration probe: the server reports no prompt tokens in the {w.name} API's "
                              "usage; pass --tokens-per-word")
        return int(n)

    async def _stream(self, messages: list[dict], pid: str, max_tokens: int, end: bool,
                      t_send: float) -> StreamAccumulator:
        req = self.wire.request(self.model, messages, pid, max_tokens, stream=True, ignore_eos=self.cfg.ignore_eos,
                                end=end)
        return await stream_post(self.client, req.path, req.body, req.headers, self.wire.accumulator(t_send),
                                 self.now)

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
               "tool_time": 0.0, "llm_time": 0.0, "clamp": plan.clamp, "parent_id": plan.parent_id,
               "truncated": plan.first_cut < 1.0}
        messages: list[dict] = []
        est = 0  # estimated prompt tokens of `messages`
        try:
            for tp in plan.turns:
                await self.up.wait()
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
                attempts = 0
                while True:
                    try:
                        acc = await self.turn(messages, pid, max_tokens, last, rec["t_send"])
                        break
                    except ReplayError as e:
                        rec["t_end"] = self.now()
                        rec["latency"] = rec["t_end"] - rec["t_send"]
                        rec["error"] = str(e)
                        self.turns.append(rec)
                        if attempts < self.cfg.retry_failed_turns and retryable(str(e)):
                            attempts += 1
                            await self.up.wait()
                            rec = {**rec, "t_send": self.now(), "t_end": None, "latency": None, "error": None,
                                   "attempt": attempts}
                            continue
                        res["error"] = f"turn {tp.turn}: {e}"
                        self.progress.update(turns=len(plan.turns) - tp.turn, program_done=True, error=True)
                        await self._end_quietly(self.wire.program(pid))
                        return
                t_end = self.now()
                self.wire.answered(pid, messages, acc)
                rec.update(t_first=acc.t_first if acc.t_first is not None else t_end,
                           t_end=t_end, prompt_tokens=acc.prompt_tokens, cached_tokens=acc.cached_tokens,
                           completion_tokens=acc.completion_tokens)
                if acc.replica is not None:
                    rec["replica"] = acc.replica
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
                    name = sanitize_tool(tp.tool_name)
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
        beside = asyncio.create_task(self.cfg.beside(self)) if self.cfg.beside is not None else None
        try:
            await asyncio.gather(*(self.run_program(p) for p in plans))
        finally:
            if beside is not None:
                if self.up.is_set():
                    beside.cancel()  # every program ended before its time (a no-op once it is done)
                await asyncio.gather(beside, return_exceptions=True)
            self.progress.close()


async def replay_async(programs: list[Program], cfg: ReplayConfig) -> dict:
    """Replay `programs` against cfg.url; the results dict (see `summarize`)."""
    import httpx

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=max(100, 2 * len(programs)), max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=base_url(cfg.url), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(cfg.request_timeout)) as client:
        model, mml = await server_info(client)
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
        clamp = resolve_clamp(cfg.clamp, cfg.workload)
        plans = plan_workload(programs, tm, token_scale=cfg.token_scale, time_scale=cfg.time_scale,
                              max_context=max_context, seed=text_seed, tool_role=cfg.tool_role, clamp=clamp,
                              max_output_tokens=cfg.max_output_tokens)
        clamped = clamp_summary(programs, plans, max_context, clamp, cfg.max_output_tokens)
        print(f"{cfg.label or base_url(cfg.url)}: {format_clamp(clamped)}", file=sys.stderr, flush=True)
        t_run = time.perf_counter()
        await rep.run(plans)
        wall = time.perf_counter() - t_run
    default_label = base_url(cfg.url) + ("" if cfg.api == "chat" else f" ({cfg.api})")
    meta = {
        "server": cfg.label or default_label, "url": base_url(cfg.url), "model": model, "api": cfg.api,
        "workload": cfg.workload, "rate": cfg.rate, "wall_s": wall, "calibration_s": t_cal,
        "config": {"api": cfg.api, "seed": cfg.seed, "text_seed": text_seed, "token_scale": cfg.token_scale,
                   "time_scale": cfg.time_scale,
                   "max_context": max_context, "tokens_per_word": tm.tokens_per_word,
                   "message_overhead": tm.message_overhead, "calibrated": cfg.tokens_per_word is None,
                   "request_timeout": cfg.request_timeout, "ignore_eos": cfg.ignore_eos,
                   "tool_role": cfg.tool_role, "max_output_tokens": cfg.max_output_tokens, "clamp": clamped},
    }
    return summarize(rep.turns, rep.results, meta)


def replay(programs: list[Program], cfg: ReplayConfig) -> dict:
    return asyncio.run(replay_async(programs, cfg))
