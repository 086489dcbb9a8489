"""The simulator's `Executor`: prices a scheduler output with the cost model,
moves the simulated clock by that much, and returns scripted tokens.

Tier copies are priced in one of two ways. Run in the step (`overlap_copies`
off), a step costs the cost model's `step_time`, copies included. Overlapped
with compute, as the model runner does (runner/copy_engine.py), a step costs
its forward pass and its copies go on two links, as the runner's two copy
workers run them: the host link (the spills' host slots staged, offloads,
reloads: `host_copy_time`) and the disk link (the staged spills written, disk
reloads, disk -> host stages: `disk_copy_time`). Each link starts a batch when it is done with the
batches before it (the disk link also not before the host link staged the
batch's spills, and the host link not before the disk link's backlog has room
for them: kv/disk_tier.py `SpillBacklog`); a link's part of a batch is
reported (`poll_copies`, `CopiesDone.tier`) once the simulated clock has
reached its end."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from agentserve.clock import SimClock
from agentserve.cost.cost_model import CostModel
from agentserve.engine.executor import CopiesDone, Executor, ExecutorResult
from agentserve.engine.scheduler_output import SchedulerOutput
from agentserve.kv.disk_tier import SpillBacklog

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
    staged_blocks: int = 0  # blocks read from the disk tier into the host tier (a prefetch's stage)
    copy_time: float = 0.0  # seconds the host link was busy (overlapped copies only)
    disk_copy_time: float = 0.0  # seconds the disk link was busy (overlapped copies only)
    spill_waits: int = 0  # batches whose spills waited for room in the disk link's backlog


class SimExecutor(Executor):
    def __init__(self, clock: SimClock, cost_model: CostModel, overlap_copies: bool = False,
                 host_blocks: int = 0) -> None:
        self.clock = clock
        self.cost_model = cost_model
        self.overlap_copies = overlap_copies
        self.stats = SimStats()
        self._host_free_at = 0.0  # when each link is done with the batches it was given
        self._disk_free_at = 0.0
        # (lands at, ticket) of each link's parts in flight, in the order given
        self._flight: dict[str, deque[tuple[float, int]]] = {"host": deque(), "disk": deque()}
        self.backlog = SpillBacklog(host_blocks, cost_model.block_bytes)
        self._staged: deque[tuple[float, int]] = deque()  # (written at, blocks) of the backlog's batches

    def execute(self, output: SchedulerOutput) -> ExecutorResult:
        if output.is_empty:
            return ExecutorResult()
        pending = self.overlap_copies and output.has_copies
        if pending:
            self._queue_copies(output)
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
        stats.staged_blocks += len(output.blocks_to_stage)
        return ExecutorResult(sampled=sampled, elapsed=elapsed, copies_pending=pending)

    def _queue_copies(self, out: SchedulerOutput) -> None:
        cost, now = self.cost_model, self.clock.now()
        spills = len(out.blocks_to_spill)
        start = max(now, self._host_free_at)
        staged_at = start
        if spills:
            start = self._room(spills, start)
            staged_at = start + cost.copy_blocks_time(spills)
        if spills or out.blocks_to_offload or out.blocks_to_load:
            took = cost.host_copy_time(out)
            self._host_free_at = start + took
            self.stats.copy_time += took
            if out.blocks_to_offload or out.blocks_to_load:
                self._flight["host"].append((self._host_free_at, out.copy_ticket))
        if spills or out.blocks_to_load_disk or out.blocks_to_stage:
            took = cost.disk_copy_time(out)
            self._disk_free_at = max(self._disk_free_at, staged_at) + took
            self.stats.disk_copy_time += took
            self._flight["disk"].append((self._disk_free_at, out.copy_ticket))
            if spills:
                self.backlog.add(spills)
                self._staged.append((self._disk_free_at, spills))

    def _room(self, n: int, t: float) -> float:
        """When the host link may stage `n` spills, not before `t`: the backlog
        drops what the disk link has written by then, and waits for more if it must."""
        staged, backlog = self._staged, self.backlog
        while staged and staged[0][0] <= t:
            backlog.written(staged.popleft()[1])
        if not backlog.fits(n):
            self.stats.spill_waits += 1
            while not backlog.fits(n):
                at, m = staged.popleft()
                t = max(t, at)
                backlog.written(m)
        return t

    def next_copy_time(self) -> float | None:
        """When the next part of a batch in flight lands, on either link (None: none is)."""
        heads = [f[0][0] for f in self._flight.values() if f]
        return min(heads) if heads else None

    def poll_copies(self, wait: float = 0.0) -> list[CopiesDone]:
        """The parts of batches landed by now; with `wait`, the clock first moves
        up to that much towards the next landing when none has landed."""
        nxt = self.next_copy_time()
        if wait > 0 and nxt is not None and nxt > self.clock.now():
            self.clock.advance_to(min(nxt, self.clock.now() + wait))
        now = self.clock.now()
        done = []
        for tier, flight in self._flight.items():
            while flight and flight[0][0] <= now:
                done.append(CopiesDone(flight.popleft()[1], tier=tier))
        return done
