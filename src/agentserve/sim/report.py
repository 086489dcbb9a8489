"""Rows, tables and plots for simulation sweeps (policy x rate)."""

from __future__ import annotations

import json
import math

from agentserve.sim.driver import SimResult, mean, percentile
from agentserve.text_table import aligned

ROW_KEYS = ("workload", "profile", "policy", "rate", "mean_jct", "p90_jct", "p95_jct", "throughput", "hit_ratio")


def result_row(workload: str, profile: str, rate: float, r: SimResult) -> dict:
    return {
        "workload": workload, "profile": profile, "policy": r.policy, "rate": rate,
        "mean_jct": mean(r.jct), "p90_jct": percentile(r.jct, 90), "p95_jct": percentile(r.jct, 95),
        "throughput": r.throughput, "hit_ratio": r.hit_ratio,
        "p99_ttft": percentile(r.ttft, 99), "mean_ttft": mean(r.ttft),
        "p99_ttft_below": percentile(r.below_ttft, 99) if r.below_ttft else math.nan,
        "below_turns": len(r.below_ttft), "prefetch": r.prefetch,
        "max_queue": max(r.queue_times, default=0.0), "preemptions": r.preemptions,
        "programs": r.programs, "completed": r.completed, "rejected": r.rejected,
        "steps": r.steps, "sched_overhead_us": r.sched_overhead_s * 1e6, "sim_wall_s": r.wall_s,
        "pins": r.pins, "capped_steps": r.capped_steps,
        "max_decode_step_ms": r.decode_step_max_s * 1e3, "p99_decode_step_ms": r.decode_step_p99_s * 1e3,
        "state": r.state, "tiers": r.tiers,
        "kv_layout": r.kv_layout, "kv_blocks": r.kv_blocks, "window_parts_evicted": r.window_parts_evicted,
    }


