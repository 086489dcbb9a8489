"""`agentserve bench`: measuring servers on agent workloads. `run` replays a
workload against any OpenAI-compatible URL; `compare` runs it against
agentserve and its peers in turn; `report` compares result files. The
research measurements (the paper's agent workloads, grouped prefill on a
burst, the scheduler's time a step, a long soak, the runner's speed, eviction
strategies' prefix-cache hit ratios, ...) are `python -m benchmarks NAME` in
the repository."""

from __future__ import annotations


def add_bench(sub) -> None:
    from agentserve.bench.compare import add_compare_parser
    from agentserve.bench.replay import add_run_parser
    from agentserve.bench.replay_report import add_report_parser

    p = sub.add_parser("bench", help="benchmark a server on an agent workload (run, compare, report)",
                       description=__doc__.split("\n\n")[0].replace("`agentserve bench`: ", ""))
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    add_run_parser(bsub)
    add_report_parser(bsub)
    add_compare_parser(bsub)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
