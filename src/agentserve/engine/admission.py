"""Admitting a waiting request: its prefix hit and first chunk under the step's
budget, and the policy's headroom (`Policy.decode_reserve_tokens`): a request
is admitted only when its prompt and reserved output fit beside what the
running requests may still take; pins of later programs are reclaimed (any
pin, then its own, when nothing runs; any pin for a request past the policy's
deadline) before it is held back. A policy may also keep the running requests
within a share of the KV (`Policy.running_kv_share`), leaving the rest to
programs between turns. Part of `Scheduler` (engine/scheduler.py), whose state
it uses."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from agentserve.engine.request import Request, RequestStatus
from agentserve.engine.scheduler_config import SchedulerConfig, SchedulerStats
from agentserve.engine.step_budget import StepBudget
from agentserve.kv.manager import KVCacheManager
from agentserve.kv.window_parts import KVInconsistency
from agentserve.policy.base import Policy

log = logging.getLogger(__name__)


class Admission:
    config: SchedulerConfig
    kv: KVCacheManager
    policy: Policy
    stats: SchedulerStats
    running: list[Request]
    _held: int  # the sum of the running requests' `reserve`
    _kv_blocked: bool

    if TYPE_CHECKING:
        def _reclaim_pin(self, req: Request, any_program: bool, now: float) -> bool: ...  # pin_review.py

        def _unpin(self, program_id: str, now: float, protect: bool = True) -> int: ...  # scheduler.py

    def _admit(self, req: Request, step: StepBudget, now: float, match, held: int | None) -> bool:
        try:
            return self._admit_match(req, step, now, match, held)
        except KVInconsistency as e:  # raised before the KV changed: recompute rather than answer from it
            log.warning("program %s: %s; its prompt is recomputed", req.program_id, e)
            return self._admit_match(req, step, now, self.kv.match(req.token_ids[:1], req.cache_salt), held)

    def _admit_match(self, req: Request, step: StepBudget, now: float, match, held: int | None) -> bool:
        hit = match.num_tokens
        loaded = match.num_host_tokens  # before admit: admit gives those nodes device blocks
        n = step.allow(hit, min(req.num_tokens - hit, step.budget))
        if n <= 0:
            return False  # the step-time target is spent
        if not self._within_running_share(req, held, now):
            if not self._has_headroom(req, match, held):
                self._kv_blocked = True  # it would not fit in the free KV either
            return False
        own_pin_released = False
        while not self._has_headroom(req, match, held) or (table := self.kv.admit(match, n, now, req.num_prompt_tokens)) is None:
            nothing_runs = not self.running
            if self._reclaim_pin(req, any_program=nothing_runs or self.policy.late(req, now), now=now):
                continue
            if nothing_runs and req.program_id in self.kv.pins:
                # Its own pin holds blocks this turn does not reuse (the partial
                # last block at least) and nothing else can free memory: release
                # it; the matched blocks stay cached and are revived by admit.
                self._unpin(req.program_id, now)
                own_pin_released = True
                continue
            self._kv_blocked = True  # held back for KV (engine/scheduler.py's pressure meter)
            return False
        prog = req.program
        # its blocks now belong to the request
        pinned = self._unpin(req.program_id, now) > 0 or own_pin_released
        if pinned:
            self.stats.pins_hit += 1
        delay = now - req.waiting_since
        req.queue_time += delay
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = hit
            req.num_loaded_tokens = loaded
            self.stats.admitted_prompt_tokens += req.num_prompt_tokens
            self.stats.hit_tokens += hit
            self.stats.loaded_tokens += loaded
            self.policy.on_admitted(req, prog, now, delay, returning_evicted=prog.turns_finished > 0 and not pinned)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        req.block_table = table
        req.num_computed_tokens = hit
        req.status = RequestStatus.RUNNING
        req.preempted = False
        self.running.append(req)
        self._rereserve(req)
        if table.loads and self.config.overlap_copies:
            return True  # it computes once its reloads land (the executor overlaps them with this step)
        step.add_prefill(req, hit, n)
        return True

    def _ahead(self, req: Request) -> int:
        """Tokens `req` still needs KV for under the policy's headroom: all it
        has, plus its remaining output up to Policy.decode_reserve_tokens."""
        return req.num_tokens + min(req.max_tokens - req.num_output_tokens, self.policy.decode_reserve_tokens)

    def _reserve_of(self, req: Request) -> int:
        """Blocks a running `req` may still take within the policy's headroom."""
        return max(0, self.kv.blocks_for(self._ahead(req)) - len(req.block_table.blocks))

    def _rereserve(self, req: Request) -> None:
        """Bring a running request's reserve, and their sum, up to date after its
        tokens or its blocks changed: the sum is kept, never re-added per step."""
        if self.policy.decode_reserve_tokens > 0:
            new = self._reserve_of(req)
            self._held += new - req.reserve
            req.reserve = new

    def _has_headroom(self, req: Request, match, held: int | None) -> bool:
        """`req`'s whole prompt and reserved output fit in the free blocks that
        the running requests' reserves (`held`; None: no headroom applies, the
        policy keeps none or nothing runs) leave."""
        if held is None:
            return True
        need = self.kv.admit_need(match, self._ahead(req) - match.num_tokens, self.config.max_num_batched_tokens)
        return need + held <= self.kv.num_free_blocks

    def _within_running_share(self, req: Request, held: int | None, now: float) -> bool:
        """The running requests' blocks and reserves, with `req`'s, stay within the
        policy's running_kv_share of the device KV: the rest is for programs
        between turns. Held back by this alone, a request is not held back for
        KV (the pressure meter does not count it: the pins that fill the rest are
        what the share is for), and it reclaims no pin, which would not bring the
        running requests' share down. A request past the policy's deadline is
        held back only for KV."""
        share = self.policy.running_kv_share
        if share >= 1.0 or held is None or self.policy.late(req, now):
            return True
        running = sum(len(r.block_table.blocks) for r in self.running if r.block_table is not None)
        return running + held + self.kv.blocks_for(self._ahead(req)) <= share * self.kv.num_blocks
