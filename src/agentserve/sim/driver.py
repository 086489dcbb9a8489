"""The discrete-event simulator: the real scheduler, KV manager and policy,
driven by a workload, with a cost-model executor and a simulated clock.

Programs arrive at their turn-0 arrival time; each later turn arrives when the
previous response is done plus the tool's duration (a closed loop, as an agent
behaves), so queueing delays push the whole program back, as they do in life.
A tool duration of +inf is a tool that never returns: the program never
completes and whatever it pinned must expire.

With `end_programs` off, clients never say that a program ended (as most do
not on a live server): the last turn is one more turn, and the program ends
only when the scheduler finds it idle. The run then waits out the idle timeout,
so that every program has ended, and reports what the policy learned and what
per-program state is left (`SimResult.state`).

On a profile of a model with sliding-window layers, `kv_layout` chooses how the
KV manager accounts the same device bytes: `full` (every layer's KV of every
token in a block) or `hybrid` (kv/window_parts.py: a block holds the global
layers' KV, num_layers / global_layers times more blocks, and a block's
window-layer KV takes `window_pages` more only while a token can read it), as
`agentserve serve --kv-layout` lays out the runner's cache."""

from __future__ import annotations

import heapq
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from agentserve.workload.tokens import program_token_plan, shared_token_pool
from agentserve.workload.trace import NON_TOOL_NAMES, Program, percentile  # noqa: F401  (re-exported)
from agentserve.clock import SimClock
from agentserve.cost.cost_model import CostModel
from agentserve.cost.profile import load_profile
from agentserve.engine.request import Request
from agentserve.engine.scheduler import Scheduler, SchedulerConfig
from agentserve.kv.manager import KVCacheManager
from agentserve.policy.registry import parse_policy_spec
from agentserve.sim.executor import SimExecutor
from agentserve.sim.kv_sizing import attention_shape, kv_layout, replica_blocks


@dataclass
class SimConfig:
    profile: str = "llama3.1-8b-h100"
    policy: str = "continuum"
    block_size: int = 16
    eviction: str = "lru"
    protected_kv_share: float = 0.0  # share of each replica's device blocks in the protected zone (kv/protected_zone.py)
    host_tier: bool = False  # use the profile's host DRAM tier (swap and reload)
    disk_tier: bool = False  # and the profile's disk tier below it (implies host_tier)
    # tier copies overlap compute on a copy timeline, as the model runner's do (False: they run in the step)
    overlap_copies: bool = True
    kv_tokens: int | None = None  # device KV capacity (in all, split evenly over replicas); default: the profile's per replica
    host_kv_tokens: int | None = None  # the host tier's capacity (with host_tier); default: the profile's
    disk_kv_bytes: float | None = None  # the disk tier's budget (with disk_tier); default: the profile's
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    # the scheduler's step-time target while decodes run (None or 0: off); the server's default
    max_step_ms_with_decodes: float | None = SchedulerConfig.max_step_ms_with_decodes
    seed: int = 0
    # how the KV manager accounts a sliding-window model's KV: auto (hybrid where the profile's model
    # has both global and window layers and no disk tier is used, as `serve`), hybrid or full
    kv_layout: str = "auto"
    check_integrity_every: int = 0  # steps; 0 = only at the end
    end_programs: bool = True  # the last turn says the program ended (False: programs end idle)
    policy_options: dict = field(default_factory=dict)


