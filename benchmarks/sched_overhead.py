"""`python -m benchmarks sched`: the scheduler's own time a step when it holds many
requests and pins.

The real scheduler, KV manager and policy, driven by the simulator's executor
and cost model (sim/executor.py), are held at a steady state: `running`
requests decoding, `pins` programs pinned between turns and `waiting` requests
queued behind the running ones. Each finished turn is pinned by the policy (the
turns ask for a long TTL, so the pins outlive the run), and for each finished
turn another pinned program sends its next turn (its history and a delta), so
the counts stay where they were set. The time measured is `schedule()` plus
`update()` per step, as CPU time of the thread (so that other processes on a
busy machine do not count); the simulated GPU's time is not in it. The
collector runs as in the server (`--gc`, engine/gc_policy.py: applied through
the same function once the KV pool is built), so its collections during the
measured steps are in the times: the mean, p99 and max show them.

A policy that does not pin (vllm-fcfs, program-fcfs, autellix) runs the same
steps with the pins it happens to hold (none): its row says so."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

from agentserve.clock import SimClock
from agentserve.cost.cost_model import CostModel
from agentserve.cost.profile import load_profile
from agentserve.engine.gc_policy import ENGINE, POLICIES, GCController, GCPolicy, apply_gc_policy, restore_gc
from agentserve.engine.request import Request
from agentserve.engine.scheduler import Scheduler, SchedulerConfig
from agentserve.kv.manager import KVCacheManager
from agentserve.sim.executor import SimExecutor

DELTA_TOKENS = 96  # the new tokens of a program's next turn (a tool result)
LONG_TTL = 1e6  # the turns' TTL hint: pins outlive the run (a policy caps it at its own maximum)


@dataclass
class OverheadResult:
    policy: str
    gc: str  # the collector's policy (engine/gc_policy.py)
    steps: int
    running: float  # medians over the measured steps
    pins: float
    waiting: float
    mean_us: float  # scheduler time a step (schedule + update), over the measured steps
    median_us: float
    p90_us: float
    p99_us: float
    max_us: float
    schedule_us: float  # the median of schedule() alone


class _Programs:
    """Each program's tokens so far, and its next turn."""

    def __init__(self, programs: int, context: int, output: int, seed: int) -> None:
        self.ids = [f"p{i}" for i in range(programs)]
        self.rng = random.Random(seed)
        self.context, self.output = context, output
        # the clients' copies, as tuples: a client's tokens are no part of the server's heap, so they
        # stay out of the collector's walks (a tuple of ints is untracked at its first collection)
        self.history: dict[str, tuple[int, ...]] = {}
        self.turn: dict[str, int] = {}

    def next_turn(self, pid: str, now: float) -> Request:
        rng = self.rng
        if pid in self.history:
            prompt = [*self.history[pid], *(rng.randrange(1, 50_000) for _ in range(DELTA_TOKENS))]
        else:
            prompt = [rng.randrange(1, 50_000) for _ in range(self.context)]
        k = self.turn.get(pid, 0)
        self.turn[pid] = k + 1
        # outputs of spread lengths, so that turns finish on different steps
        max_tokens = rng.randint(max(1, self.output // 2), self.output * 3 // 2)
        return Request(f"{pid}/{k}", pid, prompt, max_tokens, arrival_time=now, ttl_hint=LONG_TTL)

    def finished(self, req: Request) -> None:
        self.history[req.program_id] = tuple(req.token_ids)


def measure(policy: str, running: int = 256, pins: int = 1000, waiting: int = 32, steps: int = 1000,
            warmup: int = 100, context: int = 2048, output: int = 128, profile: str = "llama3.1-8b-h100",
            block_size: int = 16, seed: int = 0, kv_factor: float = 2.0,
            gc_policy: GCPolicy = ENGINE) -> OverheadResult:
    prof = load_profile(profile)
    cost = CostModel(prof, block_size=block_size)
    clock = SimClock()
    programs = running + pins + waiting
    per_program = context + 2 * output + DELTA_TOKENS * 8 + block_size  # room for a few turns each
    # kv_factor times what the programs need (about 1.2: the cache is full and every new block evicts one)
    kv = KVCacheManager(int(programs * per_program // block_size * kv_factor), block_size)
    sched = Scheduler(SchedulerConfig(max_num_seqs=running, max_num_batched_tokens=max(8192, context * 2),
                                      max_step_ms_with_decodes=None), kv, policy, clock, cost.prefill_time)
    executor = SimExecutor(clock, cost)
    # The collector as the server runs it: its policy applied once the KV pool is built
    # (AsyncEngine.start), full collections when the work runs out and as the busy backstop.
    gc_ctl = apply_gc_policy(gc_policy, clock.now)
    try:
        plan = _Programs(programs, context, output, seed)
        spent, scheduling, state = _run(sched, executor, clock, gc_ctl, plan, random.Random(seed + 1), running,
                                        waiting, warmup + steps)
    finally:
        restore_gc()  # the next policy's run starts from CPython's collector again
    spent, scheduling, state = spent[warmup:], scheduling[warmup:], state[warmup:]
    sched.check_integrity()
    med = statistics.median
    ordered = sorted(spent)
    return OverheadResult(
        policy=policy, gc=gc_policy.name, steps=steps, running=med(s[0] for s in state),
        pins=med(s[1] for s in state), waiting=med(s[2] for s in state), mean_us=statistics.fmean(spent) * 1e6,
        median_us=med(spent) * 1e6, p90_us=ordered[int(0.9 * (len(ordered) - 1))] * 1e6,
        p99_us=ordered[int(0.99 * (len(ordered) - 1))] * 1e6, max_us=ordered[-1] * 1e6,
        schedule_us=med(scheduling) * 1e6)


def _run(sched: Scheduler, executor: SimExecutor, clock: SimClock, gc_ctl: GCController, plan: _Programs,
         rng: random.Random, running: int, waiting: int, steps: int):
    """Set up the steady state, then run `steps` steps of it: each one's scheduler time,
    schedule() time and (running, pins, waiting)."""
    kv = sched.kv
    clock_s = time.thread_time  # CPU time of this thread: what the scheduler spends, not other processes' turns

    def step() -> tuple[float, float, list[Request]]:
        t0 = clock_s()
        out = sched.schedule()
        t1 = clock_s()
        result = executor.execute(out)
        t2 = clock_s()
        done = sched.update(out, result)
        gc_ctl.maybe_collect()  # the engine loop's backstop full collection, if one is due
        return t1 - t0, (t1 - t0) + (clock_s() - t2), done

    # Set up: every program runs one turn (in waves of `running`), which leaves it pinned.
    for i in range(0, len(plan.ids), running):
        for pid in plan.ids[i:i + running]:
            sched.add_request(plan.next_turn(pid, clock.now()))
        while sched.has_work:
            for req in step()[2]:
                plan.finished(req)
        gc_ctl.on_idle()  # the engine ran out of work, as a server's does between bursts
    # The steady state: `running` turns of pinned programs decoding, `waiting` more queued.
    order = [pid for pid in plan.ids if pid in kv.pins] + [pid for pid in plan.ids if pid not in kv.pins]
    rng.shuffle(order)
    for pid in order[:running + waiting]:
        sched.add_request(plan.next_turn(pid, clock.now()))
    free = order[running + waiting:]
    spent, scheduling, state = [], [], []
    for _ in range(steps):
        s_time, total, done = step()
        for req in done:
            plan.finished(req)
            free.append(req.program_id)  # pinned again (or not, if the policy dropped it)
            pid = free.pop(rng.randrange(len(free) - 1)) if len(free) > 1 else req.program_id
            sched.add_request(plan.next_turn(pid, clock.now()))
        spent.append(total)
        scheduling.append(s_time)
        state.append((sched.num_running + len(done), len(kv.pins), sched.num_waiting - len(done)))
    return spent, scheduling, state


def print_table(results: list[OverheadResult]) -> None:
    head = f"{'policy':<12} {'gc':<7} {'running':>7} {'pins':>6} {'waiting':>7} {'mean us':>7} {'median us':>9} " \
           f"{'p90 us':>7} {'p99 us':>7} {'max us':>7} {'schedule us':>11}"
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r.policy:<12} {r.gc:<7} {r.running:>7.0f} {r.pins:>6.0f} {r.waiting:>7.0f} {r.mean_us:>7.0f} "
              f"{r.median_us:>9.0f} {r.p90_us:>7.0f} {r.p99_us:>7.0f} {r.max_us:>7.0f} {r.schedule_us:>11.0f}")


def build_parser() -> argparse.ArgumentParser:
    from agentserve.argtypes import csv_list

    p = argparse.ArgumentParser(prog="python -m benchmarks sched",
                                description=__doc__.split("\n\n")[0].replace("`python -m benchmarks sched`: ", ""))
    p.add_argument("--policies", type=csv_list(str), default=["agentserve", "continuum", "static-ttl", "infercept", "vllm-fcfs"],
                   help="policies to measure (default agentserve,continuum,static-ttl,infercept,vllm-fcfs)")
    p.add_argument("--running", type=int, default=256, help="requests decoding at once (default 256)")
    p.add_argument("--pins", type=int, default=1000, help="programs pinned between turns (default 1000)")
    p.add_argument("--waiting", type=int, default=32, help="requests queued behind the running ones (default 32)")
    p.add_argument("--steps", type=int, default=1000, help="steps measured, after 100 of warm-up (default 1000)")
    p.add_argument("--context", type=int, default=2048, help="tokens of a program's first prompt (default 2048)")
    p.add_argument("--output", type=int, default=128, help="mean tokens a turn decodes (default 128)")
    p.add_argument("--profile", default="llama3.1-8b-h100", help="the simulated GPU's cost profile")
    p.add_argument("--kv-factor", type=float, default=2.0,
                   help="KV blocks as a multiple of what the programs need (default 2: nothing is evicted; "
                        "about 1.2: the cache is full and every new block evicts a cached one)")
    p.add_argument("--gc", choices=sorted(POLICIES), default="engine",
                   help="the collector's policy, as `agentserve serve --gc` takes it (default engine: the "
                        "server's; python: CPython's defaults)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results here")
    return p


def cmd_sched(args) -> int:
    from agentserve.cli_errors import CliError
    from agentserve.policy.registry import policy_names

    unknown = [p for p in args.policies if p not in policy_names()]
    if unknown:
        raise CliError(f"unknown policy {unknown[0]!r}: choose from {', '.join(policy_names())}")
    if min(args.running, args.steps, args.context, args.output) < 1 or args.pins < 0 or args.waiting < 0:
        raise CliError("--running, --steps, --context and --output must be >= 1; --pins and --waiting >= 0")
    if not args.kv_factor >= 1.1:
        raise CliError("--kv-factor must be at least 1.1 (the programs' turns must fit)")
    results = [measure(pol, args.running, args.pins, args.waiting, args.steps, context=args.context,
                       output=args.output, profile=args.profile, seed=args.seed, kv_factor=args.kv_factor,
                       gc_policy=POLICIES[args.gc])
               for pol in args.policies]
    print_table(results)
    if args.json:
        from benchmarks.common import write_run_json
        write_run_json(args, results, args.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import run_main

    return run_main(build_parser(), cmd_sched, argv)


if __name__ == "__main__":
    raise SystemExit(main())
