"""Tables, plots and the Markdown report of replay results (the dicts
`replay_results.summarize` returns, or their JSON files), one or several side
by side (`agentserve bench report`)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
from pathlib import Path

from agentserve.bench.replay_plan import format_clamp
from agentserve.bench.replay_results import write_json
from agentserve.text_table import aligned, markdown
from agentserve.workload.trace import percentile


def load_result(path: str | os.PathLike) -> dict:
    """A result JSON written by `replay_results.write_json` (ValueError if it is not one)."""
    with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    if not isinstance(obj, dict) or "program_results" not in obj or "turns" not in obj:
        raise ValueError("not a replay result (no program_results/turns)")
    return obj


def _num(x) -> float:
    return float("nan") if x is None else float(x)


def _f(x, nd: int = 2) -> str:
    x = _num(x)
    return "-" if math.isnan(x) else f"{x:.{nd}f}"


SUMMARY_HEAD = ["server", "workload", "rate", "done", "errors", "mean JCT", "p50 JCT", "p90 JCT", "p95 JCT",
                "mean TTFT", "p90 TTFT", "mean lat", "jobs/s", "cached %"]


def summary_rows(results: list[dict]) -> list[list[str]]:
    rows = []
    for r in results:
        rows.append([
            str(r.get("server", "?")), _workload(r), f"{_num(r.get('rate')):g}",
            f"{r['completed']}/{r['programs']}", str(r.get("errors", 0)), _f(r["mean_jct"]), _f(r["p50_jct"]),
            _f(r["p90_jct"]), _f(r["p95_jct"]), _f(r["mean_ttft"], 3), _f(r.get("p90_ttft"), 3),
            _f(r.get("mean_latency"), 3), _f(r["throughput_jobs_s"], 3), _f(100 * _num(r["cached_ratio"]), 1),
        ])
    return rows


def turn_rows(result: dict, max_turns: int = 30) -> tuple[list[str], list[list[str]]]:
    """Per turn index over programs: count, median prompt/cached tokens, TTFT and latency."""
    head = ["turn", "n", "prompt tok", "cached tok", "cached %", "mean TTFT", "p90 TTFT", "mean lat", "errors"]
    by: dict[int, list[dict]] = {}
    for t in result["turns"]:
        by.setdefault(t["turn"], []).append(t)
    rows = []
    for k in sorted(by)[:max_turns]:
        ts = by[k]
        ok = [t for t in ts if t["error"] is None]
        pr = sum(t["prompt_tokens"] for t in ok)
        ca = sum(t["cached_tokens"] for t in ok)
        rows.append([
            str(k), str(len(ts)),
            f"{statistics.median(t['prompt_tokens'] for t in ok):.0f}" if ok else "-",
            f"{statistics.median(t['cached_tokens'] for t in ok):.0f}" if ok else "-",
            _f(100 * ca / pr, 1) if pr else "-",
            _f(statistics.fmean(t["ttft"] for t in ok), 3) if ok else "-",
            _f(percentile([t["ttft"] for t in ok], 90), 3) if ok else "-",
            _f(statistics.fmean(t["latency"] for t in ok), 3) if ok else "-",
            str(len(ts) - len(ok)),
        ])
    return head, rows


TIME_HEAD = ["server", "JCT", "to first token", "decoding", "tools", "other", "turns", "TTFT/turn",
             "decode/turn", "out tok/turn", "tok/s/stream"]


def time_rows(results: list[dict]) -> list[list[str]]:
    """Where a program's time goes, per server (means over completed programs, seconds):
    waiting for first tokens (queueing + prefill), decoding the rest, sleeping in tools,
    and the remainder (client work between turns); then the same per turn."""
    rows = []
    for r in results:
        done = {p["program_id"] for p in r["program_results"] if p.get("error") is None}
        progs = [p for p in r["program_results"] if p["program_id"] in done]
        turns = [t for t in r["turns"] if t["program_id"] in done and t["error"] is None]
        if not progs or not turns:
            continue
        n = len(progs)
        ttft = sum(t["ttft"] for t in turns)
        decode = sum(t["latency"] - t["ttft"] for t in turns)
        tools = sum(p["tool_time"] for p in progs)
        jct = sum(p["jct"] for p in progs)
        out = sum(t["completion_tokens"] for t in turns)
        streamed = [t["completion_tokens"] - 1 for t in turns if t["completion_tokens"] > 1]
        stream_s = sum(t["latency"] - t["ttft"] for t in turns if t["completion_tokens"] > 1)
        rows.append([str(r.get("server", "?")), _f(jct / n, 1), _f(ttft / n, 1), _f(decode / n, 1),
                     _f(tools / n, 1), _f((jct - ttft - decode - tools) / n, 1), f"{len(turns) / n:.1f}",
                     _f(ttft / len(turns), 3), _f(decode / len(turns), 3),
                     f"{out / len(turns):.1f}" if out else "-",
                     _f(sum(streamed) / stream_s, 1) if streamed and stream_s > 0 else "-"])
    return rows


def format_time_table(results: list[dict]) -> str:
    return aligned([TIME_HEAD] + time_rows(results))


def format_table(results: list[dict]) -> str:
    """One row per result (JCT and TTFT in seconds)."""
    return aligned([SUMMARY_HEAD] + summary_rows(results))


def format_turn_table(result: dict, max_turns: int = 30) -> str:
    head, rows = turn_rows(result, max_turns)
    return aligned([head] + rows)


# ---------------------------------------------------------------------------
# plots


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_jct_cdf(results: list[dict], path: str) -> None:
    """Empirical CDF of completed programs' JCT, one line per result."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for r in results:
        jct = sorted(p["jct"] for p in r["program_results"] if p.get("completed"))
        if not jct:
            continue
        ys = [(i + 1) / len(r["program_results"]) for i in range(len(jct))]  # failed programs never reach 1
        ax.step([jct[0]] + jct, [0.0] + ys, where="post", label=f"{r.get('server', '?')} (mean {statistics.fmean(jct):.1f} s)")
    ax.set_xlabel("job completion time (s)")
    ax.set_ylabel("fraction of programs")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    r0 = results[0] if results else {}
    ax.set_title(f"JCT CDF: {_workload(r0)} at {_num(r0.get('rate')):g} jobs/s", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(result: dict, path: str, max_programs: int = 60) -> None:
    """A Gantt chart: one row per program (by arrival); per turn the wait for
    the first token (queueing + prefill, light), the decode (dark) and the tool
    time after it (grey); failed turns in red."""
    plt = _plt()
    progs = result["program_results"][:max_programs]
    row = {p["program_id"]: i for i, p in enumerate(progs)}
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.28 * max(1, len(progs))))
    for t in result["turns"]:
        y = row.get(t["program_id"])
        if y is None or t["t_send"] is None:
            continue
        if t["error"] is not None:
            ax.broken_barh([(t["t_send"], max(t["latency"] or 0, 1e-3))], (y - 0.35, 0.7), color="tab:red")
            continue
        ax.broken_barh([(t["t_send"], t["ttft"])], (y - 0.35, 0.7), color="tab:orange", alpha=0.55)
        ax.broken_barh([(t["t_first"], t["t_end"] - t["t_first"])], (y - 0.35, 0.7), color="tab:blue")
        if t["sleep_s"] and not t["end_program"]:
            ax.broken_barh([(t["t_end"], t["sleep_s"])], (y - 0.12, 0.24), color="0.6")
    for p in progs:
        ax.plot([p["arrival"]], [row[p["program_id"]]], marker="|", color="k", markersize=9)
    ax.set_yticks(range(len(progs)))
    ax.set_yticklabels([p["program_id"][-24:] for p in progs], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("time since the run started (s)")
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(color="tab:orange", alpha=0.55, label="wait + prefill (TTFT)"),
                       Patch(color="tab:blue", label="decode"), Patch(color="0.6", label="tool"),
                       Patch(color="tab:red", label="failed")], fontsize=7, loc="lower left",
              bbox_to_anchor=(0.0, 1.0), ncol=4, frameon=False)
    ax.set_title(f"{result.get('server', '?')}: {_workload(result)} at {_num(result.get('rate')):g} "
                 f"jobs/s (| = arrival)", fontsize=10, loc="right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _workload(r: dict) -> str:
    w = str(r.get("workload", "?"))
    return Path(w).name if w.endswith(".jsonl") else w


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("_")[:40] or "run"


def write_plots(results: list[dict], prefix: str) -> dict[str, str]:
    """PREFIX_jct_cdf.png (all results) and PREFIX_timeline.png (the first; the
    others PREFIX_timeline_<server>.png). Returns {name: path}."""
    if prefix.lower().endswith(".png"):
        prefix = prefix[:-4]
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    out = {"jct_cdf": f"{prefix}_jct_cdf.png"}
    plot_jct_cdf(results, out["jct_cdf"])
    for i, r in enumerate(results):
        key = "timeline" if i == 0 else f"timeline_{_slug(str(r.get('server', i)))}"
        out[key] = f"{prefix}_{key}.png"
        plot_timeline(r, out[key])
    return out


# ---------------------------------------------------------------------------
# Markdown


def write_markdown(results: list[dict], path: str, plots: dict[str, str] | None = None) -> None:
    r = results[0]
    cfg = r.get("config", {})
    lines = [f"# Replay: {r.get('workload', '?')} against {r.get('server', '?')}", ""]
    lines.append(f"- server URL: {r.get('url', '?')}, model: {r.get('model', '?')}, API: {r.get('api', 'chat')}")
    lines.append(f"- {r['programs']} programs ({r.get('turns_sent', '?')} turns sent) arriving at "
                 f"{_num(r.get('rate')):g} jobs/s (Poisson), seed {cfg.get('seed', '?')}")
    lines.append(f"- token scale {cfg.get('token_scale', '?')}, tool-time scale {cfg.get('time_scale', '?')}, "
                 f"max context {cfg.get('max_context')}, programs clamped to fit: {r.get('clamped_programs', 0)}")
    if cfg.get("clamp"):
        lines.append(f"- {format_clamp(cfg['clamp'])}")
    tpw = cfg.get("tokens_per_word")
    lines.append(f"- filler text: {_f(tpw, 3)} tokens/word, {_f(cfg.get('message_overhead'), 1)} template "
                 f"tokens/message ({'calibrated' if cfg.get('calibrated') else 'given'}); tool results as "
                 f"`{cfg.get('tool_role', 'user')}` messages; ignore_eos {cfg.get('ignore_eos')}")
    lines.append(f"- wall time {_f(r.get('wall_s'), 1)} s, makespan {_f(r.get('makespan_s'), 1)} s; "
                 f"prompt tokens {r.get('prompt_tokens')}, cached {r.get('cached_tokens')}, "
                 f"completion {r.get('completion_tokens')}")
    lines.append(f"- failed programs {r.get('failed', 0)}, failed requests {r.get('errors', 0)}")
    for k, n in (r.get("error_kinds") or {}).items():
        lines.append(f"  - {n}x {k}")
    lines += ["", "JCT = first request sent to last response received, tool time included; TTFT = request "
              "sent to first content token (queueing + prefill). Times in seconds.", "",
              "## Summary", "", markdown(SUMMARY_HEAD, summary_rows(results)), "",
              "## Where the time goes", "",
              "Per completed program (mean, seconds): waiting for first tokens (queueing and prefill), "
              "decoding the rest, in tools, and the remainder (the client between turns); then per turn, "
              "with the decode rate one stream saw (tokens after the first over the time after it; "
              "servers that report no usage show -).", "",
              markdown(TIME_HEAD, time_rows(results)), ""]
    for res in results:
        head, rows = turn_rows(res)
        lines += [f"## By turn: {res.get('server', '?')}", "", markdown(head, rows), ""]
    lines += ["## Programs", ""]
    head = ["program", "turns", "JCT", "LLM time", "tool time", "clamp", "error"]
    rows = [[p["program_id"], f"{p['turns_done']}/{p['turns']}", _f(p["jct"]), _f(p["llm_time"]),
             _f(p["tool_time"]), _f(p.get("clamp", 1.0), 3), (p.get("error") or "").replace("|", "/")[:80]]
            for p in r["program_results"]]
    lines += [markdown(head, rows), ""]
    if plots:
        lines += ["## Plots", ""]
        base = Path(path).resolve().parent
        for name, p in plots.items():
            rel = os.path.relpath(Path(p).resolve(), base)
            lines += [f"![{name}]({rel})", ""]
    Path(path).write_text("\n".join(lines), encoding="utf-8")


# ---------------------------------------------------------------------------
# command line


def add_report_parser(subparsers) -> argparse.ArgumentParser:
    """Register `report` (table, plots and Markdown from result JSONs)."""
    p = subparsers.add_parser(
        "report", help="compare replay results: table, JCT CDF, timelines, Markdown",
        description="Read result JSONs of `bench run` (one per server or run) and print the summary "
                    "table; optionally overlay their JCT CDFs and write a Markdown report.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("results", nargs="+", help="result JSON files (`bench run --json`)")
    p.add_argument("--plot", default=None, help="PNG prefix: PREFIX_jct_cdf.png and PREFIX_timeline*.png")
    p.add_argument("--report", default=None, help="write a Markdown report here")
    p.set_defaults(func=cmd_report)
    return p


def write_outputs(results: list[dict], *, plot: str | None = None, report: str | None = None,
                  json_path: str | None = None, json_obj: dict | None = None) -> None:
    """A bench command's --plot, --json (json_obj) and --report, each file written named on stderr."""
    plots = write_plots(results, plot) if plot else {}
    written = list(plots.values())
    if json_path:
        write_json(json_obj, json_path)
        written.append(json_path)
    if report:
        write_markdown(results, report, plots)
        written.append(report)
    for path in written:
        print(f"wrote {path}", file=sys.stderr)


def cmd_report(a) -> int:
    from agentserve.cli_errors import CliError

    results = []
    for path in a.results:
        try:
            results.append(load_result(path))
        except (OSError, ValueError) as e:
            raise CliError(f"{path}: {e}") from None
    print(format_table(results))
    write_outputs(results, plot=a.plot, report=a.report)
    return 0
