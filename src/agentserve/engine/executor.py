"""The seam between the scheduler and whatever computes: the real model runner
or the simulator's cost model."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

from agentserve.engine.scheduler_output import SchedulerOutput


@dataclass
class ExecutorResult:
    # request_id -> sampled token ids (one per chunk with sample=True; more with speculation)
    sampled: dict[str, list[int]] = field(default_factory=dict)
    elapsed: float = 0.0  # seconds the step took (measured, or modelled in simulation)


class Executor(abc.ABC):
    @abc.abstractmethod
    def execute(self, output: SchedulerOutput) -> ExecutorResult:
        """Run the copies, then one forward pass over the scheduled chunks."""

    def release(self, request_id: str) -> None:
        """The request is over: drop any per-request state (a sampler's seed)."""
