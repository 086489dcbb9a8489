"""CacheTTL / Continuum: pin a tool-calling turn's KV for the TTL of Eq. 2,
learned online per tool, and order waiting requests by (preempted first,
pinned program first, program arrival). A request is admitted only when its
whole prompt and some output fit beside the running requests' own reserves."""

from __future__ import annotations

from dataclasses import replace

from agentserve.policy.base import Policy, PolicyContext, Retention, register
from agentserve.policy.decision_log import TTLInputs
from agentserve.policy.tool_stats import NO_TOOL_CALL
from agentserve.policy.ttl import EtaEstimator, QueueDelayWindow, TTLModel


@register
class Continuum(Policy):
    name = "continuum"
    decode_reserve_tokens = 128  # admit whole programs' turns, not chunks (see Policy)

    def __init__(self, ctx: PolicyContext, k_threshold: int = 100, default_tool_mean: float = 1.0,
                 max_ttl: float = 600.0, age_credit: float | None = 15.0) -> None:
        super().__init__(ctx)
        self.eta = EtaEstimator()
        self.queue_delays = QueueDelayWindow()
        self.model = TTLModel(k_threshold, default_tool_mean, self.tool_stats, self.eta, self.queue_delays)
        self.max_ttl = max_ttl  # a hard cap, so no learned distribution can hold memory for hours
        self.age_credit = age_credit

    def credit(self, req) -> float | None:
        """Seconds of seniority `req`'s program may hold over later arrivals (None: unbounded)."""
        return self.age_credit

    def priority(self, req, program, now):
        t = program.arrival_time
        credit = self.credit(req)
        if credit is not None:
            t = max(t, req.arrival_time - credit)
        return (not req.preempted, not self.ctx.is_pinned(req.program_id), t, req.arrival_time)

    def on_admitted(self, req, program, now, queue_delay, returning_evicted):
        if returning_evicted:
            self.queue_delays.add(queue_delay)

    def on_program_end(self, program):
        super().on_program_end(program)
        if not program.anonymous:  # one-shot requests would fill eta's window with 1-turn programs
            self.eta.add_program(program.turns_finished)

    def export_state(self) -> dict:
        return {**super().export_state(), "eta": self.eta.export_state(),
                "queue_delays": self.queue_delays.export_state()}

    def import_state(self, state: dict) -> None:
        # checked before any part is taken, so that malformed data changes nothing
        eta, delays = EtaEstimator(self.eta.window), QueueDelayWindow(self.queue_delays.window)
        eta.import_state(state.get("eta", self.eta.export_state()))
        delays.import_state(state.get("queue_delays", self.queue_delays.export_state()))
        super().import_state(state)
        self.eta.import_state(eta.export_state())
        self.queue_delays.import_state(delays.export_state())

    def retention(self, req, program, now):
        if req.ttl_hint is not None:  # the client knows better than the statistics
            ttl = min(max(req.ttl_hint, 0.0), self.max_ttl)
            why = TTLInputs("hint", capped=req.ttl_hint > self.max_ttl)
        else:
            # A turn without a parsable tool call is still followed by another (the
            # client did not end the program): its gap is learned like a tool's.
            solved, why = self.solve(req)
            ttl = min(solved, self.max_ttl)
            if solved > ttl:
                why = replace(why, capped=True)
        return Retention("pin", ttl, why) if ttl > 0 else Retention("free", 0.0, why)

    def ttl_for(self, req) -> float:
        return self.solve(req)[0]

    def solve(self, req) -> tuple[float, TTLInputs]:
        """Eq. 2's TTL for this turn (before the cap), and what it was solved from."""
        tool = req.tool_name or NO_TOOL_CALL
        reload_s = self.ctx.reload_cost(req.num_computed_tokens)
        m = self.model
        tau, regime = m.decide(tool, reload_s)
        default = regime == "default"
        return tau, TTLInputs(regime, eta=1.0 if default else m.eta.value(), queue_delay_s=m.queue.mean(),
                              reload_s=reload_s, benefit_s=m.last_benefit,
                              mean_used_s=m.default_mean(tool) if default else None)
