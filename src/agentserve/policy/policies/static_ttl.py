"""The ablation between program-FCFS and Continuum: the same ordering and
pins, but every pin gets the cold-start TTL (T_default: exponential tool
times, eta = 1) instead of the learned per-tool optimum."""

from __future__ import annotations

from agentserve.policy.base import register
from agentserve.policy.decision_log import TTLInputs
from agentserve.policy.policies.continuum import Continuum
from agentserve.policy.ttl import exp_optimal_ttl


@register
class StaticTTL(Continuum):
    name = "static-ttl"

    def solve(self, req) -> tuple[float, TTLInputs]:
        queue_delay = self.queue_delays.mean()
        reload_s = self.ctx.reload_cost(req.num_computed_tokens)
        mean = self.model.default_mean()
        benefit = queue_delay + reload_s
        return exp_optimal_ttl(mean, benefit), TTLInputs("default", eta=1.0, queue_delay_s=queue_delay,
                                                         reload_s=reload_s, benefit_s=benefit, mean_used_s=mean)