def _f(x: float, nd: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _layout(r: dict) -> str:
    return r.get("kv_layout", "full")  # rows written before the hybrid KV cache: full


def shows_layout(rows: list[dict]) -> bool:
    """Whether a table names each row's KV layout: some row used the hybrid one."""
    return any(_layout(r) != "full" for r in rows)


def format_table(rows: list[dict]) -> str:
    kv = shows_layout(rows)
    head = ["policy", *(["kv layout"] if kv else []), "rate", "done", "mean JCT", "p90 JCT", "p95 JCT", "jobs/s",
            "hit %", "p99 TTFT", "max queue", "preempt", "pins", "mean TTL", "sched us/step", "sim s"]
    lines = [head]
    for r in rows:
        lines.append([
            r["policy"], *([_layout(r)] if kv else []), f"{r['rate']:g}", f"{r['completed']}/{r['programs']}",
            _f(r["mean_jct"]), _f(r["p90_jct"]), _f(r["p95_jct"]), _f(r["throughput"], 3), _f(100 * r["hit_ratio"]),
            _f(r["p99_ttft"], 2), _f(r["max_queue"]), str(r["preemptions"]), str(r["pins"]["created"]),
            _f(r["pins"]["mean_ttl"], 2), _f(r["sched_overhead_us"], 0), _f(r["sim_wall_s"]),
        ])
    return aligned(lines, left=2 if kv else 1)


def ratio_lines(rows: list[dict], base: str = "vllm-fcfs") -> list[str]:
    """Mean-JCT speedup of every policy over `base`, per rate (and KV layout);
    where both layouts ran, each policy's hybrid-over-full speedup."""
    out = []
    layouts = list(dict.fromkeys(_layout(r) for r in rows))
    for rate in sorted({r["rate"] for r in rows}):
        for layout in layouts:
            at = {r["policy"]: r for r in rows if r["rate"] == rate and _layout(r) == layout}
            if base not in at:
                continue
            b = at[base]["mean_jct"]
            parts = [f"{p} {b / r['mean_jct']:.2f}x" for p, r in at.items() if p != base and r["mean_jct"] > 0]
            if parts:
                where = f" ({layout} KV)" if len(layouts) > 1 else ""
                out.append(f"rate {rate:g}{where}: mean-JCT speedup over {base}: " + ", ".join(parts))
        if {"full", "hybrid"} <= set(layouts):
            by = {(r["policy"], _layout(r)): r for r in rows if r["rate"] == rate}
            parts = [f"{p} {by[p, 'full']['mean_jct'] / r['mean_jct']:.2f}x" for (p, lay), r in by.items()
                     if lay == "hybrid" and (p, "full") in by and r["mean_jct"] > 0]
            if parts:
                out.append(f"rate {rate:g}: mean-JCT speedup of the hybrid KV cache over the full one: "
                           + ", ".join(parts))
    return out


def format_markdown(rows: list[dict], base: str = "vllm-fcfs", paper: str = "continuum") -> str:
    """The README's table of a sweep: a row a policy and rate, the best mean JCT
    of each rate in bold, speedups over `base` and over `paper` (the paper's policy)."""
    kv = shows_layout(rows)
    done = any(r.get("completed", 0) != r.get("programs", 0) for r in rows)  # a mean over fewer programs: say so
    head = ["rate", "policy", *(["KV layout"] if kv else []), *(["done"] if done else []), "mean JCT", "speedup",
            f"vs {paper}", *(["vs full KV"] if kv else []), "p95 JCT", "throughput", "hit %", "p99 TTFT", "max queue",
            "preemptions", "pins", "mean TTL"]
    out = ["| " + " | ".join(head) + " |", "|---|---|" + "---|" * kv + "---:|" * (len(head) - 2 - kv)]
    for rate in sorted({r["rate"] for r in rows}):
        at = [r for r in rows if r["rate"] == rate]
        by = {(r["policy"], _layout(r)): r for r in at}
        best = min(r["mean_jct"] for r in at)
        for r in at:
            jct = _f(r["mean_jct"])
            ratio = lambda other: (f"{by[other, _layout(r)]['mean_jct'] / r['mean_jct']:.2f}x"  # noqa: E731
                                   if (other, _layout(r)) in by else "-")
            out.append("| " + " | ".join([
                f"{rate:g}", r["policy"], *([_layout(r)] if kv else []),
                *([f"{r['completed']}/{r['programs']}"] if done else []), f"**{jct}**" if r["mean_jct"] == best else jct,
                ratio(base), ratio(paper),
                *([f"{by[r['policy'], 'full']['mean_jct'] / r['mean_jct']:.2f}x"
                   if (r["policy"], "full") in by else "-"] if kv else []),
                _f(r["p95_jct"]), _f(r["throughput"], 3), _f(100 * r["hit_ratio"]), _f(r["p99_ttft"]),
                _f(r["max_queue"]), str(r["preemptions"]), str(r["pins"]["created"]), _f(r["pins"]["mean_ttl"], 2),
            ]) + " |")
    return "\n".join(out)


def format_focus(rows: list[dict], focus: str, label: str, base: str = "vllm-fcfs",
                 paper: str = "continuum") -> list[str]:
    """One Markdown row a rate: the best of the other policies, `focus`'s mean
    JCT (bold where it is the best), its speedup over `paper`, and its p99 TTFT
    over `base`'s (the README's summary of a policy across sweeps)."""
    out = []
    for rate in sorted({r["rate"] for r in rows}):
        by = {r["policy"]: r for r in rows if r["rate"] == rate}
        if focus not in by:
            continue
        me = by[focus]
        others = [r for p, r in by.items() if p != focus]
        best = min(others, key=lambda r: r["mean_jct"]) if others else None
        jct = _f(me["mean_jct"])
        win = best is None or me["mean_jct"] <= best["mean_jct"]
        cells = [label, f"{rate:g}", f"{best['policy']} {_f(best['mean_jct'])}" if best else "-",
                 f"**{jct}**" if win else jct,
                 f"{by[paper]['mean_jct'] / me['mean_jct']:.2f}x" if paper in by else "-",
                 f"{me['p99_ttft'] / by[base]['p99_ttft']:.2f}x" if base in by and by[base]["p99_ttft"] > 0 else "-"]
        out.append("| " + " | ".join(cells) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m agentserve.sim.report SWEEP.json ...`: the Markdown table of
    sweeps that `agentserve sim --json` wrote (the README's tables)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m agentserve.sim.report", description=main.__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="JSON files written by `agentserve sim --json`")
    ap.add_argument("--base", default="vllm-fcfs", help="the policy speedups are measured against")
    ap.add_argument("--focus", default=None, metavar="POLICY",
                    help="instead of the tables, one row a file and rate: POLICY against the best of the others")
    args = ap.parse_args(argv)
    if args.focus:
        print("| sweep | rate | best of the others | " + args.focus + " | vs continuum | p99 TTFT / " + args.base
              + "'s |")
        print("|---|---:|---|---:|---:|---:|")
    for path in args.files:
        with open(path) as f:
            rows = json.load(f)
        if args.focus:
            label = path.rsplit("/", 1)[-1].removesuffix(".json")
            print("\n".join(format_focus(rows, args.focus, label, args.base)))
        else:
            print(format_markdown(rows, args.base))
            print()
    return 0


def write_json(rows: list[dict], path: str) -> None:
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "mean_jct", "mean JCT (s)"), (axes[1], "p95_jct", "p95 JCT (s)")):
        for pol in dict.fromkeys(r["policy"] for r in rows):
            pts = sorted((r["rate"], r[key]) for r in rows if r["policy"] == pol)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=pol)
        ax.set_xlabel("program arrival rate (jobs/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
