"""Autellix PLAS: program-level attained service, least-served first.

A waiting call enters the priority level that matches its program's attained
service (seconds of engine steps its calls took part in), levels are
discretised FIFO queues, and a call that has waited `beta` times its
program's service (at least one second) is promoted to the top level, so long
programs cannot starve. KV is released at the end of every turn, as in the
paper. Level edges are in seconds of service, doubling from `first_edge`."""

from __future__ import annotations

import bisect

from agentserve.policy.base import Policy, PolicyContext, register


@register
class Autellix(Policy):
    name = "autellix"
    tracks_service = True  # levels of attained service
    time_dependent = True  # starvation promotion changes the order as time passes

    def __init__(self, ctx: PolicyContext, num_levels: int = 7, first_edge: float = 1.0, beta: float = 8.0) -> None:
        super().__init__(ctx)
        self.edges = [first_edge * 2 ** i for i in range(num_levels - 1)]
        self.beta = beta

    def level(self, service: float) -> int:
        return bisect.bisect_right(self.edges, service)

    def priority(self, req, program, now):
        service = program.attained_service
        starving = (now - req.waiting_since) / max(1.0, service) >= self.beta
        level = 0 if starving else self.level(service)
        return (not req.preempted, level, req.waiting_since)
