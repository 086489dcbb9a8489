"""The simulator's `Executor`: prices a scheduler output with the cost model,
moves the simulated clock by that much, and returns scripted tokens.

Tier copies are priced in one of two ways. Run in the step (`overlap_copies`
off), a step costs the cost model's `step_time`, copies included. Overlapped
with compute, as the model runner does (engine/executor.py), a step costs its
forward pass and its copies go on a copy timeline: they start when the copy
engine is done with the batches before them, take `copy_time`, and are
reported (`poll_copies`) once the simulated clock has reached their end."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from agentserve.clock import SimClock
from agentserve.cost.cost_model import CostModel
from agentserve.engine.executor import CopiesDone, Executor, ExecutorResult
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
    copy_time: float = 0.0  # seconds the copy engine was busy (overlapped copies only)


class SimExecutor(Executor):
    def __init__(self, clock: SimClock, cost_model: CostModel, overlap_copies: bool = False) -> None:
        self.clock = clock
        self.cost_model = cost_model
        self.overlap_copies = overlap_copies
        self.stats = SimStats()
        self._copies_free_at = 0.0  # when the copy engine is done with the batches it was given
        self._flight: deque[tuple[float, int]] = deque()  # (lands at, ticket), in the order given

    def execute(self, output: SchedulerOutput) -> ExecutorResult:
        if output.is_empty:
            return ExecutorResult()
        pending = self.overlap_copies and output.has_copies
        if pending:
            took = self.cost_model.copy_time(output)
            start = max(self.clock.now(), self._copies_free_at)
            self._copies_free_at = start + took
            self._flight.append((self._copies_free_at, output.copy_ticket))
            self.stats.copy_time += took
            elapsed = self.cost_model.forward_time(output)
        elif self.overlap_copies:
            elapsed = self.cost_model.forward_time(output)
        else:
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
        return ExecutorResult(sampled=sampled, elapsed=elapsed, copies_pending=pending)

    def next_copy_time(self) -> float | None:
        """When the oldest batch of copies in flight lands (None: none is)."""
        return self._flight[0][0] if self._flight else None

    def poll_copies(self, wait: float = 0.0) -> list[CopiesDone]:
        """The batches landed by now; with `wait`, the clock first moves up to
        that much towards the next landing when none has landed."""
        flight = self._flight
        if wait > 0 and flight and flight[0][0] > self.clock.now():
            self.clock.advance_to(min(flight[0][0], self.clock.now() + wait))
        now = self.clock.now()
        done = []
        while flight and flight[0][0] <= now:
            done.append(CopiesDone(flight.popleft()[1]))
        return done