@dataclass
class SimResult:
    policy: str
    programs: int
    completed: int
    rejected: int
    jct: list[float]
    ttft: list[float]
    queue_times: list[float]
    makespan: float
    steps: int
    preemptions: int
    hit_ratio: float
    sched_overhead_s: float  # mean wall seconds of schedule() + update() per step
    wall_s: float
    pins: dict
    capped_steps: int = 0  # steps whose prefill the step-time target held back
    decode_step_max_s: float = 0.0  # the longest step with decodes running
    decode_step_p99_s: float = 0.0  # p99 of the latest such steps
    state: dict = field(default_factory=dict)  # learned statistics and per-program state left at the end
    tiers: dict = field(default_factory=dict)  # blocks copied between the KV tiers (offloaded, loaded, spilled, ...)
    replicas: list[dict] = field(default_factory=list)  # per replica, when there are several: turns, steps, busy_s, ...
    router: dict = field(default_factory=dict)  # the router's name and counters (several replicas)
    kv_layout: str = "full"  # the KV accounting the run used (full or hybrid)
    kv_blocks: int = 0  # device KV blocks of each replica (hybrid: blocks of the global layers' KV)
    window_parts_evicted: int = 0  # hybrid: window parts evicted for their pages
    # TTFT of the turns whose KV was below the device when they came (reloaded, or prefetched)
    below_ttft: list[float] = field(default_factory=list)
    prefetch: dict = field(default_factory=dict)  # prefetches issued, used, late, wasted, cancelled (engine/prefetch.py)

    @property
    def throughput(self) -> float:
        return self.completed / self.makespan if self.makespan > 0 else 0.0


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


@dataclass(frozen=True)
class Arrival:
    """A turn about to be submitted, as a router sees it (`route` in `simulate`)."""
    program: Program
    turn: int
    prompt: list[int]  # the turn's prompt token ids
    max_tokens: int
    is_last_turn: bool


class SimReplica:
    """One engine of the simulation: its own clock, KV manager, scheduler and
    cost-model executor (a `router.replica_load` reads `scheduler`)."""

    def __init__(self, name: str, cfg: SimConfig, num_blocks: int) -> None:
        profile = load_profile(cfg.profile)
        bs = cfg.block_size
        self.layout = kv_layout(cfg)
        hybrid = {} if self.layout == "full" else {
            "window": profile.model.sliding_window, "window_pages": profile.model.window_pages}
        self.name = name
        self.clock = clock = SimClock()
        host_tier = cfg.host_tier or cfg.disk_tier
        if cfg.host_kv_tokens is not None:
            profile = replace(profile, host_kv_capacity_tokens=cfg.host_kv_tokens)
        if cfg.disk_kv_bytes is not None:
            profile = replace(profile, disk_kv_capacity_bytes=cfg.disk_kv_bytes)
        host_blocks = profile.host_num_blocks(bs) if host_tier else 0
        if host_blocks and self.layout == "hybrid":  # the same bytes in the hybrid layout's smaller blocks
            host_blocks = profile.model.hybrid_num_blocks(profile.host_kv_capacity_tokens, bs)
        disk_blocks = profile.disk_num_blocks(bs) if cfg.disk_tier else 0
        self.kv = kv = KVCacheManager(num_blocks, bs, cfg.eviction, host_blocks, disk_blocks,
                                      protected_blocks=int(cfg.protected_kv_share * num_blocks), **hybrid)
        m = profile.model
        cost = CostModel(profile, block_size=bs, block_share=m.global_layers / m.num_layers if hybrid else 1.0)
        reload_cost = cost.reload_time if host_tier else cost.prefill_time
        self.config = sconf = SchedulerConfig(
            max_num_batched_tokens=cfg.max_num_batched_tokens or profile.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs or profile.max_num_seqs,
            max_step_ms_with_decodes=cfg.max_step_ms_with_decodes, overlap_copies=cfg.overlap_copies,
            attention_shape=attention_shape(profile.model),
        )
        name_, options = parse_policy_spec(cfg.policy)  # a name, or an ablation such as agentserve:pressure=off
        self.scheduler = Scheduler(sconf, kv, name_, clock, reload_cost, {**options, **cfg.policy_options},
                                   prefill_cost=cost.prefill_time, tier_reload=cost.tier_reloads())
        self.executor = SimExecutor(clock, cost, cfg.overlap_copies, host_blocks)
        self.overhead = 0.0  # wall seconds in schedule() + update()
        self.steps = 0
        self.peak_running = self.peak_pins = 0
        self.per_step: list[tuple[int, int, float]] = []  # (running, pins, scheduler seconds) of each step
        self.turns = 0  # turns submitted here

    def wants_at(self, events: list) -> float:
        """When this replica next acts: now if it has work, else at the next arrival (inf: never)."""
        if self.scheduler.has_work:
            return self.clock.now()
        due = self.scheduler.prefetcher.next_due()
        nxt = min(events[0][0] if events else math.inf, math.inf if due is None else due)
        return max(self.clock.now(), nxt)


