"""The workload format: one LLM call a record, grouped into programs.

A JSONL trace has one `TraceCall` a line (trace_jsonl.py reads and writes
it). The generators write the same format, so generated and recorded workloads
round-trip through one loader.

Token semantics a consumer (simulator, replay client) relies on:

* call k's prompt is `prompt_tokens` long; its first `prompt_tokens - new_tokens`
  tokens are the first tokens of (call k-1's prompt + call k-1's output), i.e.
  content the server has seen before in this program; the remaining
  `new_tokens` are appended by the client (tool observation, user text).
  `load_jsonl` checks `prompt_k - new_k <= prompt_{k-1} + output_{k-1}`.
  A pure append (the common case) is `new_k == prompt_k - prompt_{k-1} - output_{k-1}`.
* the first `shared_prefix_tokens` tokens of every prompt are the same for all
  programs of a workload (a common system prompt).
* `hash_ids`, when present, describe the prompt exactly: block i of
  `hash_block_size` tokens has id hash_ids[i] (same id = same tokens within one
  program group: a program and its subagents); the `prompt_tokens mod
  hash_block_size` tail has no id. See `tokens.py`.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class TraceCall:
    program_id: str
    turn: int  # 0-based position of this call in its program
    arrival: float  # seconds; the program's arrival offset for turn 0 (later turns: as recorded, informational)
    prompt_tokens: int  # the whole prompt of this call
    # Tokens of this prompt NOT taken from the previous call's prompt + output:
    # the leading prompt_tokens - new_tokens tokens are a prefix of (previous
    # prompt + previous output). First call: usually == prompt_tokens.
    new_tokens: int
    output_tokens: int
    # Tool called after this call; None when the program ends. Loaders of
    # recorded traces may use "human" (a person answers) or "unknown".
    tool_name: str | None
    tool_duration: float  # seconds from this call's response to the next call's arrival (0 on the last call)
    # Optional exact prefix structure: ids of the prompt's full blocks of
    # `hash_block_size` tokens (same id at the same position = same content).
    hash_ids: list[int] | None = None
    hash_block_size: int = 64
    # Leading prompt tokens shared by every program of the workload (a system prompt).
    shared_prefix_tokens: int = 0
    # Index in Program.messages of the assistant message this call produced
    # (recorded chat traces only, e.g. SWE-smith).
    message_index: int | None = None


@dataclass
class Program:
    program_id: str
    calls: list[TraceCall] = field(default_factory=list)
    # Full chat (roles system/user/assistant/tool) for traces with text; calls
    # point into it with `message_index`. Treat as read-only (copies share it).
    messages: list[dict] | None = None
    # Subagents: the spawning program and the turn of the parent's call whose
    # response launched it (the subagent's arrival is then its start offset).
    parent_id: str | None = None
    parent_turn: int | None = None
    # Tokens of the program's own system prompt and tool definitions that open its
    # first prompt (the Claude Code traces give them); 0: not known. Unlike a
    # call's shared_prefix_tokens, not shared with other programs.
    prefix_tokens: int = 0

    @property
    def arrival(self) -> float:
        return self.calls[0].arrival

    @property
    def num_turns(self) -> int:
        return len(self.calls)

    @property
    def group_id(self) -> str:
        """The program group: the parent's id for a subagent, else the own id."""
        if self.parent_id is not None:
            return self.parent_id
        return self.program_id.split(":", 1)[0]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100] (numpy's default)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), statistics.pstdev(values)


NON_TOOL_NAMES = frozenset({"human", "unknown"})


def workload_stats(programs: list[Program]) -> dict[str, float]:
    """Summary statistics in the units of the CacheTTL paper's Table 2.

    turns: calls per program. tool_time_ms: over calls with a tool (tool_name
    not None, "human" or "unknown"). tokens_per_program: sum of prompt tokens
    over a program's calls (what a server without reuse would prefill);
    new_tokens_per_program the same for new tokens. prompt_growth: mean of
    prompt_{k+1} - prompt_k. reuse_share: 1 - sum(new) / sum(prompt).
    Standard deviations are population (ddof=0)."""
    turns = [float(p.num_turns) for p in programs]
    tool_ms = [
        c.tool_duration * 1000.0
        for p in programs
        for c in p.calls
        if c.tool_name is not None and c.tool_name not in NON_TOOL_NAMES
    ]
    tok = [float(sum(c.prompt_tokens for c in p.calls)) for p in programs]
    new = [float(sum(c.new_tokens for c in p.calls)) for p in programs]
    out = [float(c.output_tokens) for p in programs for c in p.calls]
    first = [float(p.calls[0].prompt_tokens) for p in programs if p.calls]
    growth = [
        float(b.prompt_tokens - a.prompt_tokens) for p in programs for a, b in zip(p.calls, p.calls[1:])
    ]
    s: dict[str, float] = {}
    s["programs"] = float(len(programs))
    s["calls"] = float(sum(len(p.calls) for p in programs))
    s["turns_mean"], s["turns_std"] = _mean_std(turns)
    s["tool_calls"] = float(len(tool_ms))
    s["tool_time_ms_mean"], s["tool_time_ms_std"] = _mean_std(tool_ms)
    s["tool_time_ms_p50"] = percentile(tool_ms, 50)
    s["tool_time_ms_p99"] = percentile(tool_ms, 99)
    s["tokens_per_program_mean"], s["tokens_per_program_std"] = _mean_std(tok)
    s["new_tokens_per_program_mean"], _ = _mean_std(new)
    s["first_prompt_tokens_mean"], _ = _mean_std(first)
    s["output_tokens_mean"], _ = _mean_std(out)
    s["prompt_growth_mean"], _ = _mean_std(growth)
    total_prompt = sum(tok)
    s["reuse_share"] = 1.0 - sum(new) / total_prompt if total_prompt else float("nan")
    if programs:
        s["arrival_span_s"] = max(p.arrival for p in programs) - min(p.arrival for p in programs)
    return s


def format_stats(stats: dict[str, float]) -> str:
    """One `name value` line per statistic (what the CLI prints)."""
    lines = []
    for k, v in stats.items():
        if not isinstance(v, float) or not math.isfinite(v):
            lines.append(f"{k:30s} {v}")
        elif v.is_integer() or abs(v) >= 1000:
            lines.append(f"{k:30s} {v:.0f}")
        else:
            lines.append(f"{k:30s} {v:.4g}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# where the shared traces live

TRACES_ENV = "AGENTSERVE_TRACES"


def find_shared_traces(path: str | os.PathLike | None = None) -> Path | None:
    """The shared `traces/` folder: `path` when given (returned even if it does
    not exist, so callers report it), else $AGENTSERVE_TRACES, else
    `../shared/traces` relative to the working dir or to the repo root, else
    `shared/traces` under the working dir. None when none exists."""
    if path is not None:
        return Path(path)
    env = os.environ.get(TRACES_ENV)
    candidates = []
    if env:
        candidates.append(Path(env))
    repo_root = Path(__file__).resolve().parents[3]  # src/agentserve/workload/trace.py -> repo
    cwd = Path.cwd()
    candidates += [cwd.parent / "shared" / "traces", repo_root.parent / "shared" / "traces",
                   cwd / "shared" / "traces", repo_root / "shared" / "traces"]
    for c in candidates:
        if c.is_dir():
            return c
    return None
