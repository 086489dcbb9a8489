"""The `agentserve` command line."""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor

from agentserve.cli_examples import add_examples
from agentserve.argtypes import csv_list, non_negative_ms
from agentserve.cli_bench import add_bench
from agentserve.cli_cluster import add_cluster
from agentserve.cli_errors import CliError
from agentserve.cli_model import add_generate, add_models, add_profile
from agentserve.cli_serve import add_serve

WORKLOADS = ("swebench", "bfcl", "claude-code", "swe-smith")




def _add_sim(sub) -> None:
    from agentserve.cost.profile import list_profiles
    from agentserve.policy.registry import policy_names

    p = sub.add_parser(
        "sim", help="simulate scheduling policies on an agent workload",
        description="Run the real scheduler, KV manager and policies against a calibrated cost model "
                    "(a simulated GPU) on an agent workload, for every policy and arrival rate, and "
                    "print mean/p90/p95 job completion time (JCT), throughput, prefix-hit ratio, p99 "
                    "TTFT, worst queueing time, preemptions and pins.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workload", default="swebench",
                   help=f"one of {', '.join(WORKLOADS)} (generated or from ../shared/traces), or a JSONL trace file")
    p.add_argument("--traces", default=None, help="folder of the recorded traces (default: search ../shared/traces)")
    p.add_argument("--profile", default="llama3.1-8b-h100",
                   help=f"cost profile: {', '.join(list_profiles())}, or a profile JSON file")
    p.add_argument("--policies", type=csv_list(str), default=policy_names(),
                   help=f"comma-separated policies from: {', '.join(policy_names())}; a policy's options "
                        "after colons run an ablation, e.g. agentserve:pressure=off")
    p.add_argument("--rates", type=csv_list(float), default=[0.5], help="comma-separated program arrival rates (jobs/s)")
    p.add_argument("--programs", type=int, default=200, help="programs per run")
    p.add_argument("--seed", type=int, default=0, help="seed for the workload and the arrivals")
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="device KV capacity in tokens of every layer's KV (default: the profile's); the hybrid "
                        "layout has the same bytes")
    p.add_argument("--kv-layout", type=csv_list(str), default=["auto"], metavar="LAYOUT[,LAYOUT]",
                   help="how the KV manager accounts a sliding-window model's KV (a profile whose model has "
                        "num_global_layers and sliding_window, e.g. gemma3-27b-h100): full (every layer's KV of "
                        "every token) or hybrid (a block holds the global layers' KV, the window layers' KV kept "
                        "only while a token can read it), in the same bytes; auto: hybrid where the model has both "
                        "kinds of layer and no disk tier is used (a host tier works with both), as `serve "
                        "--kv-layout`. Comma-separated, e.g. full,hybrid, runs each")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--eviction", default="lru", help="prefix-cache eviction: lru, leaf-lru, lfu, arc")
    p.add_argument("--protected-kv-share", type=float, default=0.0, metavar="S",
                   help="share of the device KV (0 to 0.9) kept for multi-turn programs between turns, evicted after "
                        "every other free block (as `serve --protected-kv-share`; default 0: off)")
    p.add_argument("--host-tier", action="store_true", help="add the profile's host-DRAM KV tier (swap/reload)")
    p.add_argument("--disk-tier", action="store_true",
                   help="add the profile's disk (SSD) KV tier below the host tier, which it implies: blocks the "
                        "host tier evicts are written there and reloaded at the profile's disk bandwidth")
    p.add_argument("--host-kv-tokens", type=int, default=None,
                   help="the host tier's size in tokens instead of the profile's (implies --host-tier; a small host "
                        "tier over a disk tier is the paper's SSD setting)")
    p.add_argument("--disk-kv-bytes", type=float, default=None,
                   help="the disk tier's byte budget instead of the profile's, e.g. 4e11 (implies --disk-tier)")
    p.add_argument("--sync-copies", action="store_true",
                   help="charge the tier copies inside each step (the step waits for them), instead of on a copy "
                        "timeline that overlaps compute, where only a request whose own reloads are in flight waits")
    p.add_argument("--max-num-seqs", type=int, default=None, help="running requests at most (default: profile)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step (default: profile)")
    p.add_argument("--max-step-ms-with-decodes", type=non_negative_ms, default=200.0, metavar="MS",
                   help="while requests decode, cap each step's prompt tokens so that its predicted time "
                        "(learned from the simulated steps) stays under MS a token for the least-served "
                        "decoding request, as `serve` does; 0: no cap, every step may take the whole token "
                        "budget")
    p.add_argument("--token-scale", type=float, default=1.0, help="scale every token count of the workload")
    p.add_argument("--tool-time-scale", type=float, default=1.0,
                   help="scale every tool call's duration (e.g. 30: tools that run for minutes, so most programs "
                        "wait between turns and many pins live at once)")
    p.add_argument("--hang-fraction", type=float, default=0.0,
                   help="fraction of programs whose tool never returns at a random turn (robustness)")
    p.add_argument("--replicas", type=csv_list(int), default=[1],
                   help="comma-separated replica counts, e.g. 1,2,4,8: that many engines, each turn routed at its "
                        "arrival by --router. With replicas, --rates and --programs are per replica (N replicas get "
                        "N x the programs at N x the rate, so each sees the same pressure) and --kv-tokens is the "
                        "total, split evenly (default: the profile's KV for every replica, one GPU each)")
    p.add_argument("--router", type=csv_list(str), default=None,
                   help="comma-separated routers for --replicas: program (program-aware: affinity with load "
                        "escape, KV-load placement), pow2 (Ray Serve's power of two choices), prefix (prefix-cache "
                        "affinity), round-robin (default: program)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="parallel simulations")
    p.add_argument("--json", default=None, help="write the result rows here")
    p.add_argument("--plot", default=None, help="write a PNG of JCT against rate per policy here")
    p.add_argument("--check-integrity-every", type=int, default=0, help="check KV accounting every N steps (slow)")
    p.add_argument("--no-end-program", action="store_true",
                   help="clients never say a program ended (no is_last_turn), as most real clients: programs end "
                        "when the scheduler finds them idle, and the run waits out the idle timeout at the end")
    p.add_argument("--show-state", action="store_true",
                   help="after the table, print per run what the policy learned (eta, each tool's mean duration) "
                        "beside the workload's true values, the per-program state left and the peak running "
                        "requests and pins")
    p.set_defaults(func=cmd_sim)


def build_workload(args, rate: float, programs: int | None = None):
    from agentserve.workload.load import load_workload

    spec = args.workload
    if spec not in WORKLOADS and not os.path.exists(spec):
        raise CliError(f"unknown workload {spec!r}: use one of {', '.join(WORKLOADS)} or a JSONL file path")
    opts = {}
    if args.traces:
        opts["path"] = args.traces
    if args.token_scale != 1.0:
        opts["token_scale"] = args.token_scale
    if args.tool_time_scale != 1.0:
        opts["tool_time_scale"] = args.tool_time_scale
    try:
        programs = load_workload(spec, args.programs if programs is None else programs, rate, args.seed, **opts)
    except (OSError, ValueError) as e:
        raise CliError(str(e)) from None
    if args.hang_fraction > 0:
        from agentserve.sim.robustness import split_hanging
        programs = split_hanging(programs, args.hang_fraction, args.seed)[0]
    return programs


def _run_one(job):
    from agentserve.sim.driver import simulate
    from agentserve.sim.report import result_row

    workload, profile, rate, programs, cfg, cluster = job
    if cluster is not None:
        from agentserve.router.sim_cluster import cluster_row, simulate_cluster

        replicas, router = cluster
        return cluster_row(workload, profile, rate, replicas, simulate_cluster(programs, cfg, replicas, router))
    return result_row(workload, profile, rate, simulate(programs, cfg))


def _run_jobs(args, jobs: list) -> list[dict]:
    """The simulations' rows, in the order of `jobs`, on `--jobs` processes."""
    if args.jobs > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(args.jobs) as ex:
            return list(ex.map(_run_one, jobs))
    return [_run_one(j) for j in jobs]


def cmd_sim(args) -> int:
    from agentserve.cost.profile import ProfileError, load_profile
    from agentserve.policy.registry import parse_policy_spec
    from agentserve.sim.report import format_table, plot, ratio_lines, write_json

    for spec in args.policies:
        try:
            parse_policy_spec(spec)
        except ValueError as e:
            raise CliError(str(e)) from None
    if args.programs < 1:
        raise CliError("--programs must be at least 1")
    if any(r <= 0 for r in args.rates):
        raise CliError("--rates must be positive")
    from agentserve.kv.eviction import STRATEGIES
    if args.eviction not in STRATEGIES:
        raise CliError(f"unknown eviction strategy {args.eviction!r}: choose from {', '.join(STRATEGIES)}")
    if args.block_size < 1 or (args.kv_tokens is not None and args.kv_tokens < args.block_size):
        raise CliError("--block-size must be >= 1 and --kv-tokens at least one block")
    if not 0 <= args.hang_fraction < 1:
        raise CliError("--hang-fraction must be in [0, 1)")
    if args.host_kv_tokens is not None and args.host_kv_tokens < args.block_size:
        raise CliError("--host-kv-tokens must be at least one block")
    if args.disk_kv_bytes is not None and not args.disk_kv_bytes > 0:
        raise CliError("--disk-kv-bytes must be positive")
    if not 0.0 <= args.protected_kv_share <= 0.9:
        raise CliError("--protected-kv-share must be in [0, 0.9]")
    if not args.tool_time_scale > 0:
        raise CliError("--tool-time-scale must be positive")
    try:
        load_profile(args.profile)
    except (ProfileError, OSError) as e:
        raise CliError(str(e)) from None
    layouts = _kv_layouts(args)
    if args.replicas != [1] or args.router is not None:
        if len(layouts) > 1:
            raise CliError("--kv-layout takes one layout with --replicas or --router")
        return _cmd_sim_cluster(args)
    jobs = []
    for rate in args.rates:
        programs = build_workload(args, rate)
        for pol in args.policies:
            for layout in layouts:
                jobs.append((args.workload, args.profile, rate, programs, _sim_config(args, pol, layout), None))
    kv = f" x {len(layouts)} KV layouts" if len(layouts) > 1 else ""
    print(f"simulating {len(jobs)} runs ({len(args.policies)} policies x {len(args.rates)} rates{kv}, "
          f"{args.programs} programs each) on {args.profile} ({', '.join(layouts)} KV)...", file=sys.stderr)
    rows = _run_jobs(args, jobs)
    rows.sort(key=lambda r: (r["rate"], args.policies.index(r["policy"]), layouts.index(r["kv_layout"])))
    print(format_table(rows))
    for line in ratio_lines(rows):
        print(line)
    if args.show_state:
        from agentserve.sim.learned import format_learned, true_values

        truths = {rate: true_values(build_workload(args, rate)) for rate in args.rates}
        for r in rows:
            print(format_learned(r["state"], truths[r["rate"]], f"{r['policy']} at {r['rate']:g}/s"))
    if args.json:
        write_json(rows, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        plot(rows, args.plot, f"{args.workload} on {args.profile}")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _kv_layouts(args) -> list[str]:
    """`--kv-layout`'s layouts as each run will use them (auto resolved), in the
    order given, each once; a layout the profile or the tiers rule out is a CliError."""
    from agentserve.cost.profile import load_profile
    from agentserve.sim.kv_sizing import KV_LAYOUTS, kv_layout

    out = []
    for choice in args.kv_layout:
        if choice not in KV_LAYOUTS:
            raise CliError(f"unknown --kv-layout {choice!r}: choose from {', '.join(KV_LAYOUTS)}")
        try:
            layout = kv_layout(_sim_config(args, "agentserve", choice))
        except ValueError as e:
            raise CliError(str(e)) from None
        if choice == "auto" and layout == "full" and load_profile(args.profile).model.has_hybrid_layout:
            print("--kv-layout auto: the full layout, since a disk tier is set (the hybrid cache has none)",
                  file=sys.stderr)
        if layout not in out:
            out.append(layout)
    return out


def _sim_config(args, policy: str, kv_layout: str | None = None):
    from agentserve.sim.driver import SimConfig

    return SimConfig(profile=args.profile, policy=policy, block_size=args.block_size, eviction=args.eviction,
                     kv_layout=kv_layout or args.kv_layout[0],
                     protected_kv_share=args.protected_kv_share,
                     host_tier=args.host_tier or args.host_kv_tokens is not None,
                     disk_tier=args.disk_tier or args.disk_kv_bytes is not None, kv_tokens=args.kv_tokens,
                     host_kv_tokens=args.host_kv_tokens, disk_kv_bytes=args.disk_kv_bytes,
                     overlap_copies=not args.sync_copies,
                     max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                     max_step_ms_with_decodes=args.max_step_ms_with_decodes,
                     seed=args.seed, check_integrity_every=args.check_integrity_every,
                     end_programs=not args.no_end_program)


def _cmd_sim_cluster(args) -> int:
    """`sim --replicas N,.. --router A,..`: every (replicas, router, policy, rate), per-replica rates and programs."""
    from agentserve.router.registry import router_names
    from agentserve.router.sim_cluster import format_cluster_table
    from agentserve.sim.report import write_json

    routers = args.router or ["program"]
    bad = [r for r in routers if r not in router_names()]
    if bad:
        raise CliError(f"unknown router {bad[0]!r}: choose from {', '.join(router_names())}")
    if any(n < 1 for n in args.replicas):
        raise CliError("--replicas must be at least 1")
    if args.kv_tokens is not None and args.kv_tokens < args.block_size * max(args.replicas):
        raise CliError("--kv-tokens (the total) must give every replica at least one block")
    jobs = []
    for n in args.replicas:
        for rate in args.rates:
            programs = build_workload(args, rate * n, args.programs * n)
            for router in routers:
                for pol in args.policies:
                    jobs.append((args.workload, args.profile, rate, programs, _sim_config(args, pol), (n, router)))
    print(f"simulating {len(jobs)} runs ({len(args.replicas)} replica counts x {len(routers)} routers x "
          f"{len(args.policies)} policies x {len(args.rates)} rates, {args.programs} programs a replica) "
          f"on {args.profile}...", file=sys.stderr)
    rows = _run_jobs(args, jobs)
    print(format_cluster_table(rows))
    if args.json:
        write_json(rows, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="agentserve",
        description="agentserve: LLM serving for agent workloads (program-level scheduling, "
                    "TTL-based KV retention across tool calls).")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    _add_sim(sub)
    add_serve(sub)
    add_cluster(sub)
    add_bench(sub)
    add_generate(sub)
    add_profile(sub)
    add_models(sub)
    add_examples(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not getattr(args, "func", None):
        ap.print_help()
        return 2
    try:
        return args.func(args)
    except CliError as e:
        print(f"agentserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
