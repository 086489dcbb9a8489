"""agentserve's own policy: Continuum's order, admission headroom and Eq. 2
TTLs, with two changes to what Eq. 2 weighs.

The cost of a pinned second. Eq. 2 charges a pin one second per second held
because, the paper assumes, some request is always waiting for that memory.
When nothing waits, a pin delays nobody and the best TTL is the one that
catches the tool's return. So the cost is the share of recent time the
scheduler held a request back for KV (policy/pressure.py), floored at
`min_pin_cost` so that a TTL stays finite: at low load this pins until the
slowest recorded duration of the tool (InferCept's behaviour, which wins
there), under pressure it is Continuum's.

The cost of a miss, by tier. Unpinned KV is not lost where tiers lie below
the device: an evicted block is copied to host memory, and one the host evicts
to disk. What a miss costs is the reload from the nearest tier whose copies
last longer than the tool is expected to run (each tier's turnover, measured),
or the prefill when none does. That is the B of Eq. 2, and it picks where a
turn's KV goes when it is not pinned: left on the device to be spilled to host
memory on eviction, or, for a wait the host tier will not outlast but the disk
tier will, copied out now and first in line for the disk ("disk").

And a longer age credit: a program earns up to 50 s of seniority over later
arrivals, not 15 (Continuum's), where a turn kept waiting loses KV that must
be prefilled again. Keeping programs that are under way ahead finishes them
sooner; the 50 s bound keeps newcomers' p99 TTFT within 2x of request-level
FCFS's on the README's workloads without tiers (60 s did not, at one point).

Where a host tier keeps evicted KV, the order is the programs' own (no cap on
seniority: a program's turns come back fast and most of a program's wait is
spent by its later turns, so finishing those first pays most), bounded by a
wait instead (`wait_bound`): no request waits more than 2x the p90 of the
waits FCFS would give here (policy/fcfs_wait.py, measured live) before it goes
first. Under a standing queue FCFS's p90 is near its p99, so the bound lets
programs under way keep ahead for longest where it pays; under light, bursty
load its p90 is far below its p99 and the bound keeps newcomers close to
FCFS. Each request's deadline is fixed when it arrives. The capped credit
used before could not meet both bounds: the seniority it capped cost every
later turn its place, and newcomers still waited the longest.

With a host tier a late request goes first but still waits for the decode
headroom (`skips_headroom`). Admitted without it, it took the room the running
requests decode into and was the first victim of the preemption that followed,
back in the queue without its deadline: every one of the 59 preemptions at
host BFCL 0.5 jobs/s, seed 7, in the simulator was such a request, 48 of them
before their first token.

And while the KV is not what holds requests back (the pressure below
`short_first`, 0.5), the queue is one for compute, where the shortest job
first gives the least waiting: among waiting turns alike in lateness,
preemption and pin, the one with the fewest new tokens (its prompt past its
program's last turn) goes first. Under KV pressure the programs' own order
stands, since it is what keeps the KV of programs under way. On BFCL, whose
tool outputs make later turns add 4.3k tokens on average against a first
turn's 2k, this lets newcomers and short turns past long ones.

Room for programs between turns, where the cache is large enough to keep
some. Under overload the running requests take the whole cache and every
program that goes to its tool loses its KV, so a turn that comes back
re-prefills its whole context (SWE-bench at 1 job/s in the simulator: running
requests held ~97% of the KV, 71% of prompt tokens hit). So the running
requests' blocks and headroom stay within `running_share` (0.95) of the KV when
more than one runs; a request held back only by that is not KV pressure, so
the pin cost falls and Eq. 2 pins longer, filling the rest with programs that
come back. The share applies only where the rest holds at least one program's
context as programs have held them at their turns' ends (measured; nothing
before the first turn ends; let go once that mean is 10% past the room) and
no host tier lies below: room for less than a program would only slow the
running batch (a 16k-token cache on this CPU
holds two 8k-token SWE-bench programs: the share lost there, 567 s against
262 s, when it applied everywhere), and with a host tier a program between
turns loses only a reload. Newcomers pay with their wait, so while the share
applies a request that has waited `deadline` seconds (50) goes first, ahead
of pinned programs' turns, may reclaim any pin, and is held back only for KV:
no request waits much longer than the deadline for its first token.

And an ended program's own KV goes first: a program's last turn (or its end
between turns) sends the blocks that only its chain holds to the cold end of
eviction (`retire`), where vLLM, and Continuum on it, free them as the newest.

And where a tier lies below, a program whose KV went down to it during its
tool call gets it reloaded before its next turn is likely to come back
(`prefetch`, engine/prefetch.py): when, is chosen at the turn's end from the
tool's learned durations and the reload time from the tier its KV is expected
in (the nearest that keeps a copy as long as the tool runs), weighing the
wait saved against device memory taken early at the pressure-weighted cost of
a pinned second (policy/prefetch.py).

Each part can be turned off (`pressure=off`, `tiers=off`, `age_credit=15`,
`wait_bound=none` (with a host tier: the 50 s credit instead), `eta=1`,
`retire=off`, `running_share=1`, `deadline=none`, `short_first=none`,
`prefetch=off`) for the ablations in the README. `stage=on` stages a prefetch
from disk through the host tier (off: in the simulator every stage landed
late, behind the turns' own disk reads, see docs/simulator.md)."""

