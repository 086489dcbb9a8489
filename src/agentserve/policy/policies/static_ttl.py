"""The ablation between program-FCFS and Continuum: the same ordering and
pins, but every pin gets the cold-start TTL (T_default: exponential tool
times, eta = 1) instead of the learned per-tool optimum."""

from __future__ import annotations

from agentserve.policy.base import register
from agentserve.policy.policies.continuum import Continuum
from agentserve.policy.ttl import exp_optimal_ttl


@register
class StaticTTL(Continuum):
    name = "static-ttl"

    def ttl_for(self, req) -> float:
        benefit = self.queue_delays.mean() + self.ctx.reload_cost(req.num_computed_tokens)
        return exp_optimal_ttl(self.model.default_mean(), benefit)
