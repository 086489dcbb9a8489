"""The scheduler's pins: releasing those that expired or that the policy
reviews away at the start of a step (never while the program's next turn
waits), and reclaiming one when KV runs out (the latest-arriving program's
first, and only a pin whose release frees a block). Part of `Scheduler`
(engine/scheduler.py), whose state it uses."""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentserve.engine.request import Request
from agentserve.engine.scheduler_config import SchedulerStats
from agentserve.engine.waiting_queue import WaitingQueue
from agentserve.kv.manager import KVCacheManager
from agentserve.policy.base import Policy
from agentserve.policy.pressure import pin_to_reclaim


class PinReview:
    kv: KVCacheManager
    policy: Policy
    stats: SchedulerStats
    waiting: WaitingQueue
    _overdue: set[str]

    if TYPE_CHECKING:
        def _unpin(self, program_id: str, now: float, protect: bool = True) -> int: ...  # scheduler.py

    def _release_pins(self, now: float) -> None:
        pins = self.kv.pins
        if not pins:
            return
        expired = self.kv.pins.expired(now)
        if self._overdue:  # expired earlier, kept while the program's next turn waited
            expired.extend(self._overdue)
            self._overdue = set()
        for pid in expired:
            if self.waiting.has_program(pid):
                self._overdue.add(pid)  # its next turn waits: keep it
            elif self._unpin(pid, now):
                self.stats.pins_expired += 1
        for pid in self.policy.review_pins(pins, now):
            # a program whose next turn already waits keeps its pin (as with expiry)
            if pid in pins and not self.waiting.has_program(pid):
                self._unpin(pid, now)
                self.stats.pins_released_early += 1

    def _reclaim_pin(self, req: Request, any_program: bool, now: float) -> bool:
        """Release the pin of the latest-arriving program (later than `req`'s,
        unless `any_program`) among those whose release returns at least one
        block to the free set: a pin whose blocks others also hold frees
        nothing, and dropping it would only cost its program the retention.
        True if one was released."""
        pin = pin_to_reclaim(self.kv.pins.values(), req.program_id, req.program.arrival_time, any_program,
                             lambda p: self.kv.reclaimable_blocks(p.program_id))
        if pin is None:
            return False
        self._unpin(pin.program_id, now)
        self.stats.pins_reclaimed += 1
        return True
