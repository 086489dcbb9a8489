"""Robustness check: tools that never return must not hurt everyone else.

    python -m agentserve.sim.robustness --workload swebench --rate 0.8 --programs 300

In a fraction of the programs one tool call never returns (its program never
finishes; whatever it pinned must expire). The completed programs' throughput
and JCT are compared with a run of the same workload without those programs."""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import replace

from agentserve.sim.driver import SimConfig, mean, simulate
from agentserve.workload.load import load_workload


def split_hanging(programs, fraction: float, seed: int):
    """(programs with a never-returning tool in `fraction` of them, the others alone)."""
    rng = random.Random(seed ^ 0x5EED)
    hanging, healthy = [], []
    for p in programs:
        if len(p.calls) > 1 and rng.random() < fraction:
            k = rng.randrange(len(p.calls) - 1)
            calls = list(p.calls)
            calls[k] = replace(calls[k], tool_duration=math.inf)
            hanging.append(replace(p, calls=calls))
        else:
            healthy.append(p)
    with_hangs = sorted(hanging + healthy, key=lambda p: p.arrival)
    return with_hangs, healthy


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agentserve.sim.robustness", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="swebench")
    ap.add_argument("--profile", default="llama3.1-8b-h100")
    ap.add_argument("--policies", default="continuum,vllm-fcfs")
    ap.add_argument("--rate", type=float, default=0.8)
    ap.add_argument("--programs", type=int, default=300)
    ap.add_argument("--fraction", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    programs = load_workload(args.workload, args.programs, args.rate, args.seed)
    with_hangs, healthy = split_hanging(programs, args.fraction, args.seed)
    rows = []
    print(f"{len(with_hangs) - len(healthy)} of {len(with_hangs)} programs call a tool that never returns",
          file=sys.stderr)
    print(f"{'policy':12s} {'run':14s} {'done':>9s} {'jobs/s':>7s} {'mean JCT':>9s} {'pins exp':>8s}")
    for pol in args.policies.split(","):
        res = {}
        for name, progs in (("without them", healthy), ("with hangs", with_hangs)):
            r = simulate(progs, SimConfig(profile=args.profile, policy=pol, seed=args.seed))
            res[name] = r
            print(f"{pol:12s} {name:14s} {r.completed:>4d}/{r.programs:<4d} {r.throughput:7.3f} "
                  f"{mean(r.jct):9.1f} {r.pins['expired']:8d}")
        ratio = res["with hangs"].throughput / res["without them"].throughput
        print(f"{pol:12s} throughput with hangs / without: {ratio:.3f}")
        rows.append({"policy": pol, "workload": args.workload, "rate": args.rate, "fraction": args.fraction,
                     "throughput_with": res["with hangs"].throughput,
                     "throughput_without": res["without them"].throughput, "ratio": ratio,
                     "mean_jct_with": mean(res["with hangs"].jct), "mean_jct_without": mean(res["without them"].jct)})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
