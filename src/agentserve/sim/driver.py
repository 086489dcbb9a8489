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
per-program state is left (`SimResult.state`)."""

from __future__ import annotations

import heapq
import math
import statistics
import time
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


@dataclass
class SimConfig:
    profile: str = "llama3.1-8b-h100"
    policy: str = "continuum"
    block_size: int = 16
    eviction: str = "lru"
    host_tier: bool = False  # use the profile's host DRAM tier (swap and reload)
    disk_tier: bool = False  # and the profile's disk tier below it (implies host_tier)
    # tier copies overlap compute on a copy timeline, as the model runner's do (False: they run in the step)
    overlap_copies: bool = True
    kv_tokens: int | None = None  # device KV capacity; default: the profile's
    host_kv_tokens: int | None = None  # the host tier's capacity (with host_tier); default: the profile's
    disk_kv_bytes: float | None = None  # the disk tier's budget (with disk_tier); default: the profile's
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    # the scheduler's step-time target while decodes run (None or 0: off); the server's default
    max_step_ms_with_decodes: float | None = SchedulerConfig.max_step_ms_with_decodes
    seed: int = 0
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

    @property
    def throughput(self) -> float:
        return self.completed / self.makespan if self.makespan > 0 else 0.0


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def simulate(programs: list[Program], cfg: SimConfig) -> SimResult:
    profile = load_profile(cfg.profile)
    bs = cfg.block_size
    clock = SimClock()
    num_blocks = (cfg.kv_tokens // bs) if cfg.kv_tokens else profile.num_blocks(bs)
    host_tier = cfg.host_tier or cfg.disk_tier
    if cfg.host_kv_tokens is not None:
        profile = replace(profile, host_kv_capacity_tokens=cfg.host_kv_tokens)
    if cfg.disk_kv_bytes is not None:
        profile = replace(profile, disk_kv_capacity_bytes=cfg.disk_kv_bytes)
    host_blocks = profile.host_num_blocks(bs) if host_tier else 0
    disk_blocks = profile.disk_num_blocks(bs) if cfg.disk_tier else 0
    kv = KVCacheManager(num_blocks, bs, cfg.eviction, host_blocks, disk_blocks)
    cost = CostModel(profile, block_size=bs)
    reload_cost = cost.reload_time if host_tier else cost.prefill_time
    sconf = SchedulerConfig(
        max_num_batched_tokens=cfg.max_num_batched_tokens or profile.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs or profile.max_num_seqs,
        max_step_ms_with_decodes=cfg.max_step_ms_with_decodes, overlap_copies=cfg.overlap_copies,
    )
    name, options = parse_policy_spec(cfg.policy)  # a name, or an ablation such as agentserve:pressure=off
    sched = Scheduler(sconf, kv, name, clock, reload_cost, {**options, **cfg.policy_options},
                      prefill_cost=cost.prefill_time, tier_reload=cost.tier_reloads())
    executor = SimExecutor(clock, cost, cfg.overlap_copies)

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
    queue_times: list[float] = []
    rejected = 0
    overhead = 0.0
    steps = 0
    peak_running = peak_pins = 0
    per_step: list[tuple[int, int, float]] = []  # (running, pins, scheduler seconds) of each step
    last_finish = 0.0
    by_rid: dict[str, tuple[int, int]] = {}
    wall0 = time.perf_counter()

    def submit(i: int, turn: int) -> None:
        nonlocal rejected
        p = programs[i]
        if i not in plans:
            plans[i] = program_token_plan(p, cfg.seed, shared_pool=shared_pool)
        prompt, output = plans[i][turn]
        call = p.calls[turn]
        now = clock.now()
        req = Request(
            request_id=f"{p.program_id}/{turn}", program_id=p.program_id,
            prompt_token_ids=prompt, max_tokens=max(1, len(output)), arrival_time=now,
            is_last_turn=cfg.end_programs and turn == len(p.calls) - 1, sim_output=output,
        )
        # The simulator knows which tool the scripted output calls; a human or
        # unknown next step is no tool call.
        req.tool_name = call.tool_name if call.tool_name not in NON_TOOL_NAMES else None
        first_arrival.setdefault(i, now)
        try:
            sched.add_request(req)
        except ValueError:
            rejected += 1
            plans.pop(i, None)
            return
        by_rid[req.request_id] = (i, turn)

    while events or sched.has_work:
        if sched.copies_in_flight:  # the copies that landed by now count (the same path as a server's)
            sched.copies_done(executor.poll_copies())
        now = clock.now()
        while events and events[0][0] <= now:
            _, _, i, turn = heapq.heappop(events)
            submit(i, turn)
        if not sched.has_work:
            if events:
                clock.advance_to(events[0][0])
            continue
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        if out.is_empty:
            wake = [events[0][0]] if events else []
            expiry = kv.pins.next_expiry()
            if expiry is not None and expiry > now:
                wake.append(expiry)
            landing = executor.next_copy_time()  # a request waits for its reloads
            if landing is not None:
                wake.append(max(landing, now))
            if not wake:
                raise RuntimeError(f"simulation stalled at t={now:.3f}: {sched.num_waiting} waiting, "
                                   f"{sched.num_running} running, {len(kv.pins)} pins")
            clock.advance_to(min(wake))
            continue
        result = executor.execute(out)
        t2 = time.perf_counter()
        finished = sched.update(out, result)
        spent = (t1 - t0) + (time.perf_counter() - t2)
        overhead += spent
        steps += 1
        running = sched.num_running + len(finished)
        peak_running = max(peak_running, running)
        peak_pins = max(peak_pins, len(kv.pins))
        per_step.append((running, len(kv.pins), spent))
        if cfg.check_integrity_every and steps % cfg.check_integrity_every == 0:
            sched.check_integrity()
        for req in finished:
            i, turn = by_rid.pop(req.request_id)
            ttft.append(req.first_token_time - req.arrival_time)
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
    if not cfg.end_programs:  # wait out every pin and then the idle timeout, as a server idles
        clock.advance_to(max([clock.now()] + [pin.expiry for pin in kv.pins.values()]))
        clock.advance(sconf.program_idle_timeout + 1.0)
        sched.schedule()
    sched.check_integrity()
    st = sched.stats
    start = min((p.arrival for p in programs), default=0.0)
    return SimResult(
        policy=cfg.policy, programs=len(programs), completed=len(jct), rejected=rejected,
        jct=jct, ttft=ttft, queue_times=queue_times,
        makespan=max(0.0, last_finish - start), steps=steps, preemptions=st.preemptions,
        hit_ratio=st.hit_tokens / st.admitted_prompt_tokens if st.admitted_prompt_tokens else 0.0,
        sched_overhead_s=overhead / steps if steps else 0.0,
        wall_s=time.perf_counter() - wall0,
        pins={"created": st.pins_created, "hit": st.pins_hit, "expired": st.pins_expired,
              "reclaimed": st.pins_reclaimed, "released_early": st.pins_released_early,
              "mean_ttl": st.ttl_sum / st.pins_created if st.pins_created else 0.0},
        capped_steps=st.capped_steps, decode_step_max_s=st.decode_step_max_s,
        decode_step_p99_s=st.decode_step_p99_s(),
        tiers={"offloaded": executor.stats.offloaded_blocks, "loaded": executor.stats.loaded_blocks,
               "spilled": executor.stats.spilled_blocks, "disk_loaded": executor.stats.disk_loaded_blocks,
               "swapped_turns": st.swapped_turns, "onward_turns": st.onward_turns, "copy_s": executor.stats.copy_time},
        state=dict(_state(sched), peak_running=peak_running, peak_pins=peak_pins, **_busiest(per_step, peak_running)),
    )


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
