"""A replay's results: the summary (JCT percentiles, TTFT, throughput, cached
ratio, errors by kind) over its per-program and per-turn records, and the
JSON file it is written to."""

from __future__ import annotations

import json
import math
import re
import statistics
from typing import Any

from agentserve.workload.trace import percentile

SUMMARY_KEYS = ("server", "workload", "rate", "programs", "mean_jct", "p50_jct", "p90_jct", "p95_jct",
                "mean_ttft", "throughput_jobs_s", "cached_ratio")


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def summarize(turns: list[dict], results: list[dict], meta: dict | None = None) -> dict:
    """The results dict: meta, then SUMMARY_KEYS and more, then per-program
    results (`program_results`) and per-turn records (`turns`), both sorted.

    JCT percentiles, mean TTFT/latency and throughput are over completed
    programs / successful turns; throughput_jobs_s = completed programs /
    (last completion - first request sent); cached_ratio = sum of cached
    tokens / sum of prompt tokens over successful turns."""
    turns = sorted(turns, key=lambda r: (r["program_id"], r["turn"]))
    results = sorted(results, key=lambda r: (r["arrival"], r["program_id"]))
    ok = [t for t in turns if t["error"] is None]
    done = [r for r in results if r["completed"]]
    jct = [r["jct"] for r in done]
    ttft = [t["ttft"] for t in ok]
    returning = [t["ttft"] for t in ok if t["turn"] > 0]  # turns that come back from a tool call
    lat = [t["latency"] for t in ok]
    starts = [r["start"] for r in results if r["start"] is not None]
    ends = [r["end"] for r in done]
    makespan = (max(ends) - min(starts)) if ends and starts else 0.0
    prompt = sum(t["prompt_tokens"] for t in ok)
    cached = sum(t["cached_tokens"] for t in ok)
    errors: dict[str, int] = {}
    for t in turns:
        if t["error"] is not None:
            key = re.sub(r"(?<!HTTP )\b\d+(\.\d+)?", "N", t["error"])[:120]  # group by kind
            errors[key] = errors.get(key, 0) + 1
    out: dict[str, Any] = dict(meta or {})
    out.setdefault("server", "?")
    out.setdefault("workload", "?")
    out.setdefault("rate", float("nan"))
    out.update({
        "programs": len(results), "completed": len(done), "failed": len(results) - len(done),
        "errors": sum(errors.values()), "error_kinds": errors,
        "mean_jct": _mean(jct), "p50_jct": percentile(jct, 50), "p90_jct": percentile(jct, 90),
        "p95_jct": percentile(jct, 95), "p99_jct": percentile(jct, 99),
        "mean_ttft": _mean(ttft), "p50_ttft": percentile(ttft, 50), "p90_ttft": percentile(ttft, 90),
        "p99_ttft": percentile(ttft, 99), "mean_ttft_returning": _mean(returning), "mean_latency": _mean(lat),
        "throughput_jobs_s": len(done) / makespan if makespan > 0 else 0.0, "makespan_s": makespan,
        "cached_ratio": cached / prompt if prompt else 0.0, "turns_sent": len(turns), "turns_ok": len(ok),
        "prompt_tokens": prompt, "cached_tokens": cached,
        "completion_tokens": sum(t["completion_tokens"] for t in ok),
        "clamped_programs": sum(1 for r in results if r.get("clamp", 1.0) < 1.0 or r.get("truncated")),
        "program_results": results, "turns": turns,
    })
    return out


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def write_json(result: dict, path: str) -> None:
    """The results as JSON (NaN/inf written as null)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_jsonable(result), f, indent=1)

