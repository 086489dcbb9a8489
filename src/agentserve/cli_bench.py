"""`agentserve bench`: measuring servers on agent workloads. `run` replays a
workload against any OpenAI-compatible URL; `compare` runs it against
agentserve and its peers in turn; `report` compares result files;
`apc` replays a workload through the KV manager alone and compares eviction
strategies' prefix-cache hit ratios; `agentic` runs the stateful-inference paper's
agent workloads (6-turn bug fix, 35-turn coding, repeated prompts); `burst` runs a
burst of agents sharing a preamble with grouped prefill on and off; `sched` measures
the scheduler's own time a step with many running requests and pins; `soak` runs
misbehaving agent programs for a long time and reports leaks, lost responses and RSS."""

from __future__ import annotations


def add_bench(sub) -> None:
    from agentserve.bench.agentic import add_agentic_parser
    from agentserve.bench.apc_cli import add_apc_parser
    from agentserve.bench.burst_prefill import add_burst_parser
    from agentserve.bench.compare import add_compare_parser
    from agentserve.bench.replay import add_run_parser
    from agentserve.bench.replay_report import add_report_parser
    from agentserve.bench.sched_overhead import add_sched_parser
    from agentserve.bench.soak import add_soak_parser

    p = sub.add_parser("bench", help="benchmark a server on an agent workload (run), or eviction strategies (apc)",
                       description=__doc__.split("\n\n")[0].replace("`agentserve bench`: ", ""))
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    add_run_parser(bsub)
    add_report_parser(bsub)
    add_compare_parser(bsub)
    add_apc_parser(bsub)
    add_agentic_parser(bsub)
    add_burst_parser(bsub)
    add_sched_parser(bsub)
    add_soak_parser(bsub)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
