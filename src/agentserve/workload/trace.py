"""The workload format: one LLM call a record, grouped into programs.

A JSONL trace has one `TraceCall` a line. The generators write the same format,
so generated and recorded workloads round-trip through one loader.

JSONL line keys (one object per line):

    program_id, turn, arrival, prompt_tokens, new_tokens, output_tokens,
    tool_name, tool_duration                       -- required on every line
    hash_ids, hash_block_size, shared_prefix_tokens,
    message_index                                  -- optional, per call
    messages, parent_id, parent_turn, prefix_tokens -- optional, per program,
                                                      on the program's turn-0 line

Optional keys are written only when they differ from their defaults, so a
trace written by `save_jsonl` and read back by `load_jsonl` compares equal.

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

import json
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable


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


class TraceError(ValueError):
    """A malformed trace; the message names the line (1-based) and the field."""


# ---------------------------------------------------------------------------
# JSONL

_REQUIRED = (
    ("program_id", str),
    ("turn", int),
    ("arrival", float),
    ("prompt_tokens", int),
    ("new_tokens", int),
    ("output_tokens", int),
    ("tool_name", str),  # or None
    ("tool_duration", float),
)
_NON_NEGATIVE = ("turn", "arrival", "prompt_tokens", "new_tokens", "output_tokens", "tool_duration")


def _err(lineno: int, fieldname: str, msg: str) -> TraceError:
    return TraceError(f"line {lineno}: field '{fieldname}': {msg}")


def _check_type(lineno: int, name: str, value: Any, kind: type) -> None:
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok:
            raise _err(lineno, name, f"expected a finite number, got {value!r}")
    elif kind is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _err(lineno, name, f"expected an integer, got {value!r}")
    elif kind is str:
        if not isinstance(value, str):
            raise _err(lineno, name, f"expected a string, got {value!r}")


def _call_from_obj(obj: Any, lineno: int) -> TraceCall:
    if not isinstance(obj, dict):
        raise TraceError(f"line {lineno}: expected a JSON object, got {type(obj).__name__}")
    for name, kind in _REQUIRED:
        if name not in obj:
            raise _err(lineno, name, "missing")
        value = obj[name]
        if name == "tool_name" and value is None:
            continue
        _check_type(lineno, name, value, kind)
    for name in _NON_NEGATIVE:
        if obj[name] < 0:
            raise _err(lineno, name, f"negative value {obj[name]!r}")
    if obj["new_tokens"] > obj["prompt_tokens"]:
        raise _err(lineno, "new_tokens", f"{obj['new_tokens']} > prompt_tokens {obj['prompt_tokens']}")
    if obj["prompt_tokens"] < 1:
        raise _err(lineno, "prompt_tokens", "a call needs at least one prompt token")
    kwargs: dict[str, Any] = {name: obj[name] for name, _ in _REQUIRED}
    kwargs["arrival"] = obj["arrival"] if isinstance(obj["arrival"], float) else float(obj["arrival"])
    kwargs["tool_duration"] = (
        obj["tool_duration"] if isinstance(obj["tool_duration"], float) else float(obj["tool_duration"])
    )
    bs = obj.get("hash_block_size", 64)
    _check_type(lineno, "hash_block_size", bs, int)
    if bs < 1:
        raise _err(lineno, "hash_block_size", f"must be >= 1, got {bs}")
    kwargs["hash_block_size"] = bs
    hids = obj.get("hash_ids")
    if hids is not None:
        if not isinstance(hids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hids):
            raise _err(lineno, "hash_ids", "expected a list of integers")
        if len(hids) != obj["prompt_tokens"] // bs:
            raise _err(
                lineno, "hash_ids",
                f"{len(hids)} ids but prompt_tokens // hash_block_size = {obj['prompt_tokens'] // bs}",
            )
        kwargs["hash_ids"] = hids
    spt = obj.get("shared_prefix_tokens", 0)
    _check_type(lineno, "shared_prefix_tokens", spt, int)
    if spt < 0:
        raise _err(lineno, "shared_prefix_tokens", f"negative value {spt}")
    if spt > obj["prompt_tokens"]:
        raise _err(lineno, "shared_prefix_tokens", f"{spt} > prompt_tokens {obj['prompt_tokens']}")
    kwargs["shared_prefix_tokens"] = spt
    mi = obj.get("message_index")
    if mi is not None:
        _check_type(lineno, "message_index", mi, int)
        kwargs["message_index"] = mi
    return TraceCall(**kwargs)


def _call_to_obj(c: TraceCall) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "program_id": c.program_id,
        "turn": c.turn,
        "arrival": c.arrival,
        "prompt_tokens": c.prompt_tokens,
        "new_tokens": c.new_tokens,
        "output_tokens": c.output_tokens,
        "tool_name": c.tool_name,
        "tool_duration": c.tool_duration,
    }
    if c.hash_ids is not None:
        obj["hash_ids"] = c.hash_ids
    if c.hash_block_size != 64:
        obj["hash_block_size"] = c.hash_block_size
    if c.shared_prefix_tokens:
        obj["shared_prefix_tokens"] = c.shared_prefix_tokens
    if c.message_index is not None:
        obj["message_index"] = c.message_index
    return obj


def save_jsonl(programs: Iterable[Program], path: str | os.PathLike) -> None:
    """Write one TraceCall a line, program by program in the given order.
    Program-level optional fields go on the program's turn-0 line."""
    with open(path, "w", encoding="utf-8") as f:
        for p in programs:
            for c in p.calls:
                if c.program_id != p.program_id:
                    raise TraceError(f"program {p.program_id!r}: call {c.turn} has program_id {c.program_id!r}")
                obj = _call_to_obj(c)
                if c.turn == 0:
                    if p.messages is not None:
                        obj["messages"] = p.messages
                    if p.parent_id is not None:
                        obj["parent_id"] = p.parent_id
                    if p.parent_turn is not None:
                        obj["parent_turn"] = p.parent_turn
                    if p.prefix_tokens:
                        obj["prefix_tokens"] = p.prefix_tokens
                f.write(json.dumps(obj, ensure_ascii=False))
                f.write("\n")