def simulate(programs: list[Program], cfg: SimConfig, replicas: int = 1,
             route: Callable[[Arrival, list[SimReplica]], int] | None = None) -> SimResult:
    """Run `programs` on `replicas` engines. Each turn goes, at its arrival, to
    the replica `route` picks (default: the first). Every replica keeps its own
    clock; the replica that is furthest behind in simulated time acts next
    (ties: the lowest index), so the engines run side by side and each arrival
    is routed once simulated time has reached it. With one replica this is the
    single-engine loop, step for step."""
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    num_blocks = replica_blocks(cfg, replicas)
    reps = [SimReplica(f"r{k}", cfg, num_blocks) for k in range(replicas)]

    need_shared = max((c.shared_prefix_tokens for p in programs for c in p.calls), default=0)
    shared_pool = shared_token_pool(need_shared, cfg.seed) if need_shared else None
    plans: dict[int, list] = {}
    events: list[tuple[float, int, int, int]] = []  # (time, seq, program index, turn)
    seq = 0
    for i, p in enumerate(programs):
        heapq.heappush(events, (p.arrival, seq, i, 0))
        seq += 1
    first_arrival: dict[int, float] = {}
    jct: list[float] = []
    ttft: list[float] = []
    below_ttft: list[float] = []
    queue_times: list[float] = []
    rejected = 0
    last_finish = 0.0
    by_rid: dict[str, tuple[int, int]] = {}
    wall0 = time.perf_counter()

    def submit(i: int, turn: int, now: float) -> None:
        nonlocal rejected
        p = programs[i]
        if i not in plans:
            plans[i] = program_token_plan(p, cfg.seed, shared_pool=shared_pool)
        prompt, output = plans[i][turn]
        call = p.calls[turn]
        last = cfg.end_programs and turn == len(p.calls) - 1
        rep = reps[0]
        if route is not None:
            rep = reps[route(Arrival(p, turn, prompt, max(1, len(output)), last), reps)]
        rep.clock.advance_to(now)  # an idle replica catches up; a busy one takes it after its step
        now = rep.clock.now()
        req = Request(
            request_id=f"{p.program_id}/{turn}", program_id=p.program_id,
            prompt_token_ids=prompt, max_tokens=max(1, len(output)), arrival_time=now,
            is_last_turn=last, sim_output=output,
        )
        # The simulator knows which tool the scripted output calls; a human or
        # unknown next step is no tool call.
        req.tool_name = call.tool_name if call.tool_name not in NON_TOOL_NAMES else None
        first_arrival.setdefault(i, now)
        try:
            rep.scheduler.add_request(req)
        except ValueError:
            rejected += 1
            plans.pop(i, None)
            return
        rep.turns += 1
        by_rid[req.request_id] = (i, turn)

    while events or any(r.scheduler.has_work for r in reps):
        rep = min(reps, key=lambda r: r.wants_at(events)) if replicas > 1 else reps[0]
        sched, clock, executor, kv = rep.scheduler, rep.clock, rep.executor, rep.kv
        if sched.copies_in_flight:  # the copies that landed by now count (the same path as a server's)
            sched.copies_done(executor.poll_copies())
        now = clock.now()
        while events and events[0][0] <= now:
            _, _, i, turn = heapq.heappop(events)
            submit(i, turn, now)
        due = sched.prefetcher.next_due()  # a prefetch to issue (engine/prefetch.py)
        if not sched.has_work and (due is None or due > now):
            nxt = min(events[0][0] if events else math.inf, math.inf if due is None else due)
            if nxt < math.inf:
                clock.advance_to(nxt)
            continue
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        if out.is_empty:
            wake = [events[0][0]] if events else []
            expiry = kv.pins.next_expiry()
            if expiry is not None and expiry > now:
                wake.append(expiry)
            if due is not None and due > now:
                wake.append(due)
            landing = executor.next_copy_time()  # a request waits for its reloads
            if landing is not None:
                wake.append(max(landing, now))
            if not wake and not sched.has_work:
                continue  # only a prefetch was due, and it is not issued: nothing left to do
            if not wake:
                raise RuntimeError(f"simulation stalled at t={now:.3f}: {sched.num_waiting} waiting, "
                                   f"{sched.num_running} running, {len(kv.pins)} pins")
            clock.advance_to(min(wake))
            continue
        result = executor.execute(out)
        t2 = time.perf_counter()
        finished = sched.update(out, result)
        spent = (t1 - t0) + (time.perf_counter() - t2)
        rep.overhead += spent
        rep.steps += 1
        running = sched.num_running + len(finished)
        rep.peak_running = max(rep.peak_running, running)
        rep.peak_pins = max(rep.peak_pins, len(kv.pins))
        rep.per_step.append((running, len(kv.pins), spent))
        if cfg.check_integrity_every and rep.steps % cfg.check_integrity_every == 0:
            sched.check_integrity()
        for req in finished:
            i, turn = by_rid.pop(req.request_id)
            ttft.append(req.first_token_time - req.arrival_time)
            if req.num_loaded_tokens > 0 or req.prefetch is not None:
                below_ttft.append(ttft[-1])
            queue_times.append(req.queue_time)
            p = programs[i]
            if turn == len(p.calls) - 1:
                jct.append(req.finish_time - first_arrival[i])
                last_finish = max(last_finish, req.finish_time)
                plans.pop(i, None)
            else:
                d = p.calls[turn].tool_duration
                if math.isfinite(d):
                    heapq.heappush(events, (req.finish_time + max(0.0, d), seq, i, turn + 1))
                    seq += 1
    for rep in reps:
        if not cfg.end_programs:  # wait out every pin and then the idle timeout, as a server idles
            rep.clock.advance_to(max([rep.clock.now()] + [pin.expiry for pin in rep.kv.pins.values()]))
            rep.clock.advance(rep.config.program_idle_timeout + 1.0)
            rep.scheduler.schedule()
        rep.scheduler.check_integrity()
    start = min((p.arrival for p in programs), default=0.0)
    result = _result(cfg, reps, programs, jct, ttft, queue_times, rejected, max(0.0, last_finish - start),
                     time.perf_counter() - wall0)
    result.below_ttft = below_ttft
    return result