from __future__ import annotations

import logging

from agentserve.policy.base import PolicyContext, Retention, register
from agentserve.policy.decision_log import TTLInputs
from agentserve.policy.fcfs_wait import FcfsWait
from agentserve.policy.policies.continuum import Continuum
from agentserve.policy.prefetch import PrefetchPlan, prefetch_start, stage_start
from agentserve.policy.tool_stats import NO_TOOL_CALL

log = logging.getLogger("agentserve.policy")
_STOP_MARGIN = 1.1
# The quantile of FCFS's waits the wait bound multiplies: near its p99 under a standing
# queue, far below it under light bursty load (2x gives 1.7x and 1.1x of its p99 there).
_FCFS_QUANTILE = 0.9


@register
class AgentServe(Continuum):
    name = "agentserve"

    def __init__(self, ctx: PolicyContext, pressure: bool = True, min_pin_cost: float = 0.05,
                 tiers: bool = True, eta: float | None = None, age_credit: float | None = 50.0,
                 wait_bound: float | None = 2.0, retire: bool = True,
                 running_share: float = 0.95, deadline: float | None = 50.0,
                 short_first: float | None = 0.5, prefetch: bool = True, stage: bool = False,
                 **options) -> None:
        super().__init__(ctx, age_credit=age_credit, **options)
        if not 0.0 < min_pin_cost <= 1.0:
            raise ValueError(f"min_pin_cost must be in (0, 1], got {min_pin_cost!r}")
        if wait_bound is not None and (isinstance(wait_bound, bool) or not wait_bound > 0.0):
            raise ValueError(f"wait_bound must be a number > 0 (or none), got {wait_bound!r}")
        self.wait_bound = wait_bound
        self.fcfs_wait = FcfsWait()
        self._deadlines: dict[str, float] = {}  # waiting requests' wait-bound deadlines, by request id
        self._bound_logged = False
        if not isinstance(retire, bool):
            raise ValueError(f"retire must be on or off, got {retire!r}")
        self.retire_ended = retire
        if not 0.0 < running_share <= 1.0:
            raise ValueError(f"running_share must be in (0, 1], got {running_share!r}")
        self.running_share = running_share
        if deadline is not None and not deadline > 0.0:
            raise ValueError(f"deadline must be > 0 seconds (or none), got {deadline!r}")
        self.deadline = deadline
        if short_first is not None and (isinstance(short_first, bool) or not 0.0 < short_first <= 1.0):
            raise ValueError(f"short_first must be a KV pressure in (0, 1] (or none), got {short_first!r}")
        self.short_first = short_first
        if not isinstance(prefetch, bool):
            raise ValueError(f"prefetch must be on or off, got {prefetch!r}")
        self.prefetch = prefetch
        if not isinstance(stage, bool):
            raise ValueError(f"stage must be on or off, got {stage!r}")
        self.stage = stage
        self.pressure = pressure
        self.min_pin_cost = min_pin_cost
        self.tiers = tiers
        self.fixed_eta = eta
        self._turn_ends = 0  # non-final turns ended, and the KV tokens they held then
        self._turn_end_tokens = 0
        self._share_applies = False

    def on_turn_end(self, req, program, now):
        self._turn_ends += 1
        self._turn_end_tokens += req.num_computed_tokens
        self._review_share()
        return super().on_turn_end(req, program, now)

    def _review_share(self) -> None:
        """The share applies where what it leaves holds a program between turns
        (their mean context at a turn's end) and no host tier lies below."""
        share, ctx = self.running_share, self.ctx
        room = (1.0 - share) * ctx.kv_tokens
        mean = self._turn_end_tokens / self._turn_ends
        # stopping takes a mean 10% past the room: a mean that grows across it does not flap
        limit = room * (_STOP_MARGIN if self._share_applies else 1.0)
        applies = share < 1.0 and not ctx.host_tier and 0 < room and mean <= limit
        if applies != self._share_applies:
            self._share_applies = applies
            log.info("%s %.0f%% of the KV (%d tokens) for programs between turns: their mean context is %d "
                     "tokens", "keeping" if applies else "no longer keeping", 100 * (1.0 - share), room, mean)

    @property
    def bounded(self) -> bool:
        """The order is the programs' own, bounded by the wait bound: where a host tier lies below."""
        return self.wait_bound is not None and self.ctx.host_tier

    def credit(self, req) -> float | None:
        """No cap on seniority where the wait bound applies; else the age credit."""
        return None if self.bounded else self.age_credit

    def max_wait(self) -> float | None:
        """The wait bound for a request arriving now (None until FCFS's waits are
        measured), or the deadline while the share applies."""
        if self.bounded:
            q = self.fcfs_wait.quantile(_FCFS_QUANTILE)
            return None if q is None else self.wait_bound * q
        return self.deadline if self._share_applies else None

    def on_arrival(self, req, program, now):
        super().on_arrival(req, program, now)
        if self.bounded:
            self.fcfs_wait.arrive(req.arrival_time)
            wait = self.max_wait()
            if wait is not None:
                if not self._bound_logged:
                    self._bound_logged = True
                    log.info("wait bound from now on: a request waits at most %.1f s before it goes first (2x the "
                             "p90 of FCFS's waits here, %d requests measured; /metrics agentserve:max_wait_seconds "
                             "follows it)", wait, len(self.fcfs_wait))
                self._deadlines[req.request_id] = req.arrival_time + wait

    def on_admitted(self, req, program, now, queue_delay, returning_evicted):
        super().on_admitted(req, program, now, queue_delay, returning_evicted)
        if self.bounded:
            self.fcfs_wait.admit(now)
            self._deadlines.pop(req.request_id, None)

    def on_withdrawn(self, req, now):
        if self.bounded:
            self.fcfs_wait.withdraw()
            self._deadlines.pop(req.request_id, None)

    @property
    def running_kv_share(self) -> float:
        return self.running_share if self._share_applies else 1.0

    @property
    def time_dependent(self) -> bool:
        """A waiting request can turn late as time passes: while the share applies, or
        a request waits with a wait-bound deadline; and the order follows the KV
        pressure where the shortest turn may go first."""
        return (self._share_applies and self.deadline is not None) or bool(self._deadlines) \
            or (self.short_first is not None and self.bounded)

    def late(self, req, now) -> bool:
        """Waited past the deadline while the share applies, or past its wait-bound deadline."""
        if self._share_applies and self.deadline is not None and now - req.arrival_time >= self.deadline:
            return True
        due = self._deadlines.get(req.request_id) if self._deadlines else None
        return due is not None and now >= due

    def skips_headroom(self, req, now) -> bool:
        """Only without the wait bound's host tier: there a late request keeps the headroom."""
        return not self.bounded and self.late(req, now)

    def priority(self, req, program, now):
        key = (not self.late(req, now),) + super().priority(req, program, now)
        if self.short_first is None or not self.bounded:
            return key
        # (late, preempted, pinned) stay first; the new tokens come before the program's arrival
        new = 0
        if self.ctx.kv_pressure() < self.short_first:
            history = program.history
            new = max(0, req.num_prompt_tokens - (len(history) if history else 0))
        return key[:3] + (new,) + key[3:]

    def pin_cost(self) -> float:
        if not self.pressure:
            return 1.0
        return max(self.min_pin_cost, min(1.0, self.ctx.kv_pressure()))

    def expected_wait(self, tool: str) -> float:
        m = self.tool_stats.mean(tool)
        if m is None:
            m = self.tool_stats.global_mean()
        return self.model.default_tool_mean if m is None else m

    def miss_cost(self, tokens: int, wait: float) -> tuple[float, str]:
        """Seconds to rebuild `tokens` of KV left off the device for `wait`
        seconds, and where from: the nearest tier that keeps a copy that long,
        else "prefill"."""
        ctx = self.ctx
        if self.tiers and ctx.prefill_cost is not None:
            for tier, reload in ctx.tier_reload.items():
                if ctx.tier_residency(tier) >= wait:
                    return reload(tokens), tier
            return ctx.prefill_cost(tokens), "prefill"
        return ctx.reload_cost(tokens), "reload"

    def prefetch_plan(self, req, program, now):
        """A reload from the tier the KV is expected in (the nearest whose copies
        outlast the tool's expected duration; none: nothing to reload), started
        at the lead time policy/prefetch.py chooses over the tool's durations (the
        global ones while the TTL model has too few of the tool's)."""
        ctx = self.ctx
        if not self.prefetch or not ctx.tier_reload:
            return None
        tool = req.tool_name or NO_TOOL_CALL
        stats = self.tool_stats
        samples = stats.sorted_samples(tool) if self.model.regime(tool) == "tool" else stats.global_sorted_samples()
        if not samples:
            samples = stats.sorted_samples(tool)
        wait = self.expected_wait(tool)
        tier = next((t for t in ctx.tier_reload if ctx.tier_residency(t) >= wait), None)
        if not samples or tier is None:
            return None
        tokens = req.num_computed_tokens
        reload_s = ctx.tier_reload[tier](tokens)
        stage = None
        if self.stage and tier == "disk" and "host" in ctx.tier_reload:
            # Stage disk -> host first: the turn then reloads over the host link
            # alone, and the load into the device is priced at that.
            host_s = ctx.tier_reload["host"](tokens)
            stage = stage_start(samples, reload_s - host_s, ctx.tier_residency("host"))
            if stage is not None:
                tier, reload_s = "host", host_s
        start = prefetch_start(samples, reload_s, self.pin_cost())
        if start is None and stage is None:
            return None
        at, value = (None, 0.0) if start is None else (now + start[0], start[1])
        if stage is None:
            return PrefetchPlan(at, reload_s, tier, value, now + samples[-1])
        return PrefetchPlan(at, reload_s, tier, value, now + samples[-1], now + stage[0], stage[1])

    def retention(self, req, program, now):
        decision = super().retention(req, program, now)
        if decision.action == "free" and decision.inputs is not None and decision.inputs.source == "disk":
            return Retention("disk", 0.0, decision.inputs)
        return decision

    def solve(self, req) -> tuple[float, TTLInputs]:
        tool = req.tool_name or NO_TOOL_CALL
        miss_s, source = self.miss_cost(req.num_computed_tokens, self.expected_wait(tool))
        cost = self.pin_cost()
        m = self.model
        tau, regime = m.decide(tool, miss_s, eta=self.fixed_eta, pin_cost=cost)
        default = regime == "default"
        eta = 1.0 if default else (m.eta.value() if self.fixed_eta is None else self.fixed_eta)
        return tau, TTLInputs(regime, eta=eta, queue_delay_s=m.queue.mean(), reload_s=miss_s,
                              benefit_s=m.last_benefit, mean_used_s=m.default_mean(tool) if default else None,
                              pin_cost=cost, source=source)
