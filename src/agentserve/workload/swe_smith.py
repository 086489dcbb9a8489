"""Loader for `traces/swe_smith_5traj_tool_timings.json` (5 SWE-smith trajectories
with full message text and measured tool execution times).

One TraceCall per assistant message (traces/README.md section 2):

* program id = `traj_id`; Program.messages = the decoded chat list (the file
  stores it as a JSON string inside the JSON); TraceCall.message_index = index
  of the call's assistant message in it.
* token counts per message: `count_tokens(text)` when given, else
  round(len(text) / 4). A message's text = its `content` (a string, or the
  concatenated `text` of a list of parts); an assistant message adds
  function.name + function.arguments of each tool call (`thought`/`action`
  repeat the content and are not counted).
* prompt of call k = sum of the message counts before assistant message k
  (tool schemas are not in the file and not counted); output = the assistant
  message's count; new = prompt - previous prompt - previous output (first
  call: the prompt). Counting per message keeps this an exact pure append.
* shared_prefix_tokens = the system message's count (the same short system
  prompt in every trajectory).
* tool_name = tool_calls[0].function.name, tool_duration =
  its execution_time_seconds; the last call (the final submit) gets None and 0.
* arrival: 0 for turn 0; later turns: previous arrival + previous tool
  duration (no LLM time is recorded; informational only).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from .trace import Program, TraceCall, find_shared_traces

FILE_NAME = "swe_smith_5traj_tool_timings.json"


def message_text(msg: dict[str, Any]) -> str:
    """The counted text of one chat message (see module doc)."""
    content = msg.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        text = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    if msg.get("role") == "assistant":
        for tc in msg.get("tool_calls") or []:
            fn = tc.get("function") or {}
            text += (fn.get("name") or "") + (fn.get("arguments") or "")
    return text


def _decode_messages(raw: Any) -> list[dict]:
    msgs = raw
    for _ in range(2):  # a JSON string inside the JSON (tolerate one more level)
        if isinstance(msgs, str):
            msgs = json.loads(msgs)
    if not isinstance(msgs, list):
        raise ValueError("swe-smith: `messages` does not decode to a list")
    return msgs


def parse_swe_smith_trajectory(
    traj: dict[str, Any], count_tokens: Callable[[str], int] | None = None
) -> Program:
    msgs = _decode_messages(traj["messages"])
    pid = traj.get("traj_id") or traj["instance_id"]

    def count(m: dict) -> int:
        text = message_text(m)
        return int(count_tokens(text)) if count_tokens is not None else round(len(text) / 4)

    counts = [count(m) for m in msgs]
    shared = counts[0] if msgs and msgs[0].get("role") == "system" else 0
    asst = [i for i, m in enumerate(msgs) if m.get("role") == "assistant"]
    if not asst:
        raise ValueError(f"swe-smith {pid}: no assistant message")
    calls: list[TraceCall] = []
    prefix = [0]
    for n in counts:
        prefix.append(prefix[-1] + n)
    arrival = 0.0
    prev_prompt = prev_out = 0
    for k, i in enumerate(asst):
        prompt = prefix[i]
        out = counts[i]
        new = prompt if k == 0 else prompt - prev_prompt - prev_out
        tcs = msgs[i].get("tool_calls") or []
        if k == len(asst) - 1:
            tool, dur = None, 0.0
        elif tcs:
            tool = tcs[0]["function"]["name"]
            dur = float(tcs[0].get("execution_time_seconds") or 0.0)
        else:
            tool, dur = "unknown", 0.0
        calls.append(TraceCall(
            program_id=pid, turn=k, arrival=arrival, prompt_tokens=max(1, prompt), new_tokens=max(0, new),
            output_tokens=out, tool_name=tool, tool_duration=dur,
            shared_prefix_tokens=min(shared, max(1, prompt)), message_index=i,
        ))
        arrival += dur
        prev_prompt, prev_out = prompt, out
    return Program(pid, calls, messages=msgs)


def load_swe_smith(
    path: str | os.PathLike | None = None, count_tokens: Callable[[str], int] | None = None
) -> list[Program]:
    """The trajectories as programs (all arriving at 0; see assign_poisson_arrivals).
    `path`: the JSON file, or a folder holding it; None = the shared traces folder."""
    if path is None:
        root = find_shared_traces()
        if root is None:
            raise FileNotFoundError("shared traces folder not found; pass a path (or set AGENTSERVE_TRACES)")
        p = root / FILE_NAME
    else:
        p = Path(path)
        if p.is_dir():
            p = p / FILE_NAME
    with open(p, encoding="utf-8") as f:
        data = json.load(f)
    if isinstance(data, dict):
        data = [data]
    return [parse_swe_smith_trajectory(t, count_tokens) for t in data]
