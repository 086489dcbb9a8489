"""One entry point for every workload: `load_workload(spec, num_programs, rate, seed)`.

    python -m agentserve.workload.load SPEC [-n N] [--rate R] [--seed S] [--out F.jsonl]

prints `workload_stats` of the workload (and writes it as JSONL with --out).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

from .claude_code import load_claude_code
from .generators import assign_poisson_arrivals, generate_bfcl, generate_swebench
from .swe_smith import load_swe_smith
from .trace import Program, format_stats, workload_stats
from .trace_jsonl import load_jsonl, save_jsonl

GENERATED = ("swebench", "bfcl")
RECORDED = ("claude-code", "swe-smith")
CHOICES = GENERATED + RECORDED + ("<path>.jsonl",)


def sample_programs(programs: list[Program], num_programs: int | None, seed: int) -> list[Program]:
    """`num_programs` program groups drawn with replacement (uniformly over
    groups: a top-level program with its subagents). Copy i of group g gets ids
    "g#i" and "g#i:sub" (parent_id updated), so ids are distinct and a copy's
    hash-block tokens (tokens.py numbers blocks per group) differ from other
    copies'. num_programs None: every group once, ids unchanged."""
    ids = {p.program_id for p in programs}
    groups: dict[str, list[Program]] = {}
    for p in programs:
        g = p.group_id if p.group_id in ids else p.program_id
        groups.setdefault(g, []).append(p)
    if num_programs is None:
        return [p for members in groups.values() for p in members]
    if not groups:
        raise ValueError("no programs to sample from")
    keys = list(groups)
    rng = random.Random(f"{seed}:sample")
    out: list[Program] = []
    for i in range(num_programs):
        g = rng.choice(keys)
        for p in groups[g]:
            new_id = f"{g}#{i}" + p.program_id[len(g):] if p.program_id.startswith(g) else f"{p.program_id}#{i}"
            parent = f"{g}#{i}" if p.parent_id is not None else None
            calls = [replace(c, program_id=new_id) for c in p.calls]
            out.append(replace(p, program_id=new_id, calls=calls, parent_id=parent))
    return out


def _rescaled(programs: list[Program], token_scale: float, tool_time_scale: float) -> list[Program]:
    """Generated programs with every token count times `token_scale` (a call's
    prompt still extends the previous prompt and output: the part it keeps is
    scaled and clamped to them) and every tool duration times `tool_time_scale`.
    Recorded traces scale their tokens as they load (claude_code.py)."""
    if token_scale <= 0 or tool_time_scale <= 0:
        raise ValueError("token_scale and tool_time_scale must be positive")
    if token_scale == 1.0 and tool_time_scale == 1.0:
        return programs
    out = []
    for p in programs:
        calls, prev_end = [], 0
        for c in p.calls:
            kept = min(round((c.prompt_tokens - c.new_tokens) * token_scale), prev_end)
            new = max(1, round(c.new_tokens * token_scale)) if c.new_tokens else 0
            prompt = max(1, kept + new)
            output = max(1, round(c.output_tokens * token_scale))
            calls.append(replace(c, prompt_tokens=prompt, new_tokens=prompt - kept, output_tokens=output,
                                 shared_prefix_tokens=min(round(c.shared_prefix_tokens * token_scale), prompt),
                                 tool_duration=c.tool_duration * tool_time_scale))
            prev_end = prompt + output
        out.append(replace(p, calls=calls))
    return out


def long_sessions(programs: list[Program], min_turns: int) -> list[Program]:
    """The recorded sessions whose top-level program has at least `min_turns`
    turns, each with its subagents. Raises ValueError when none has."""
    keep = {p.program_id for p in programs if p.parent_id is None and p.num_turns >= min_turns}
    if not keep:
        longest = max((p.num_turns for p in programs if p.parent_id is None), default=0)
        raise ValueError(f"no session has {min_turns} turns (the longest has {longest})")
    return [p for p in programs if (p.parent_id or p.program_id) in keep]


def first_turns(programs: list[Program], max_turns: int) -> list[Program]:
    """Each program's first `max_turns` turns; a subagent its parent launched
    after them is left out."""
    kept = {p.program_id: min(p.num_turns, max_turns) for p in programs}
    return [replace(p, calls=p.calls[:max_turns]) for p in programs
            if p.parent_id is None or p.parent_turn is None or p.parent_turn < kept.get(p.parent_id, max_turns)]


