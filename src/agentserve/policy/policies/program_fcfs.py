"""Program-level FCFS: a request inherits its program's arrival time, so a
program that came first keeps coming first on every turn. No retention."""

from agentserve.policy.base import Policy, register


@register
class ProgramFcfs(Policy):
    name = "program-fcfs"

    def priority(self, req, program, now):
        return (not req.preempted, program.arrival_time, req.arrival_time)