def _result(cfg: SimConfig, reps: list[SimReplica], programs: list[Program], jct: list[float],
            ttft: list[float], queue_times: list[float], rejected: int, makespan: float, wall: float) -> SimResult:
    """The run's result: one replica's counters as they are, several replicas' summed
    (their per-replica figures under `replicas`)."""
    stats = [r.scheduler.stats for r in reps]
    ex = [r.executor.stats for r in reps]
    steps = sum(r.steps for r in reps)
    hit = sum(s.hit_tokens for s in stats)
    admitted = sum(s.admitted_prompt_tokens for s in stats)
    created = sum(s.pins_created for s in stats)
    if len(reps) == 1:
        rep = reps[0]
        state = dict(_state(rep.scheduler), peak_running=rep.peak_running, peak_pins=rep.peak_pins,
                     **_busiest(rep.per_step, rep.peak_running))
    else:
        state = {"peak_running": max(r.peak_running for r in reps), "peak_pins": max(r.peak_pins for r in reps)}
    result = SimResult(
        policy=cfg.policy, programs=len(programs), completed=len(jct), rejected=rejected,
        jct=jct, ttft=ttft, queue_times=queue_times,
        makespan=makespan, steps=steps, preemptions=sum(s.preemptions for s in stats),
        hit_ratio=hit / admitted if admitted else 0.0,
        sched_overhead_s=sum(r.overhead for r in reps) / steps if steps else 0.0,
        wall_s=wall,
        pins={"created": created, "hit": sum(s.pins_hit for s in stats),
              "expired": sum(s.pins_expired for s in stats), "reclaimed": sum(s.pins_reclaimed for s in stats),
              "released_early": sum(s.pins_released_early for s in stats),
              "mean_ttl": sum(s.ttl_sum for s in stats) / created if created else 0.0},
        capped_steps=sum(s.capped_steps for s in stats), decode_step_max_s=max(s.decode_step_max_s for s in stats),
        decode_step_p99_s=max(s.decode_step_p99_s() for s in stats),
        tiers={"offloaded": sum(e.offloaded_blocks for e in ex), "loaded": sum(e.loaded_blocks for e in ex),
               "spilled": sum(e.spilled_blocks for e in ex), "disk_loaded": sum(e.disk_loaded_blocks for e in ex),
               "staged": sum(e.staged_blocks for e in ex),
               "swapped_turns": sum(s.swapped_turns for s in stats), "onward_turns": sum(s.onward_turns for s in stats),
               "copy_s": sum(e.copy_time for e in ex), "disk_copy_s": sum(e.disk_copy_time for e in ex),
               "spill_waits": sum(e.spill_waits for e in ex),
               "spill_backlog_peak": max(r.executor.backlog.peak for r in reps)},
        state=state, kv_layout=reps[0].layout, kv_blocks=reps[0].kv.num_blocks,
        window_parts_evicted=sum(r.kv.parts.num_evicted for r in reps if r.kv.parts is not None),
        prefetch={k: sum(getattr(s, "prefetch_" + k) for s in stats)
                  for k in ("issued", "blocks", "used", "late", "wasted", "wasted_blocks", "cancelled", "staged",
                            "staged_blocks", "stage_used", "stage_late", "stage_wasted", "stage_wasted_blocks",
                            "stage_cancelled")},
    )
    if len(reps) > 1:
        result.replicas = [{"replica": r.name, "turns": r.turns, "steps": r.steps, "busy_s": e.busy_time,
                            "hit_ratio": s.hit_tokens / s.admitted_prompt_tokens if s.admitted_prompt_tokens else 0.0,
                            "preemptions": s.preemptions} for r, s, e in zip(reps, stats, ex)]
    return result


def _busiest(per_step: list[tuple[int, int, float]], peak_running: int) -> dict:
    """The scheduler's time a step where it has the most to do: the steps with at
    least 90% of the peak of running requests (median, and their pins)."""
    busy = [(pins, spent) for running, pins, spent in per_step if running >= 0.9 * peak_running]
    if not busy:
        return {}
    return {"busy_steps": len(busy), "busy_pins": statistics.median(p for p, _ in busy),
            "busy_sched_us": statistics.median(t for _, t in busy) * 1e6}


def _state(sched: Scheduler) -> dict:
    pol = sched.policy
    stats = pol.tool_stats
    eta = getattr(pol, "eta", None)
    return {
        "programs": len(sched.programs), "pins": len(sched.kv.pins), "pending_tools": stats.pending_count(),
        "eta": eta.value() if eta is not None else None, "eta_programs": len(eta) if eta is not None else 0,
        "tool_means": {t: stats.mean(t) for t in stats.tools()}, "tool_shifts": stats.shifts,
    }
