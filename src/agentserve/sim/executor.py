"""The simulator's `Executor`: prices a scheduler output with the cost model,
moves the simulated clock by that much, and returns scripted tokens."""

from __future__ import annotations

from dataclasses import dataclass

from agentserve.clock import SimClock
from agentserve.cost.cost_model import CostModel
from agentserve.engine.executor import Executor, ExecutorResult
from agentserve.engine.scheduler_output import SchedulerOutput

__all__ = ["FILLER_TOKEN_ID", "SimExecutor", "SimStats"]

FILLER_TOKEN_ID = 0  # sampled when a request has no (or too short a) scripted output


@dataclass
class SimStats:
    steps: int = 0  # non-empty steps executed
    busy_time: float = 0.0  # sum of modelled step times
    prefill_tokens: int = 0  # tokens in non-decode chunks (prompt, deltas, recomputation)
    decode_tokens: int = 0
    sampled_tokens: int = 0
    loaded_blocks: int = 0
    offloaded_blocks: int = 0
    spilled_blocks: int = 0  # host slots written to the disk tier
    disk_loaded_blocks: int = 0  # blocks reloaded from the disk tier


class SimExecutor(Executor):
    def __init__(self, clock: SimClock, cost_model: CostModel) -> None:
        self.clock = clock
        self.cost_model = cost_model
        self.stats = SimStats()

    def execute(self, output: SchedulerOutput) -> ExecutorResult:
        if output.is_empty:
            return ExecutorResult()
        elapsed = self.cost_model.step_time(output)
        self.clock.advance(elapsed)

        stats = self.stats
        sampled: dict[str, list[int]] = {}
        for ch in output.chunks:
            if ch.is_decode:
                stats.decode_tokens += 1
            else:
                stats.prefill_tokens += ch.num_tokens
            if ch.sample:
                req = ch.request
                script = req.sim_output
                i = req.num_output_tokens
                token = script[i] if script is not None and i < len(script) else FILLER_TOKEN_ID
                sampled[req.request_id] = [token]
        stats.steps += 1
        stats.busy_time += elapsed
        stats.sampled_tokens += len(sampled)
        stats.loaded_blocks += len(output.blocks_to_load)
        stats.offloaded_blocks += len(output.blocks_to_offload)
        stats.spilled_blocks += len(output.blocks_to_spill)
        stats.disk_loaded_blocks += len(output.blocks_to_load_disk)
        return ExecutorResult(sampled=sampled, elapsed=elapsed)
