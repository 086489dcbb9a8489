"""agentserve's own policy: Continuum's order, admission headroom and Eq. 2
TTLs, with the cost of a pinned second weighted by how contended the KV is.

Eq. 2 charges a pin one second per second held because, the paper assumes,
some request is always waiting for that memory. When nothing waits, a pin
delays nobody and the best TTL is the one that catches the tool's return;
under pressure it is Eq. 2's. So the cost of a pinned second is the share of
recent time the scheduler held a request back for KV (policy/pressure.py),
floored at `min_pin_cost` so that a TTL stays finite: at low load this pins
until the slowest recorded duration of the tool (InferCept's behaviour, which
wins there), under pressure it is Continuum's. Each part can be turned off
(`pressure=False`, `eta=...`) for the ablations in the README."""

from __future__ import annotations

from agentserve.policy.base import PolicyContext, register
from agentserve.policy.decision_log import TTLInputs
from agentserve.policy.policies.continuum import Continuum
from agentserve.policy.tool_stats import NO_TOOL_CALL


@register
class AgentServe(Continuum):
    name = "agentserve"

    def __init__(self, ctx: PolicyContext, pressure: bool = True, min_pin_cost: float = 0.05,
                 eta: float | None = None, **options) -> None:
        super().__init__(ctx, **options)
        if not 0.0 < min_pin_cost <= 1.0:
            raise ValueError(f"min_pin_cost must be in (0, 1], got {min_pin_cost!r}")
        self.pressure = pressure
        self.min_pin_cost = min_pin_cost
        self.fixed_eta = eta

    def pin_cost(self) -> float:
        if not self.pressure:
            return 1.0
        return max(self.min_pin_cost, min(1.0, self.ctx.kv_pressure()))

    def solve(self, req) -> tuple[float, TTLInputs]:
        tool = req.tool_name or NO_TOOL_CALL
        reload_s = self.ctx.reload_cost(req.num_computed_tokens)
        cost = self.pin_cost()
        m = self.model
        tau, regime = m.decide(tool, reload_s, eta=self.fixed_eta, pin_cost=cost)
        default = regime == "default"
        eta = 1.0 if default else (m.eta.value() if self.fixed_eta is None else self.fixed_eta)
        return tau, TTLInputs(regime, eta=eta, queue_delay_s=m.queue.mean(), reload_s=reload_s,
                              benefit_s=m.last_benefit, mean_used_s=m.default_mean(tool) if default else None,
                              pin_cost=cost)
