"""Figures and tables of `python -m benchmarks agentic` (results of benchmarks/fastpath.py).

Novel workloads, per server: median per-turn latency (the paper's metric) and
its ratio to the reference server, p90, median TTFT, output tokens per turn
(so the reader sees that the servers decoded comparable amounts: stops are
natural), the share of turns whose reply made the expected call, end-to-end
wall time per run, prefix-cache hits, and from the server's counters:

* forward passes per output token = engine steps that decoded
  (`agentserve:engine_decode_steps`) / output tokens generated
  (`agentserve:generation_tokens`), both as deltas over the measured runs.
  A request's first token comes from its prefill step, so without speculation
  this is (m-1)/m for m-token replies, just under 1; at --concurrency > 1 the
  requests share steps and the figure is per batch, not per sequence. Every
  turn of bugfix6 is a tool-call turn, so its figure is the tool-call figure.
* tokens saved by early stop: the delta of a counter named *early_stop* with
  *saved* (or *tokens*) in its name, also as a share of generated + saved;
  agentserve counts the max_tokens left when early stops ended requests
  (`tool_call_early_stop_budget_left`), an upper bound, shown as "<=".
  Beside it the number of early stops (*early_stop* without *token*).
* speculation acceptance: accepted / drafted, from counters named *accept*
  and *draft* (or *propos*).
* response-cache hits: *response_cache*...*hit*.
Counters are found by these name fragments, so the report works with whatever
a server exports (vLLM's `vllm:*` names too) and picks up new ones; every
delta whose name holds spec/draft/accept/early_stop/response_cache/steps/
generation_tokens is kept in the JSON."""

from __future__ import annotations

import math
import statistics
from typing import Any

from agentserve.workload.trace import percentile
from agentserve.text_table import aligned

REFERENCE = "agentserve-continuum"
KEYWORDS = ("spec", "draft", "accept", "early_stop", "response_cache", "generation_tokens", "steps",
            "prompt_tokens", "prefix_hit", "prefix_cache")
NAN = float("nan")


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else NAN


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else NAN


