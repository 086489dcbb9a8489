"""Loader for the Claude Code session traces (`traces/claude-code/trace_*.json`).

Mapping (traces/README.md section 1.5), one TraceCall per LLM-call record:

* program id: the trace `id`; a subagent is its own program "id:agent_id" with
  `parent_id` = the trace id and `parent_turn` = the parent call after which it
  was launched (the parent's call that the subagent entries follow).
* turn: position among the program's LLM-call records.
* arrival: parent `t`; subagent calls: subagent start + their `t`, where start =
  entry `t - duration_ms/1000` (completed) or entry `t` (async_launched).
* prompt_tokens = `in`; output_tokens = `out`; hash_ids copied (block size 64).
* new_tokens = `in - 64*L`, L = number of leading hash_ids equal to the previous
  call's (same program); first call: `in`. NB: this counts the previous call's
  output as new (the trace cannot tell whether its tokens match), so for these
  programs the reused prefix comes from the previous *prompt* only.
* tool_name: the last call of a program -> None. Else: a call followed by
  subagent entries -> "Task:<subagent_type of the first entry>"; stop
  "tool_use" -> "tool"; "end_turn" -> "human" (a person answers); "" (response
  not captured) -> "unknown".
* tool_duration (s): the next record's `think_time` when this record has
  `api_time` (and the next has `think_time`); otherwise max(0, t[i+1] - t[i] -
  api_time[i]) when this record has `api_time`, else max(0, t[i+1] - t[i] -
  median api_time of the program's records (0 if none)). Last call: 0.
  After a Task call the gap includes the subagents' run time.
* shared_prefix_tokens = 0 (tool definitions differ between traces); the
  program's own `prefix_tokens` = its `tool_tokens + system_tokens` (a
  subagent's from its entry), scaled, at most its first prompt.

`token_scale` multiplies token counts, keeping the block structure: each hash
id is kept and `hash_block_size` becomes max(1, round(64*scale)); a prompt is
then len(hash_ids)*block' + min(round(tail*scale), block'-1) tokens (tail = in
mod 64), new = prompt - L*block', output = round(out*scale). So the effective
scale of the block part is block'/64 (exact for scales k/64, e.g. 0.5, 0.25).

`max_prompt_tokens` (applied after scaling) truncates a program before its
first call whose prompt exceeds the limit: the kept part ends with tool_name
None and tool_duration 0; a program whose first call exceeds the limit is
dropped; subagents whose spawning parent call was dropped are dropped too.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from .trace import Program, TraceCall, find_shared_traces

BLOCK = 64


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _program_calls(
    pid: str, recs: list[dict], offset: float, spawned: dict[int, str], token_scale: float
) -> list[TraceCall]:
    api = [r["api_time"] for r in recs if r.get("api_time") is not None]
    median_api = statistics.median(api) if api else 0.0
    bs = max(1, round(BLOCK * token_scale)) if token_scale != 1.0 else BLOCK
    calls: list[TraceCall] = []
    prev_h: list[int] | None = None
    last = len(recs) - 1
    for i, r in enumerate(recs):
        h = list(r.get("hash_ids") or [])
        tokens_in, out = int(r["in"]), int(r["out"])
        L = _common_prefix(prev_h, h) if prev_h is not None else 0
        if token_scale != 1.0:
            tail = tokens_in - BLOCK * len(h)
            tokens_in = len(h) * bs + min(round(tail * token_scale), bs - 1)
            out = round(out * token_scale)
        new = tokens_in if i == 0 else tokens_in - bs * L
        if i == last:
            tool, dur = None, 0.0
        else:
            stop = r.get("stop", "")
            if i in spawned:
                tool = spawned[i]
            elif stop == "tool_use":
                tool = "tool"
            elif stop == "end_turn":
                tool = "human"
            else:
                tool = "unknown"
            nxt = recs[i + 1]
            if r.get("api_time") is not None and nxt.get("think_time") is not None:
                dur = float(nxt["think_time"])
            else:
                own = r.get("api_time")
                dur = max(0.0, float(nxt["t"]) - float(r["t"]) - (own if own is not None else median_api))
        calls.append(TraceCall(
            program_id=pid, turn=i, arrival=round(offset + float(r["t"]), 6), prompt_tokens=tokens_in,
            new_tokens=new, output_tokens=out, tool_name=tool, tool_duration=dur,
            hash_ids=h, hash_block_size=bs,
        ))
        prev_h = h
    return calls


def _truncate(calls: list[TraceCall], max_prompt_tokens: int | None) -> list[TraceCall]:
    if max_prompt_tokens is None:
        return calls
    for i, c in enumerate(calls):
        if c.prompt_tokens > max_prompt_tokens:
            calls = calls[:i]
            if calls:
                last = calls[-1]
                calls[-1] = replace(last, tool_name=None, tool_duration=0.0)
            break
    return calls


def parse_claude_code_trace(
    obj: dict[str, Any], token_scale: float = 1.0, max_prompt_tokens: int | None = None
) -> list[Program]:
    """Programs of one decoded trace file: the parent first, then its subagents."""
    if token_scale <= 0:
        raise ValueError(f"token_scale must be > 0, got {token_scale}")
    tid = obj["id"]
    parent_recs: list[dict] = []
    spawned: dict[int, str] = {}
    subs: list[tuple[dict, int]] = []  # (entry, parent turn it follows)
    for r in obj["requests"]:
        if r.get("type") == "subagent":
            j = len(parent_recs) - 1
            if j < 0:
                raise ValueError(f"{tid}: subagent entry before the first LLM call")
            spawned.setdefault(j, f"Task:{r.get('subagent_type', '')}")
            subs.append((r, j))
        else:
            parent_recs.append(r)
    parent_calls = _truncate(_program_calls(tid, parent_recs, 0.0, spawned, token_scale), max_prompt_tokens)
    if not parent_calls:
        return []
    programs = [Program(tid, parent_calls, prefix_tokens=_prefix(obj, parent_calls, token_scale))]
    for entry, j in subs:
        if j >= len(parent_calls) or not entry.get("requests"):
            continue
        if entry.get("status") == "completed" and entry.get("duration_ms") is not None:
            start = round(float(entry["t"]) - entry["duration_ms"] / 1000.0, 3)  # ms precision
        else:
            start = float(entry["t"])
        pid = f"{tid}:{entry['agent_id']}"
        calls = _truncate(_program_calls(pid, entry["requests"], start, {}, token_scale), max_prompt_tokens)
        if calls:
            programs.append(Program(pid, calls, parent_id=tid, parent_turn=j,
                                    prefix_tokens=_prefix(entry, calls, token_scale)))
    return programs


def _prefix(obj: dict, calls: list[TraceCall], token_scale: float) -> int:
    """The system prompt and tool definitions opening the first prompt, scaled."""
    n = round((int(obj.get("tool_tokens") or 0) + int(obj.get("system_tokens") or 0)) * token_scale)
    return max(0, min(n, calls[0].prompt_tokens))


def claude_code_files(path_or_dir: str | os.PathLike | None = None) -> list[Path]:
    """The trace files: a file, a folder of trace_*.json, or (None) the shared
    `traces/claude-code/` folder (see trace.find_shared_traces)."""
    if path_or_dir is None:
        root = find_shared_traces()
        if root is None:
            raise FileNotFoundError("shared traces folder not found; pass a path (or set AGENTSERVE_TRACES)")
        path = root / "claude-code"
    else:
        path = Path(path_or_dir)
        if path.is_dir() and not list(path.glob("trace_*.json")) and (path / "claude-code").is_dir():
            path = path / "claude-code"  # the traces/ folder itself
    if path.is_dir():
        files = sorted(path.glob("trace_*.json"))
        if not files:
            raise FileNotFoundError(f"no trace_*.json in {path}")
        return files
    if not path.exists():
        raise FileNotFoundError(f"no such trace file or folder: {path}")
    return [path]


def load_claude_code(
    path_or_dir: str | os.PathLike | None = None,
    token_scale: float = 1.0,
    max_prompt_tokens: int | None = None,
) -> list[Program]:
    """All programs (parents and subagents) of the Claude Code traces, sorted by
    arrival (stable: file order, parent before its subagents). Parent sessions
    all start at 0; use `assign_poisson_arrivals` (or `load_workload`) to spread them."""
    programs: list[Program] = []
    for f in claude_code_files(path_or_dir):
        with open(f, encoding="utf-8") as fh:
            programs += parse_claude_code_trace(json.load(fh), token_scale, max_prompt_tokens)
    programs.sort(key=lambda p: p.arrival)
    return programs