def load_workload(
    spec: str, num_programs: int | None, rate: float, seed: int, **opts: Any
) -> list[Program]:
    """Programs of a workload, arriving as a Poisson process at `rate` programs/s.

    spec: "swebench" | "bfcl" (generated, num_programs programs) |
    "claude-code" | "swe-smith" | a path to a .jsonl trace (recorded: program
    groups sampled with replacement to num_programs, ids suffixed "#i"; a group
    = a session with its subagents, which come along and keep their offsets;
    num_programs=None takes each group once).
    opts: path (recorded source file/folder; default: the shared traces),
    token_scale, tool_time_scale (every tool duration times this), max_prompt_tokens (claude-code), count_tokens (swe-smith),
    keep_arrivals=True (recorded: keep recorded arrivals, no re-draw),
    min_turns (recorded: only sessions with that many turns), max_turns (each
    program's first turns; see long_sessions and first_turns).
    Returned sorted by arrival."""
    programs = _load(spec, num_programs, rate, seed, **opts)
    if opts.get("max_turns"):
        programs = first_turns(programs, opts["max_turns"])
    return programs


def _load(spec: str, num_programs: int | None, rate: float, seed: int, **opts: Any) -> list[Program]:
    key = str(spec).strip()
    low = key.lower()
    if opts.get("min_turns") and low in GENERATED + ("swe-bench",):
        raise ValueError(f"min_turns selects recorded sessions; {spec} is generated")
    if low in ("swebench", "swe-bench"):
        if num_programs is None:
            raise ValueError("generated workloads need num_programs")
        return _rescaled(generate_swebench(num_programs, rate, seed), opts.get("token_scale", 1.0),
                         opts.get("tool_time_scale", 1.0))
    if low == "bfcl":
        if num_programs is None:
            raise ValueError("generated workloads need num_programs")
        return _rescaled(generate_bfcl(num_programs, rate, seed), opts.get("token_scale", 1.0),
                         opts.get("tool_time_scale", 1.0))
    if low in ("claude-code", "claude_code", "claudecode"):
        base = load_claude_code(
            opts.get("path"), token_scale=opts.get("token_scale", 1.0),
            max_prompt_tokens=opts.get("max_prompt_tokens"),
        )
    elif low in ("swe-smith", "swe_smith", "swesmith"):
        base = load_swe_smith(opts.get("path"), count_tokens=opts.get("count_tokens"))
    elif low.endswith(".jsonl"):
        if not Path(key).is_file():
            raise FileNotFoundError(f"no such trace: {key}")
        base = load_jsonl(key)
    else:
        raise ValueError(f"unknown workload {spec!r}; choices: {', '.join(CHOICES)}")
    if opts.get("min_turns"):
        base = long_sessions(base, opts["min_turns"])
    programs = _rescaled(sample_programs(base, num_programs, seed), 1.0, opts.get("tool_time_scale", 1.0))
    if opts.get("keep_arrivals"):
        return sorted(programs, key=lambda p: p.arrival)
    return assign_poisson_arrivals(programs, rate, seed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agentserve.workload.load", description=__doc__)
    ap.add_argument("spec", help=f"one of {', '.join(CHOICES)}")
    ap.add_argument("-n", "--num-programs", type=int, default=None)
    ap.add_argument("--rate", type=float, default=1.0, help="programs per second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--path", default=None, help="recorded trace file/folder")
    ap.add_argument("--token-scale", type=float, default=1.0)
    ap.add_argument("--max-prompt-tokens", type=int, default=None)
    ap.add_argument("--out", default=None, help="write the workload as JSONL")
    a = ap.parse_args(argv)
    n = a.num_programs
    if n is None and a.spec.lower() in GENERATED + ("swe-bench",):
        n = 100
    programs = load_workload(a.spec, n, a.rate, a.seed, path=a.path, token_scale=a.token_scale,
                             max_prompt_tokens=a.max_prompt_tokens)
    print(format_stats(workload_stats(programs)))
    if a.out:
        save_jsonl(programs, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
