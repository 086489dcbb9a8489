"""What each turn of a replayed program sends: its messages (filler text of
the scaled trace's lengths, or a SWE-smith trajectory's own text), its planned
prompt and max_tokens, the tool time after it; a program that would not fit
the server's context scaled down by one more factor (see replay.py's module
doc for the whole protocol)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from agentserve.bench.replay_stream import ReplayError
from agentserve.bench.replay_text import TextModel
from agentserve.workload.swe_smith import message_text
from agentserve.workload.trace import Program


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


def sanitize_tool(name: str | None) -> str:
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