def load_jsonl(path: str | os.PathLike) -> list[Program]:
    """Read a JSONL trace; programs sorted by turn-0 arrival (stable), calls by turn.

    Raises TraceError (a ValueError) with the line number and field on: bad JSON,
    a missing/ill-typed/negative field, new_tokens > prompt_tokens, a duplicate
    turn, turns that are not 0..n-1, and a reused prefix (prompt - new) longer
    than the previous call's prompt + output."""
    calls: dict[str, list[tuple[int, TraceCall, dict]]] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"line {lineno}: invalid JSON: {e.msg}") from None
            c = _call_from_obj(obj, lineno)
            extra = {k: obj[k] for k in ("messages", "parent_id", "parent_turn", "prefix_tokens") if k in obj}
            calls.setdefault(c.program_id, []).append((lineno, c, extra))
    programs: list[Program] = []
    for pid, rows in calls.items():
        rows.sort(key=lambda r: r[1].turn)
        seen: dict[int, int] = {}
        for lineno, c, _ in rows:
            if c.turn in seen:
                raise _err(lineno, "turn", f"program {pid!r} has turn {c.turn} twice (also line {seen[c.turn]})")
            seen[c.turn] = lineno
        for i, (lineno, c, _) in enumerate(rows):
            if c.turn != i:
                raise _err(lineno, "turn", f"program {pid!r}: turns are not contiguous 0..n-1 (turn {i} missing)")
        p = Program(pid, [r[1] for r in rows])
        for lineno, c, extra in rows:
            if extra and c.turn != 0:
                raise _err(lineno, next(iter(extra)), "program-level field allowed on the turn-0 line only")
            if "messages" in extra:
                if extra["messages"] is not None and not isinstance(extra["messages"], list):
                    raise _err(lineno, "messages", "expected a list")
                p.messages = extra["messages"]
            if "parent_id" in extra:
                if extra["parent_id"] is not None:
                    _check_type(lineno, "parent_id", extra["parent_id"], str)
                p.parent_id = extra["parent_id"]
            if "parent_turn" in extra:
                if extra["parent_turn"] is not None:
                    _check_type(lineno, "parent_turn", extra["parent_turn"], int)
                p.parent_turn = extra["parent_turn"]
            if "prefix_tokens" in extra:
                _check_type(lineno, "prefix_tokens", extra["prefix_tokens"], int)
                if not 0 <= extra["prefix_tokens"] <= c.prompt_tokens:
                    raise _err(lineno, "prefix_tokens", "expected 0 <= prefix_tokens <= prompt_tokens")
                p.prefix_tokens = extra["prefix_tokens"]
        for (_, prev, _), (lineno, c, _) in zip(rows, rows[1:]):
            reused = c.prompt_tokens - c.new_tokens
            if reused > prev.prompt_tokens + prev.output_tokens:
                raise _err(
                    lineno, "new_tokens",
                    f"reused prefix prompt-new = {reused} exceeds previous prompt+output "
                    f"{prev.prompt_tokens + prev.output_tokens}",
                )
        programs.append(p)
    programs.sort(key=lambda p: p.arrival)
    return programs


# ---------------------------------------------------------------------------
# statistics


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
