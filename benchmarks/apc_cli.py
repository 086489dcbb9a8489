"""`python -m benchmarks apc`: the eviction analysis of apc.py as a command, its
tables (hit ratios and losses per cache size and strategy, the workload's
reuse profile) and its JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from agentserve.argtypes import csv_list
from benchmarks import apc
from benchmarks.apc import DEFAULT_KV_BLOCKS, INFINITE, STRATEGIES
from benchmarks.common import run_main


def _pct(x) -> str:
    return "-" if x is None else f"{100.0 * x:.1f}"


def format_table(rows: Sequence[dict]) -> str:
    """Hit ratios in % of prompt tokens; losses in percentage points against
    the infinite cache; "MT share" = the multi-turn part of the loss."""
    head = (f"{'kv_blocks':>9} {'strategy':<9} {'hit%':>6} {'multi%':>7} {'cross%':>7} "
            f"{'loss_pp':>8} {'MT_pp':>6} {'XP_pp':>6} {'MT_share%':>9} {'evictions':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        inf = r["strategy"] == INFINITE
        kvb = "inf" if r["kv_blocks"] is None else str(r["kv_blocks"])
        loss = ("-", "-", "-") if inf else (f"{r['loss_pp']:.1f}", f"{r['loss_multi_turn_pp']:.1f}",
                                            f"{r['loss_cross_program_pp']:.1f}")
        lines.append(
            f"{kvb:>9} {r['strategy']:<9} {_pct(r['hit_ratio']):>6} {_pct(r['multi_turn_ratio']):>7} "
            f"{_pct(r['cross_program_ratio']):>7} {loss[0]:>8} {loss[1]:>6} {loss[2]:>6} "
            f"{'-' if inf else _pct(r['loss_multi_turn_share']):>9} {r['evictions']:>10}"
        )
    trunc = {r["kv_blocks"]: r["truncated_calls"] for r in rows if r["truncated_calls"]}
    for n, c in trunc.items():
        lines.append(f"note: {c} call(s) longer than {n} blocks kept only their first {n} blocks")
    return "\n".join(lines)


def format_profile(prof: dict) -> str:
    def f(key: str) -> str:
        v = prof.get(key)
        return "-" if v is None else f"{v:.0f}"

    return (f"programs {prof['programs']}, calls {prof['calls']}, prompt tokens {prof['prompt_tokens']}, "
            f"unique blocks {prof['unique_blocks']}, largest call {prof['max_call_blocks']} blocks; "
            f"program KV p50 {f('program_blocks_p50')} blocks "
            f"(mean {f('program_blocks_mean')}); active programs p50 {f('active_programs_p50')} "
            f"(max {f('active_programs_max')}); inter-turn gap p50 {f('inter_turn_gap_p50')} "
            f"calls (p90 {f('inter_turn_gap_p90')}); working set ~{f('working_set_blocks')} blocks")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks apc",
        description=apc.__doc__.split("\n\n")[0] + ": replay a workload through the KV manager alone and "
                    "print the prefix-cache hit ratio under each eviction strategy and an infinite cache, "
                    "split into multi-turn and cross-program hits.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="example: python -m benchmarks apc --workload swebench --programs 50 --kv-blocks 2048 --json apc.json")
    p.add_argument("--workload", default="swebench",
                   help="swebench, bfcl, claude-code, swe-smith, or a JSONL trace file")
    p.add_argument("--programs", type=int, default=100, help="programs (program groups for recorded traces)")
    p.add_argument("--seed", type=int, default=0, help="seed for the workload, arrivals and token ids")
    p.add_argument("--rate", type=float, default=0.5, help="program arrival rate (programs/s)")
    p.add_argument("--kv-blocks", type=csv_list(int), default=list(DEFAULT_KV_BLOCKS),
                   help="comma-separated device cache sizes in blocks")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--strategies", type=csv_list(str), default=list(STRATEGIES),
                   help="comma-separated eviction strategies")
    p.add_argument("--decode-tps", type=float, default=0.0,
                   help="model an LLM call as output_tokens / this many seconds (0: instant)")
    p.add_argument("--traces", default=None, help="recorded trace file/folder (default: the shared traces)")
    p.add_argument("--json", default=None, help="write the profile and rows here")
    return p


def run(args) -> int:
    from agentserve.cli_errors import CliError
    from agentserve.kv.eviction import STRATEGIES as KNOWN
    from agentserve.workload.load import load_workload

    bad = [s for s in args.strategies if s not in KNOWN]
    if bad:
        raise CliError(f"unknown strategy {', '.join(bad)}; choose from {', '.join(sorted(KNOWN))}")
    if args.block_size < 1 or any(n < 1 for n in args.kv_blocks) or args.programs < 1:
        raise CliError("--block-size, --kv-blocks and --programs must be >= 1")
    opts = {"path": args.traces} if args.traces else {}
    try:
        programs = load_workload(args.workload, args.programs, args.rate, args.seed, **opts)
    except (OSError, ValueError) as e:
        raise CliError(str(e)) from e
    prof: dict = {}
    rows = apc.apc_table(programs, args.kv_blocks, args.block_size, args.strategies, seed=args.seed,
                     decode_tps=args.decode_tps, profile=prof)
    print(f"# {args.workload}: {format_profile(prof)}")
    print(format_table(rows), flush=True)
    if args.json:
        doc = {
            "workload": args.workload, "programs": args.programs, "seed": args.seed, "rate": args.rate,
            "block_size": args.block_size, "decode_tps": args.decode_tps, "kv_blocks": args.kv_blocks,
            "strategies": args.strategies, "profile": prof, "rows": rows,
        }
        d = os.path.dirname(args.json)
        if d:
            os.makedirs(d, exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, allow_nan=False, default=_json_default)
            f.write("\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _json_default(x):
    raise TypeError(f"not JSON serialisable: {x!r}")


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
