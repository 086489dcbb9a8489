"""The scheduler: one step = which requests compute how many tokens.

Within the step's token budget: first every running request that is decoding
gets its one token, then running requests still prefilling (a new prompt, or
a preempted one recomputing) get their next chunk, both in admission order;
when KV runs out, pins of later programs are reclaimed, then the
lowest-priority running request admitted at or after the one that needs the
block is preempted (a decode already scheduled this step gives its token
back). Then waiting requests in the policy's order (prefix match, admission
with the policy's headroom, reclaiming pins of later programs when the head
does not fit, and any pin when nothing is running, so pins can never
deadlock). At the start of every step, expired pins whose program has no
waiting request are released.

While decodes run, the step's prefill tokens are capped so that the step's
predicted time (engine/step_time.py, learned from the steps that ran) stays
under `max_step_ms_with_decodes`: a long prompt is cut into chunks that share
the steps with the decodes instead of stalling them. The first prefill chunk
of a step always gets `min_prefill_chunk` tokens, so prefills progress.

A decode may carry a speculative draft that the step verifies
(engine/spec_decode.py: which drafts, and what stands of them); a waiting
request whose next prompt block a running prefill is about to compute waits
for it (engine/grouped_prefill.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from agentserve.clock import Clock
from agentserve.engine.executor import ExecutorResult
from agentserve.engine.grouped_prefill import follows, prefill_leaders
from agentserve.engine.request import Request, RequestStatus
from agentserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from agentserve.engine.scheduler_config import SchedulerConfig, SchedulerStats
from agentserve.engine.spec_decode import Speculator
from agentserve.engine.step_time import StepBudget, StepTimeModel, draft_features, step_features
from agentserve.kv.manager import KVCacheManager
from agentserve.policy.base import Policy, PolicyContext
from agentserve.policy.registry import make_policy
from agentserve.policy.program import ProgramTable

# Idle programs are looked for this many times per idle timeout (not every
# step: the look builds the set of busy programs).
EXPIRY_CHECKS_PER_TIMEOUT = 16


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, policy: str | Policy,
                 clock: Clock, reload_cost: Callable[[int], float] | None = None,
                 policy_options: dict | None = None) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock
        self.programs = ProgramTable(config.program_idle_timeout)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._waiting_programs: Counter[str] = Counter()
        self._requests: dict[str, Request] = {}
        # Called with (request, token) for each new token before the finish checks; may
        # return a finished status (the engine's stop strings). None: no output processing.
        self.token_hook: Callable[[Request, int], RequestStatus | None] | None = None
        self.stats = SchedulerStats()
        if isinstance(policy, str):
            ctx = PolicyContext(
                reload_cost=reload_cost or (lambda n: 0.0),
                programs=self.programs,
                is_pinned=lambda pid: pid in self.kv.pins,
                running_tokens=self._running_tokens,
                host_tier=kv.host.enabled,
            )
            policy = make_policy(policy, ctx, **(policy_options or {}))
        self.policy = policy
        self._order_dirty = True
        self._next_expiry = 0.0
        self.step_model = StepTimeModel()
        self.speculator = Speculator(config.speculation)

    # --- requests in and out ---

    def add_request(self, req: Request) -> None:
        limit = self.config.max_model_len
        if limit is not None and req.num_prompt_tokens >= limit:
            raise ValueError(f"prompt of {req.num_prompt_tokens} tokens does not fit max_model_len {limit}")
        need = self.kv.blocks_for(req.num_prompt_tokens + req.max_tokens)
        if need > self.kv.num_blocks:
            raise ValueError(f"request needs {need} KV blocks (prompt {req.num_prompt_tokens} + max_tokens "
                             f"{req.max_tokens}), the cache has {self.kv.num_blocks}")
        if req.request_id in self._requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        now = self.clock.now()
        prog = self.programs.touch(req.program_id, now)
        prog.anonymous = req.anonymous
        req.program = prog
        if prog.history is not None:
            self.stats.superseded_blocks += self.kv.supersede(req.program_id, prog.history, req.token_ids, now)
            prog.history = None
        self.policy.on_arrival(req, prog, now)
        req.status = RequestStatus.WAITING
        req.waiting_since = now
        self._requests[req.request_id] = req
        self._push_waiting(req)

    def abort(self, request_id: str) -> Request | None:
        """Stop a request wherever it is; its KV is freed, its program lives on."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        now = self.clock.now()
        if req.status is RequestStatus.WAITING:
            self._remove_waiting(req)
        elif req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.kv.free(req.request_id, now)
        req.status = RequestStatus.FINISHED_ABORTED
        req.finish_time = now
        del self._requests[request_id]
        return req

    def end_program(self, program_id: str) -> None:
        """The program is done: drop its pin and forget it."""
        now = self.clock.now()
        if self.kv.unpin(program_id, now):
            self.stats.pins_released_at_end += 1
            self._order_dirty = True
        prog = self.programs.end(program_id)
        if prog is not None:
            self.policy.on_program_end(prog)

    def release_program(self, program_id: str) -> bool:
        """A client's explicit release: drop the pin, keep the program."""
        released = self.kv.unpin(program_id, self.clock.now()) > 0
        if released:
            self._order_dirty = True  # its waiting requests lose the pinned-first place
        return released

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def _running_tokens(self) -> int:
        return sum(r.num_computed_tokens for r in self.running)

    def _push_waiting(self, req: Request) -> None:
        self.waiting.append(req)
        self._waiting_programs[req.program_id] += 1
        self._order_dirty = True

    def _remove_waiting(self, req: Request) -> None:
        self.waiting.remove(req)
        self._drop_waiting_program(req.program_id)

    def _drop_waiting_program(self, pid: str) -> None:
        c = self._waiting_programs[pid] - 1
        if c:
            self._waiting_programs[pid] = c
        else:
            del self._waiting_programs[pid]

    def _key(self, req: Request, now: float) -> tuple:
        return self.policy.priority(req, req.program, now)

    def _expire_idle(self, now: float) -> None:
        """Programs whose clients went quiet without ending them end here, for
        the statistics too: on a live server most programs end this way."""
        busy = {r.program_id for r in self.running} | set(self._waiting_programs) | set(self.kv.pins)
        for prog in self.programs.expire_idle(now, busy):
            self.policy.on_program_end(prog)

    # --- pins ---

    def _release_pins(self, now: float) -> None:
        pins = self.kv.pins
        if not pins:
            return
        for pid in [p for p, pin in pins.items() if pin.expiry <= now and p not in self._waiting_programs]:
            self.kv.unpin(pid, now)
            self.stats.pins_expired += 1
            self._order_dirty = True
        for pid in self.policy.review_pins(pins, now):
            # a program whose next turn already waits keeps its pin (as with expiry)
            if pid in pins and pid not in self._waiting_programs:
                self.kv.unpin(pid, now)
                self.stats.pins_released_early += 1
                self._order_dirty = True

    def _reclaim_pin(self, req: Request, any_program: bool, now: float) -> bool:
        """Release the pin of the latest-arriving program (later than `req`'s,
        unless `any_program`) among those whose release returns at least one
        block to the free set: a pin whose blocks others also hold frees
        nothing, and dropping it would only cost its program the retention.
        True if one was released."""
        pins = self.kv.pins
        if not pins:
            return False
        mine = req.program.arrival_time
        candidates = [pin for pid, pin in pins.items()
                      if pid != req.program_id and (any_program or pin.program_arrival > mine)]
        candidates.sort(key=lambda p: p.program_arrival, reverse=True)
        for pin in candidates:
            if self.kv.reclaimable_blocks(pin.program_id):
                self.kv.unpin(pin.program_id, now)
                self.stats.pins_reclaimed += 1
                self._order_dirty = True
                return True
        return False

    # --- the step ---

    def schedule(self) -> SchedulerOutput:
        now = self.clock.now()
        self.stats.steps += 1
        self._release_pins(now)  # first: a program whose pin expires now may be idle
        if now >= self._next_expiry:
            self._expire_idle(now)
            self._next_expiry = now + self.programs.idle_timeout / EXPIRY_CHECKS_PER_TIMEOUT
        out = SchedulerOutput(block_table=self.kv.block_ids)
        step = StepBudget(self.config.max_num_batched_tokens, self.step_model, self.config.min_prefill_chunk)

        # 1. Running requests: decodes first, then prefill chunks, each in admission order.
        decoding, prefilling = [], []
        for req in self.running:
            (decoding if self._is_decoding(req) else prefilling).append(req)
        drafts = self.speculator.plan_step(decoding, self.step_model, self.kv.num_free_blocks - len(self.running))
        for req in decoding:
            if step.budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue
            draft = drafts.get(req)
            if draft and not self._draft_slots(req, draft, step):
                del drafts[req]
                draft = None
            if self._schedule_running(req, 1, step, now, out):
                step.add(req, 1 + len(draft) if draft else 1)
                step.decode_rows += 1
                step.decode_context += req.num_computed_tokens + 1
                if draft:
                    step.draft_rows += len(draft)
                    step.draft_context += draft_features([ScheduledChunk(req, req.num_computed_tokens, 1, True,
                                                                        tuple(draft))])[1]
        if prefilling or self.waiting:
            step.time_left = self._prefill_time_left(step)
        for req in prefilling:
            if step.budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted for an earlier request
            start = req.num_computed_tokens
            n = step.allow(start, min(req.num_tokens - start, step.budget))
            if n <= 0:
                break  # the step-time target is spent
            if self._schedule_running(req, n, step, now, out):
                step.add_prefill(req, start, n)

        # 2. Waiting requests in priority order (not in a step that had to preempt).
        if not out.preempted and self.waiting and step.budget > 0:
            if self._order_dirty or self.policy.time_dependent:
                self.waiting.sort(key=lambda r: self._key(r, now))
                self._order_dirty = False
            admitted: set[Request] = set()
            # blocks the running requests may still take: admissions add their own, nothing else
            # changes it during the loop (computed once: it is a sum over every running request)
            held = self._reserved_for_running()
            leaders = prefill_leaders(self.running, self.kv.block_size) if self.config.group_prefill else None
            for req in self.waiting:
                if step.budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                    break
                match = self.kv.match(req.token_ids)
                if leaders and follows(req, match.num_tokens, leaders, self.kv.block_size):
                    if not req.followed:
                        req.followed = True
                        self.stats.grouped_requests += 1
                    continue  # admitted once its leader has computed (and indexed) the shared blocks
                if not self._admit(req, step, now, match, held):
                    break
                admitted.add(req)
                held = self._reserved_for_running() if held is None else held + self._reserve_of(req)
                if leaders is not None and req.num_tokens - req.num_computed_tokens > self.kv.block_size:
                    leaders.append(req)
            if admitted:
                for req in admitted:
                    self._drop_waiting_program(req.program_id)
                self.waiting = [r for r in self.waiting if r not in admitted]

        if step.capped:
            self.stats.capped_steps += 1
        for req, n in step.scheduled.items():
            start = req.num_computed_tokens
            draft = drafts.get(req)
            if draft:
                out.chunks.append(ScheduledChunk(req, start, n, True, tuple(draft)))
            else:
                out.chunks.append(ScheduledChunk(req, start, n, start + n == req.num_tokens))
            req.num_computed_tokens = start + n
        out.blocks_to_offload, out.blocks_to_load = self.kv.take_copies()
        return out

    @staticmethod
    def _is_decoding(req: Request) -> bool:
        """Its next chunk is one decode token (a preempted request recomputing its
        prompt and output is prefilling until it has caught up)."""
        return req.num_computed_tokens >= req.num_prompt_tokens and req.num_tokens - req.num_computed_tokens == 1

    # --- speculation ---

    def _draft_slots(self, req: Request, draft: list[int], step: StepBudget) -> bool:
        """Cut `draft` to the step's token budget and give it KV slots from free
        blocks only: speculation never reclaims a pin or preempts a request."""
        del draft[max(0, step.budget - 1):]
        if not draft:
            return False
        if self.kv.blocks_for(req.num_computed_tokens + 1 + len(draft)) - self.kv.num_blocks_of(req.request_id) \
                > self.kv.num_free_blocks - len(self.running):
            return False
        return self.kv.allocate_slots(req.request_id, req.num_computed_tokens + 1 + len(draft))

    def _schedule_running(self, req: Request, n: int, step: StepBudget, now: float, out: SchedulerOutput) -> bool:
        """KV for `n` more tokens of running `req`: reclaim later programs' pins,
        then preempt the lowest-priority running request admitted at or after
        `req` (ties: the most recently admitted, least progress lost) until it
        fits. False if `req` itself was preempted."""
        while not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n):
            if self._reclaim_pin(req, any_program=len(self.running) == 1, now=now):
                continue
            later = self.running[self.running.index(req):]
            victim = max(reversed(later), key=lambda r: self._key(r, now))
            step.drop(victim)  # a decode admitted after `req` and already scheduled
            self._preempt(victim, now, out)
            if victim is req:
                return False
        return True

    def _prefill_time_left(self, step: StepBudget) -> float | None:
        """Seconds of prefill the step may add under the step-time target; None
        when no cap applies (no decode this step, no target, too few samples)."""
        target = self.config.max_step_ms_with_decodes
        if not step.decode_rows or not target or not self.step_model.ready:
            return None
        return target / 1000.0 - self.step_model.base_time(step.decode_rows, step.decode_context, step.draft_rows,
                                                           step.draft_context)

    def _admit(self, req: Request, step: StepBudget, now: float, match, held: int | None) -> bool:
        hit = match.num_tokens
        loaded = match.num_host_tokens  # before admit: admit gives those nodes device blocks
        n = step.allow(hit, min(req.num_tokens - hit, step.budget))
        if n <= 0:
            return False  # the step-time target is spent
        own_pin_released = False
        while not (self._has_headroom(req, match, held) and self.kv.admit(req.request_id, match, n, now)):
            nothing_runs = not self.running
            if self._reclaim_pin(req, any_program=nothing_runs, now=now):
                continue
            if nothing_runs and req.program_id in self.kv.pins:
                # Its own pin holds blocks this turn does not reuse (the partial
                # last block at least) and nothing else can free memory: release
                # it; the matched blocks stay cached and are revived by admit.
                self.kv.unpin(req.program_id, now)
                own_pin_released = True
                self._order_dirty = True
                continue
            return False
        prog = req.program
        # its blocks now belong to the request
        pinned = self.kv.unpin(req.program_id, now) > 0 or own_pin_released
        if pinned:
            self.stats.pins_hit += 1
            self._order_dirty = True
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
        req.num_computed_tokens = hit
        req.status = RequestStatus.RUNNING
        req.preempted = False
        self.running.append(req)
        step.add_prefill(req, hit, n)
        return True

    def _ahead(self, req: Request) -> int:
        """Tokens `req` still needs KV for under the policy's headroom: all it
        has, plus its remaining output up to Policy.decode_reserve_tokens."""
        return req.num_tokens + min(req.max_tokens - req.num_output_tokens, self.policy.decode_reserve_tokens)

    def _reserved_for_running(self) -> int | None:
        """Blocks the running requests may still take within their headroom;
        None when no headroom applies (the policy keeps none, or nothing runs,
        so a request that fits the cache at all is never held back)."""
        if self.policy.decode_reserve_tokens <= 0 or not self.running:
            return None
        return sum(self._reserve_of(r) for r in self.running)

    def _reserve_of(self, req: Request) -> int:
        return max(0, self.kv.blocks_for(self._ahead(req)) - self.kv.num_blocks_of(req.request_id))

    def _has_headroom(self, req: Request, match, held: int | None) -> bool:
        """`req`'s whole prompt and reserved output fit in the free blocks that
        the running requests' reserves (`held`) leave."""
        if held is None:
            return True
        return self.kv.admit_need(match, self._ahead(req) - match.num_tokens) + held <= self.kv.num_free_blocks

    def _preempt(self, req: Request, now: float, out: SchedulerOutput) -> None:
        self.running.remove(req)
        if self.policy.swap_on_preempt(req) and self.kv.host.enabled:
            self.kv.swap_out(req.request_id, now)
        else:
            self.kv.free(req.request_id, now)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.preempted = True
        req.num_preemptions += 1
        req.waiting_since = now
        self.stats.preemptions += 1
        self._push_waiting(req)
        out.preempted.append(req)

    # --- after the step ---

    def update(self, out: SchedulerOutput, result: ExecutorResult) -> list[Request]:
        """Apply sampled tokens; returns the requests that finished this step."""
        now = self.clock.now()
        finished = []
        limit = self.config.max_model_len
        stats = self.stats
        stats.execute_s += result.elapsed
        stats.executed_steps += 1
        prefill, attention, decodes, context = step_features(out.chunks)
        drafts, draft_context = draft_features(out.chunks)
        for ch in out.chunks:
            req = ch.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted during the step
            req.program.attained_service += result.elapsed
            if not ch.sample:
                self.kv.commit(req.request_id, req.token_ids, req.num_computed_tokens)
                continue
            tokens = result.sampled.get(req.request_id, ())
            if ch.draft:
                tokens = self.speculator.verify(req, ch.draft, tokens)
            elif tokens and req.spec is not None:
                self.speculator.observe_shadow(req, tokens[0])
            status = None
            for tok in tokens:
                stats.decode_tokens += 1
                req.append_output(tok)
                if req.first_token_time is None:
                    req.first_token_time = now
                status = self.token_hook(req, tok) if self.token_hook is not None else None
                if status is None:
                    if tok in req.eos_token_ids:
                        status = RequestStatus.FINISHED_STOPPED
                    elif req.num_output_tokens >= req.max_tokens or (limit is not None and req.num_tokens >= limit):
                        status = RequestStatus.FINISHED_LENGTH
                if status is not None:
                    break
            if ch.draft:
                # KV stands for every token but the last sampled one; blocks the
                # rejected draft tokens took go back
                req.num_computed_tokens = req.num_tokens - 1
                self.kv.trim_slots(req.request_id, req.num_tokens, now)
            self.kv.commit(req.request_id, req.token_ids, req.num_computed_tokens)
            if status is not None:
                self._finish(req, status, now)
                finished.append(req)
        stats.prefill_tokens += prefill
        if decodes:
            stats.decode_steps += 1
            stats.decode_step_max_s = max(stats.decode_step_max_s, result.elapsed)
            stats.decode_step_history.append(result.elapsed)
        # Steps with host copies are left out of the fit: their time is not the forward pass's.
        if self.config.max_step_ms_with_decodes and not out.blocks_to_load and not out.blocks_to_offload:
            self.step_model.observe(prefill, attention, decodes, context, result.elapsed, drafts, draft_context)
        return finished

    def finish_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_STOPPED) -> None:
        """End a running request early (a stop string matched outside the engine)."""
        req = self._requests.get(request_id)
        if req is not None and req.status is RequestStatus.RUNNING:
            self._finish(req, status, self.clock.now())

    def _finish(self, req: Request, status: RequestStatus, now: float) -> None:
        self.running.remove(req)
        req.status = status
        req.finish_time = now
        self._requests.pop(req.request_id, None)
        prog = req.program
        prog.turns_finished += 1
        prog.last_finish_time = now
        rid, pid = req.request_id, req.program_id
        if req.is_last_turn or prog.anonymous or prog.ended:
            # (ended: the client ended the program while this turn ran; nothing comes back)
            self.kv.free(rid, now)
            if not prog.ended:
                self.end_program(pid)
            return
        decision = self.policy.on_turn_end(req, prog, now)
        prog.last_tool = req.tool_name
        prog.history = req.token_ids
        if decision.action == "pin" and decision.ttl > 0:
            self.kv.pin(pid, rid, now + decision.ttl, prog.arrival_time, now)
            self.stats.pins_created += 1
            self.stats.ttl_sum += decision.ttl
            self._record_ttl(decision.ttl)
            self._order_dirty = True
        elif decision.action == "swap":
            self.kv.swap_out(rid, now)
        else:
            self.kv.free(rid, now)

    def _record_ttl(self, ttl: float) -> None:
        h = self.stats.ttl_history
        h.append(ttl)
        if len(h) > 4096:
            del h[:2048]

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        for r in self.running:
            assert r.status is RequestStatus.RUNNING and self.kv.num_blocks_of(r.request_id) > 0
        for r in self.waiting:
            assert r.status is RequestStatus.WAITING and self.kv.num_blocks_of(r.request_id) == 0
        assert sum(self._waiting_programs.values()) == len(self.waiting)