def _div(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b else NAN


def find_counter(deltas: dict[str, float], *parts: str, exclude: tuple[str, ...] = ()) -> str | None:
    """The first counter (agentserve's before others', then by name) whose
    lower-cased name holds every part and none of `exclude`."""
    names = sorted(deltas, key=lambda n: (not n.startswith("agentserve:"), n))
    for name in names:
        low = name.lower()
        if all(p in low for p in parts) and not any(x in low for x in exclude):
            return name
    return None


def fastpath_metrics(deltas: dict[str, float], client_output_tokens: int) -> dict[str, Any]:
    """Ratios from counter deltas (see the module doc); NaN where a counter is missing."""
    gen = find_counter(deltas, "generation_tokens")
    tokens = deltas[gen] if gen else float(client_output_tokens)
    steps = find_counter(deltas, "decode_steps")
    saved = (find_counter(deltas, "early_stop", "saved") or find_counter(deltas, "early_stop", "budget") or
             find_counter(deltas, "early_stop", "token", exclude=("grace",)))
    stops = find_counter(deltas, "early_stops") or find_counter(
        deltas, "early_stop", exclude=("token", "grace", "saved", "budget", "left"))
    accepted = find_counter(deltas, "accept", "token") or find_counter(deltas, "accept", exclude=("rate",))
    drafted = (find_counter(deltas, "draft", "token", exclude=("accept",)) or
               find_counter(deltas, "draft", exclude=("accept", "rate")) or
               find_counter(deltas, "propos", exclude=("accept",)))
    hits = find_counter(deltas, "response_cache", "hit")
    saved_n = deltas[saved] if saved else None
    return {
        "output_tokens_counted": tokens, "output_tokens_source": gen or "client usage",
        "decode_steps": deltas[steps] if steps else None,
        "passes_per_output_token": _div(deltas[steps] if steps else None, tokens),
        "early_stop_saved_tokens": saved_n,
        "early_stop_saved_share": _div(saved_n, (tokens + saved_n) if saved_n is not None else None),
        "early_stop_saved_is_bound": bool(saved and "budget" in saved.lower()),
        "early_stops": deltas[stops] if stops else None,
        "spec_accepted": deltas[accepted] if accepted else None, "spec_drafted": deltas[drafted] if drafted else None,
        "spec_acceptance": _div(deltas[accepted] if accepted else None, deltas[drafted] if drafted else None),
        "response_cache_hits": deltas[hits] if hits else None,
        "counter_names": {"decode_steps": steps, "early_stop_saved": saved, "early_stops": stops,
                          "spec_accepted": accepted,
                          "spec_drafted": drafted, "response_cache_hits": hits},
        "counters_of_interest": {k: v for k, v in deltas.items() if any(w in k.lower() for w in KEYWORDS)},
    }


def _turn_stats(turns: list[dict]) -> dict[str, Any]:
    ok = [t for t in turns if t["error"] is None]
    lat = [t["latency"] for t in ok]
    tool_turns = [t for t in ok if t["expected_tool"] is not None]
    prompt = sum(t["prompt_tokens"] for t in ok)
    finish: dict[str, int] = {}
    for t in ok:
        finish[str(t["finish_reason"])] = finish.get(str(t["finish_reason"]), 0) + 1
    return {
        "turns": len(turns), "turns_ok": len(ok), "errors": len(turns) - len(ok),
        "median_latency": _median(lat), "p90_latency": percentile(lat, 90), "mean_latency": _mean(lat),
        "median_ttft": _median([t["ttft"] for t in ok]),
        "output_tokens": sum(t["completion_tokens"] for t in ok),
        "mean_output_tokens": _mean([t["completion_tokens"] for t in ok]),
        "median_output_tokens": _median([t["completion_tokens"] for t in ok]),
        "mean_prompt_tokens": _mean([t["prompt_tokens"] for t in ok]),
        "cached_ratio": sum(t["cached_tokens"] for t in ok) / prompt if prompt else 0.0,
        "call_rate": _div(sum(1 for t in tool_turns if t["calls"]), len(tool_turns)),
        "call_ok_rate": _div(sum(1 for t in tool_turns if t["call_ok"]), len(tool_turns)),
        "finish_reasons": finish,
    }


def summarize_novel(res: dict) -> dict[str, Any]:
    """One row of figures for a novel-workload result."""
    st = _turn_stats(res["turns"])
    runs = res["runs"]
    whole = [r["wall_s"] for r in runs if r["error"] is None and not r["context_full"] and r["wall_s"] is not None]
    row = {"server": res["server"], "workload": res["workload"], "runs": len(runs),
           "runs_completed": len(whole), "runs_context_full": sum(1 for r in runs if r["context_full"]),
           **st, "median_run_wall_s": _median(whole), "mean_run_wall_s": _mean(whole), "wall_s": res.get("wall_s")}
    row.update({k: v for k, v in fastpath_metrics(res.get("counters") or {}, st["output_tokens"]).items()})
    return row


def with_ratios(rows: list[dict]) -> list[dict]:
    """Adds `vs_reference`: median latency / the reference server's (agentserve-continuum, else the first row)."""
    ref = next((r for r in rows if r["server"] == REFERENCE), rows[0] if rows else None)
    for r in rows:
        r["reference"] = ref["server"] if ref else None
        r["vs_reference"] = _div(r["median_latency"], ref["median_latency"] if ref else None)
    return rows


def per_turn_index(res: dict, group: int = 1) -> list[dict]:
    """Median latency and output tokens by turn index (turns grouped `group` at a time)."""
    by: dict[int, list[dict]] = {}
    for t in res["turns"]:
        if t["error"] is None:
            by.setdefault(t["turn"] // group, []).append(t)
    return [{"turns": f"{g * group + 1}" if group == 1 else f"{g * group + 1}-{g * group + group}",
             "median_latency": _median([t["latency"] for t in ts]),
             "median_output_tokens": _median([t["completion_tokens"] for t in ts]),
             "median_prompt_tokens": _median([t["prompt_tokens"] for t in ts]), "n": len(ts)}
            for g, ts in sorted(by.items())]


def summarize_repeat(res: dict) -> list[dict]:
    rows = []
    for pattern, p in res["patterns"].items():
        ok = [t for t in p["turns"] if t["error"] is None]
        cold = [t["latency"] for t in ok if t["pass"] == 0]
        warm = [t["latency"] for t in ok if t["pass"] > 0]
        prompt = sum(t["prompt_tokens"] for t in ok if t["pass"] > 0)
        hits = find_counter(p["counters"], "response_cache", "hit")
        rows.append({"pattern": pattern, "server": res["server"], "requests": len(p["turns"]),
                     "errors": len(p["turns"]) - len(ok), "cold_median_latency": _median(cold),
                     "repeat_median_latency": _median(warm), "repeat_p90_latency": percentile(warm, 90),
                     "repeat_vs_cold": _div(_median(warm), _median(cold)),
                     "response_cache_hits": p["counters"][hits] if hits else None,
                     "repeat_cached_ratio": sum(t["cached_tokens"] for t in ok if t["pass"] > 0) / prompt
                     if prompt else 0.0,
                     "counters_of_interest": {k: v for k, v in p["counters"].items()
                                              if any(w in k.lower() for w in KEYWORDS)}})
    return rows


# ---------------------------------------------------------------------------
# text


def _ms(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{1000 * x:.0f}"


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _pct(x: float | None) -> str:
    return _f(None if x is None else 100 * x, "{:.0f}%")


def text_table(head: list[str], rows: list[list[str]]) -> str:
    return aligned([head] + rows, left=0, rule=False)


NOVEL_HEAD = ["server", "runs", "turns", "median ms/turn", "p90 ms", "median TTFT ms", "out tok/turn",
              "calls made", "valid calls", "run wall s", "cached %", "passes/out tok", "early-stop saved",
              "spec accept", "median / ref"]


def novel_table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        saved, stops = r["early_stop_saved_tokens"], r["early_stops"]
        bound = "<=" if r["early_stop_saved_is_bound"] else ""
        out.append([r["server"], f"{r['runs_completed']}/{r['runs']}", f"{r['turns_ok']}/{r['turns']}",
                    _ms(r["median_latency"]), _ms(r["p90_latency"]), _ms(r["median_ttft"]),
                    _f(r["mean_output_tokens"], "{:.1f}"), _pct(r["call_rate"]), _pct(r["call_ok_rate"]),
                    _f(r["median_run_wall_s"], "{:.1f}"), _pct(r["cached_ratio"]),
                    _f(r["passes_per_output_token"], "{:.3f}"),
                    "-" if saved is None else f"{bound}{saved:.0f} ({_pct(r['early_stop_saved_share'])})"
                    + ("" if stops is None else f", {stops:.0f} stops"),
                    _pct(r["spec_acceptance"]), _f(r["vs_reference"], "{:.2f}x")])
    return text_table(NOVEL_HEAD, out)


def turn_index_table(results: list[dict], group: int = 1) -> str:
    """Median ms and output tokens by turn index, one column pair per server."""
    cols = [(r["server"], {x["turns"]: x for x in per_turn_index(r, group)}) for r in results]
    keys = list(dict.fromkeys(k for _, d in cols for k in d))
    head = ["turn"] + [h for name, _ in cols for h in (f"{name} ms", "out tok")]
    def cells(d: dict, k: str) -> tuple[str, str]:
        return (_ms(d[k]["median_latency"]), _f(d[k]["median_output_tokens"], "{:.0f}")) if k in d else ("-", "-")

    rows = [[k] + [v for _, d in cols for v in cells(d, k)] for k in keys]
    return text_table(head, rows)


REPEAT_HEAD = ["pattern", "server", "requests", "cold median ms", "repeat median ms", "repeat p90 ms",
               "repeat / cold", "response-cache hits", "cached prompt %"]


def repeat_table(rows: list[dict]) -> str:
    return text_table(REPEAT_HEAD, [[r["pattern"], r["server"], f"{r['requests'] - r['errors']}/{r['requests']}",
                                     _ms(r["cold_median_latency"]), _ms(r["repeat_median_latency"]),
                                     _ms(r["repeat_p90_latency"]), _f(r["repeat_vs_cold"], "{:.3f}x"),
                                     _f(r["response_cache_hits"], "{:.0f}"), _pct(r["repeat_cached_ratio"])]
                                    for r in rows])
