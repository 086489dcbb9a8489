"""vLLM's default: request-level FCFS, and a turn's KV is released when it ends
(it stays in the prefix cache only until something else needs the space)."""

from agentserve.policy.base import Policy, register


@register
class VllmFcfs(Policy):
    name = "vllm-fcfs"

    def priority(self, req, program, now):
        return (not req.preempted, req.arrival_time)
