"""After a step: the sampled tokens applied (speculative drafts verified, stop
checks, KV committed), the step time observed for the step-time model, and
each finished turn's end: its program's retention as the policy decides (pin
for a TTL, swap to the host tier, or free), or the program's end on its last
turn. Part of `Scheduler` (engine/scheduler.py), whose state it uses."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from agentserve.clock import Clock
from agentserve.engine.executor import CopiesDone, ExecutorResult
from agentserve.engine.prefetch import Prefetcher
from agentserve.engine.request import Request, RequestStatus
from agentserve.engine.scheduler_config import SchedulerConfig, SchedulerStats
from agentserve.engine.scheduler_output import SchedulerOutput
from agentserve.engine.spec_decode import Speculator
from agentserve.engine.step_time import StepTimeModel, step_features
from agentserve.engine.waiting_queue import WaitingQueue
from agentserve.kv.manager import KVCacheManager
from agentserve.policy.base import Policy
from agentserve.policy.program import ProgramState, ProgramTable


class StepResults:
    config: SchedulerConfig
    kv: KVCacheManager
    policy: Policy
    clock: Clock
    stats: SchedulerStats
    running: list[Request]
    _held: int
    requests: dict[str, Request]
    programs: ProgramTable
    waiting: WaitingQueue
    step_model: StepTimeModel
    speculator: Speculator
    prefetcher: Prefetcher
    token_hook: Callable[[Request, int], RequestStatus | None] | None

    if TYPE_CHECKING:
        def end_program(self, program_id: str) -> ProgramState | None: ...  # scheduler.py

        def _retire(self, chain) -> None: ...  # scheduler.py

        def _release_table(self, req: Request, now: float, action: str = "free",
                           protect: str | None = None) -> None: ...  # preemption.py

        def _stop_running(self, req: Request) -> None: ...  # scheduler.py

        def _rereserve(self, req: Request) -> None: ...  # admission.py

    def update(self, out: SchedulerOutput, result: ExecutorResult) -> list[Request]:
        """Apply sampled tokens; returns the requests that finished this step."""
        now = self.clock.now()
        if out.has_copies and not result.copies_pending:
            self._finish_copies(result, out.copy_ticket, now)
        finished = []
        limit = self.config.max_model_len
        stats = self.stats
        elapsed = result.elapsed
        stats.execute_s += elapsed
        stats.executed_steps += 1
        kv = self.kv
        bs = kv.block_size
        sampled = result.sampled
        hook = self.token_hook
        track_service = self.policy.tracks_service
        reserve_tokens = self.policy.decode_reserve_tokens
        held = 0  # the change of the running requests' reserves (admission.py), inlined: it runs per row
        tokens_out = 0
        running = RequestStatus.RUNNING
        for ch in out.chunks:
            req = ch.request
            draft = ch.draft
            if req.status is not running:
                continue  # aborted during the step
            if track_service:
                req.program.attained_service += elapsed
            table = req.block_table
            if not ch.sample:
                if req.num_computed_tokens // bs > table.num_indexed:
                    kv.commit(table, req.token_ids, req.num_computed_tokens)
                continue
            tokens = sampled.get(req.request_id, ())
            if draft:
                tokens = self.speculator.verify(req, draft, tokens)
            elif tokens and req.spec is not None:
                self.speculator.observe_shadow(req, tokens[0])
            status = None
            output, token_ids = req.output_token_ids, req.token_ids
            for tok in tokens:
                tokens_out += 1
                output.append(tok)
                token_ids.append(tok)
                if req.first_token_time is None:
                    req.first_token_time = now
                status = hook(req, tok) if hook is not None else None
                if status is None:
                    if tok in req.eos_token_ids:
                        status = RequestStatus.FINISHED_STOPPED
                    elif len(output) >= req.max_tokens or (limit is not None and len(token_ids) >= limit):
                        status = RequestStatus.FINISHED_LENGTH
                if status is not None:
                    break
            if draft:
                # KV stands for every token but the last sampled one; blocks the
                # rejected draft tokens took go back
                req.num_computed_tokens = len(token_ids) - 1
                kv.trim_slots(table, len(token_ids), now)
            if req.num_computed_tokens // bs > table.num_indexed:
                kv.commit(table, token_ids, req.num_computed_tokens)
            if status is not None:
                self._finish(req, status, now)
                finished.append(req)
            elif reserve_tokens > 0:
                ahead = len(token_ids) + min(req.max_tokens - len(output), reserve_tokens)
                new = -(-ahead // bs) - len(table.blocks)
                if new < 0:
                    new = 0
                held += new - req.reserve
                req.reserve = new
        self._held += held
        stats.decode_tokens += tokens_out
        prefill, attention, decodes, context, draft_rows, draft_ctx = \
            out.features or step_features(out.chunks, self.step_model.shape)
        stats.prefill_tokens += prefill
        if decodes:
            stats.decode_steps += 1
            stats.decode_step_max_s = max(stats.decode_step_max_s, elapsed)
            stats.decode_step_history.append(elapsed)
        # Steps with host copies are left out of the fit: their time is not the forward pass's.
        if self.config.max_step_ms_with_decodes and not out.has_copies:
            self.step_model.observe(prefill, attention, decodes, context, elapsed, draft_rows, draft_ctx)
        return finished

    def copies_lost(self, out: SchedulerOutput) -> None:
        """The executor failed the whole step: none of its copies count (the
        engine's caller fails the step's requests; the KV stays consistent).
        An overlapping executor that had taken them waits for them first; its
        later report of the batch is then ignored."""
        self._finish_copies(CopiesDone(out.copy_ticket, range(len(out.blocks_to_offload)),
                                       range(len(out.blocks_to_load)), range(len(out.blocks_to_spill)),
                                       range(len(out.blocks_to_load_disk)),
                                       failed_stages=range(len(out.blocks_to_stage))),
                            out.copy_ticket, self.clock.now())

    def copies_done(self, done: list[CopiesDone]) -> None:
        """Batches of copies an overlapping executor finished (Executor.poll_copies)."""
        now = self.clock.now()
        for d in done:
            self._finish_copies(d, d.ticket, now, d.tier)

    def _finish_copies(self, result: ExecutorResult | CopiesDone, ticket: int, now: float,
                       tier: str | None = None) -> None:
        """A step's copies count now; a request whose reload failed (the
        executor computed nothing of it) recomputes from its last block with KV."""
        unloaded = self.kv.finish_copies(result.failed_offloads, result.failed_loads,
                                         result.failed_spills, result.failed_disk_loads, ticket, now, tier,
                                         result.failed_stages)
        if not unloaded:
            return
        self.stats.reload_failed_blocks += len(unloaded)
        for req in self.running:
            kept = self.kv.cut_unloaded(req.block_table, unloaded, now)
            if kept is not None:
                req.num_computed_tokens = min(req.num_computed_tokens, kept)
                self._rereserve(req)

    def finish_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_STOPPED) -> None:
        """End a running request early (a stop string matched outside the engine)."""
        req = self.requests.get(request_id)
        if req is not None and req.status is RequestStatus.RUNNING:
            self._finish(req, status, self.clock.now())

    def _finish(self, req: Request, status: RequestStatus, now: float) -> None:
        self._stop_running(req)
        req.status = status
        req.finish_time = now
        self.requests.pop(req.request_id, None)
        prog = req.program
        prog.turns_finished += 1
        prog.last_finish_time = now
        self.programs.active(prog, now)
        pid = req.program_id
        if req.is_last_turn or prog.anonymous or prog.ended:
            # (ended: the client ended the program while this turn ran; nothing comes back)
            hint = None if prog.anonymous else self.kv.chain_hint(req.token_ids, req.block_table)
            self._release_table(req, now)
            if prog.ended:
                self._retire(hint)
                return
            if not prog.anonymous:
                prog.chain = hint  # end_program retires it
            self.end_program(pid)
            return
        decision = self.policy.on_turn_end(req, prog, now)
        prog.last_tool = req.tool_name
        prog.history = req.token_ids
        prog.chain = self.kv.chain_hint(req.token_ids, req.block_table)
        if decision.action == "pin" and decision.ttl > 0:
            self.kv.pin(pid, req.block_table, now + decision.ttl, prog.arrival_time, now)
            req.block_table = None
            self.stats.pins_created += 1
            self.stats.ttl_sum += decision.ttl
            self._record_ttl(decision.ttl)
            self.waiting.replace_program(pid, now)
        else:
            self._release_table(req, now, decision.action, protect=pid)
        if self.kv.host.enabled:
            plan = self.policy.prefetch_plan(req, prog, now)
            if plan is not None:
                self.prefetcher.plan(pid, plan.at, plan.until, req.token_ids, prog.chain, req.cache_salt,
                                     plan.stage_at)

    def _record_ttl(self, ttl: float) -> None:
        h = self.stats.ttl_history
        h.append(ttl)
        if len(h) > 4096:
            del h[:2048]
