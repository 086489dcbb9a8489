"""Making room and giving KV up: a running request that needs blocks reclaims
later programs' pins, then preempts the lowest-priority request admitted at or
after it; a request that stops (preempted, finished, aborted) releases its
block table, freed or first copied to a lower tier as the policy asks. Part of
`Scheduler` (engine/scheduler.py), whose state it uses."""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentserve.engine.request import Request, RequestStatus
from agentserve.engine.scheduler_config import SchedulerStats
from agentserve.engine.scheduler_output import SchedulerOutput
from agentserve.engine.step_budget import StepBudget
from agentserve.engine.waiting_queue import WaitingQueue
from agentserve.kv.manager import KVCacheManager
from agentserve.policy.base import Policy


class Preemption:
    kv: KVCacheManager
    policy: Policy
    stats: SchedulerStats
    waiting: WaitingQueue
    running: list[Request]
    _kv_blocked: bool

    if TYPE_CHECKING:
        def _reclaim_pin(self, req: Request, any_program: bool, now: float) -> bool: ...  # pin_review.py

        def _rereserve(self, req: Request) -> None: ...  # admission.py

        def _stop_running(self, req: Request) -> None: ...  # scheduler.py

        def _key(self, req: Request, now: float) -> tuple: ...  # scheduler.py

    def _schedule_running(self, req: Request, n: int, step: StepBudget, now: float, out: SchedulerOutput) -> bool:
        """KV for `n` more tokens of running `req`: reclaim later programs' pins,
        then preempt the lowest-priority running request admitted at or after
        `req` (ties: the most recently admitted, least progress lost) until it
        fits. False if `req` itself was preempted."""
        table = req.block_table
        had = len(table.blocks)
        while not self.kv.allocate_slots(table, req.num_computed_tokens + n):
            if self._reclaim_pin(req, any_program=len(self.running) == 1, now=now):
                continue
            later = self.running[self.running.index(req):]
            victim = max(reversed(later), key=lambda r: self._key(r, now))
            step.drop(victim)  # a decode admitted after `req` and already scheduled
            self._preempt(victim, now, out)
            if victim is req:
                return False
        if len(table.blocks) != had:
            self._rereserve(req)
        return True

    def _preempt(self, req: Request, now: float, out: SchedulerOutput) -> None:
        self._stop_running(req)
        self._release_table(req, now, "swap" if self.policy.swap_on_preempt(req) else "free")
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.preempted = True
        req.num_preemptions += 1
        req.waiting_since = now
        self.stats.preemptions += 1
        self._kv_blocked = True
        self.waiting.push(req, now)
        out.preempted.append(req)

    def _release_table(self, req: Request, now: float, action: str = "free", protect: str | None = None) -> None:
        """The request gives up its KV, its blocks cached: freed, or first copied
        to the host tier where the policy asks and a tier exists ("swap"; "disk":
        first in line to move on to the disk tier, for a long wait). `protect`:
        its live multi-turn program, between turns (kv/protected_zone.py)."""
        table, req.block_table = req.block_table, None
        if table is None:
            return
        if action in ("swap", "disk") and self.kv.host.enabled:
            onward = action == "disk" and self.kv.disk.enabled
            self.kv.swap_out(table, now, onward=onward, protect=protect)
            self.stats.swapped_turns += 1
            self.stats.onward_turns += onward
        else:
            self.kv.free(table, now, protect)
