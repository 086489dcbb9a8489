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
of a step always gets `min_prefill_chunk` tokens, so prefills progress (and
speculation's drafts leave room for it); until the model has seen enough steps
to price a chunk, a step with decodes computes a few such chunks at most.

A decode may carry a speculative draft that the step verifies
(engine/spec_decode.py: which drafts, and what stands of them); a waiting
request whose next prompt block a running prefill is about to compute waits
for it (engine/grouped_prefill.py)."""

from __future__ import annotations

from collections.abc import Callable

from agentserve.clock import Clock
from agentserve.engine.admission import Admission
from agentserve.engine.grouped_prefill import follows, prefill_leaders
from agentserve.engine.pin_review import PinReview
from agentserve.engine.prefetch import Prefetcher
from agentserve.engine.preemption import Preemption
from agentserve.engine.program_ends import ProgramEnds
from agentserve.engine.request import Request, RequestStatus
from agentserve.engine.scheduler_config import SchedulerConfig, SchedulerStats
from agentserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from agentserve.engine.spec_decode import Speculator
from agentserve.engine.step_results import StepResults
from agentserve.engine.step_budget import StepBudget
from agentserve.engine.step_time import StepTimeModel, draft_context
from agentserve.engine.waiting_queue import WaitingQueue
from agentserve.kv.manager import KVCacheManager
from agentserve.policy.base import Policy, PolicyContext
from agentserve.policy.registry import make_policy
from agentserve.policy.program import ProgramTable
from agentserve.policy.pressure import PressureMeter, TurnoverMeter

class Scheduler(PinReview, Admission, Preemption, StepResults, ProgramEnds):
    """Pin review and reclaim (pin_review.py), admission under the policy's
    headroom (admission.py), preemption and giving up KV (preemption.py), what
    follows a step (step_results.py) and programs' ends (program_ends.py) are
    defined beside this module and share this state."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, policy: str | Policy,
                 clock: Clock, reload_cost: Callable[[int], float] | None = None,
                 policy_options: dict | None = None, prefill_cost: Callable[[int], float] | None = None,
                 tier_reload: dict[str, Callable[[int], float]] | None = None) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock
        self.programs = ProgramTable(config.program_idle_timeout)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # the one registry of requests in flight, by id
        # Called with (request, token) for each new token before the finish checks; may
        # return a finished status (the engine's stop strings). None: no output processing.
        self.token_hook: Callable[[Request, int], RequestStatus | None] | None = None
        self.stats = SchedulerStats()
        self.pressure = PressureMeter()  # how often waiting requests are held back for KV
        self._kv_blocked = False  # this step held a request back for KV, or preempted
        # how long a copy lasts in each tier below the device
        self._turnover = {t.name: TurnoverMeter(t.num_slots) for t in (kv.host, kv.disk)}
        if isinstance(policy, str):
            ctx = PolicyContext(
                reload_cost=reload_cost or (lambda n: 0.0),
                programs=self.programs,
                is_pinned=lambda pid: pid in self.kv.pins,
                running_tokens=self._running_tokens,
                host_tier=kv.host.enabled,
                kv_pressure=lambda: self.pressure.value(self.clock.now()),
                prefill_cost=prefill_cost,
                tier_reload={name: fn for name, fn in (tier_reload or {}).items() if self._tier(name).enabled},
                tier_residency=lambda name: self._turnover[name].residency(),
                kv_tokens=kv.num_blocks * kv.block_size,
            )
            policy = make_policy(policy, ctx, **(policy_options or {}))
        self.policy = policy
        self.waiting = WaitingQueue(lambda req, now: policy.priority(req, req.program, now),
                                    lambda: policy.time_dependent)
        self._overdue: set[str] = set()  # expired pins kept because their program's next turn waits
        self._held = 0  # the running requests' reserves (admission.py), kept as they change
        self._next_expiry = 0.0
        self.step_model = StepTimeModel(shape=config.attention_shape)
        self.speculator = Speculator(config.speculation)
        self.prefetcher = Prefetcher(kv, self.stats)  # reloads before a program's predicted return

    # --- requests in and out ---

    def add_request(self, req: Request) -> None:
        limit = self.config.max_model_len
        if limit is not None and req.num_prompt_tokens >= limit:
            raise ValueError(f"prompt of {req.num_prompt_tokens} tokens does not fit max_model_len {limit}")
        need = self.kv.pages_for(req.num_prompt_tokens + req.max_tokens)
        if need > self.kv.num_blocks:
            raise ValueError(f"request needs {need} KV blocks (prompt {req.num_prompt_tokens} + max_tokens "
                             f"{req.max_tokens}), the cache has {self.kv.num_blocks}")
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        now = self.clock.now()
        prog = self.programs.touch(req.program_id, now)
        prog.anonymous = req.anonymous
        req.program = prog
        if self.prefetcher:
            req.prefetch = self.prefetcher.on_turn(req.program_id, now)
        if prog.history is not None:
            self.stats.superseded_blocks += self.kv.supersede(req.program_id, prog.history, req.token_ids, now,
                                                                req.cache_salt)
            prog.history = None
        self.policy.on_arrival(req, prog, now)
        req.status = RequestStatus.WAITING
        req.waiting_since = now
        self.requests[req.request_id] = req
        self.waiting.push(req, now)

    def abort(self, request_id: str) -> Request | None:
        """Stop a request wherever it is; its KV is freed, its program lives on."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        now = self.clock.now()
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
            if req.num_cached_tokens < 0:  # never admitted
                self.policy.on_withdrawn(req, now)
        elif req.status is RequestStatus.RUNNING:
            self._stop_running(req)
            self._release_table(req, now)
        req.status = RequestStatus.FINISHED_ABORTED
        req.finish_time = now
        del self.requests[request_id]
        return req

    def _stop_running(self, req: Request) -> None:
        """`req` leaves the running set (finished, aborted or preempted)."""
        self.running.remove(req)
        self._held -= req.reserve
        req.reserve = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def copies_in_flight(self) -> bool:
        """Copies handed to an overlapping executor that it has not reported yet."""
        return self.kv.copies_in_flight

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def _running_tokens(self) -> int:
        return sum(r.num_computed_tokens for r in self.running)

    def _key(self, req: Request, now: float) -> tuple:
        return self.policy.priority(req, req.program, now)

    # --- the step ---

    def schedule(self) -> SchedulerOutput:
        now = self.clock.now()
        self.stats.steps += 1
        self._release_pins(now)  # first: a program whose pin expires now may be idle
        self.expire_programs(now)
        if self.prefetcher:
            self.prefetcher.settle(now)
        out = SchedulerOutput()
        kv_blocked_before, self._kv_blocked = self._kv_blocked, False
        step = StepBudget(self.config.max_num_batched_tokens, self.step_model, self.config.min_prefill_chunk)

        # 1. Running requests: decodes first, then prefill chunks, each in admission order.
        # (a preempted request recomputing its prompt and output is prefilling until it caught up)
        decoding, prefilling = [], []
        kv = self.kv
        for req in self.running:
            if req.block_table.loads and kv.loads_pending(req.block_table):
                continue  # its reloads have not landed: it waits for them, the others compute
            c = req.num_computed_tokens
            (decoding if c >= req.num_prompt_tokens and len(req.token_ids) - c == 1 else prefilling).append(req)
        target = self.config.max_step_ms_with_decodes
        drafts = self.speculator.plan_step(decoding, self.step_model, self.kv.num_free_blocks - len(self.running),
                                           target / 1000.0 if target else None,
                                           self._prefill_at(prefilling, kv_blocked_before),
                                           self.config.min_prefill_chunk)
        step.per_token = self.speculator.fewest_tokens
        room = self.kv.block_size
        scheduled = step.scheduled
        rows = context = 0
        keys = None if self.step_model.shape.window is None else self.step_model.shape.context
        budget = step.budget  # a local while no call can change it (it runs per row)
        for req in decoding:
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue
            c = req.num_computed_tokens
            draft = drafts.get(req) if drafts else None
            if draft is None and c < len(req.block_table.blocks) * room:
                scheduled[req] = 1  # the common case: a slot is free in its last block
                budget -= 1
            else:  # (a preemption here takes rows back from the step: the locals go through it)
                step.budget, step.decode_rows, step.decode_context = budget, rows, context
                if draft and not self._draft_slots(req, draft, step):
                    del drafts[req]
                    draft = None
                    step.per_token = 1.0  # a stream without its draft gets one token
                ok = self._schedule_running(req, 1, step, now, out)
                if ok:
                    step.add(req, 1 + len(draft) if draft else 1)
                    if draft:
                        step.draft_rows += len(draft)
                        step.draft_context += draft_context(c, len(draft))
                budget, rows, context = step.budget, step.decode_rows, step.decode_context
                if not ok:
                    continue
            rows += 1
            context += c + 1 if keys is None else keys(c + 1)
        step.budget = budget
        step.decode_rows = rows
        step.decode_context = context
        if prefilling or self.waiting:
            step.time_left = step.prefill_time_left(self.config.max_step_ms_with_decodes)
            step.cold = bool(step.decode_rows and self.config.max_step_ms_with_decodes and not self.step_model.ready)
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
            self._admit_waiting(step, now, prefilling)

        if self.prefetcher:  # after admission: the running requests' headroom and the next waiting turn go first
            head = next(iter(self.waiting), None)
            room = self.kv.num_free_blocks - self._held - (self.kv.blocks_for(head.num_tokens) if head else 0)
            self.prefetcher.issue(now, room, self._kv_blocked)
        if step.capped:
            self.stats.capped_steps += 1
        add = out.chunks.append
        chunk = ScheduledChunk
        for req, n in scheduled.items():
            start = req.num_computed_tokens
            draft = drafts.get(req) if drafts else None
            if draft:
                add(chunk(req, start, n, True, tuple(draft)))
            else:
                add(chunk(req, start, n, start + n == len(req.token_ids)))
            req.num_computed_tokens = start + n
        out.features = step.features
        out.copy_ticket = ticket = self.stats.steps
        out.blocks_to_offload, out.blocks_to_load = kv.take_copies(ticket)
        out.blocks_to_spill, out.blocks_to_load_disk = kv.take_disk_copies(ticket)
        out.blocks_to_stage = kv.take_stages(ticket)
        self.pressure.observe(now, self._kv_blocked)
        for tier in (kv.host, kv.disk):
            if tier.enabled:
                self._turnover[tier.name].observe(now, tier.num_stored)
        return out

    def _tier(self, name: str):
        return {"host": self.kv.host, "disk": self.kv.disk}[name]

    def _admit_waiting(self, step: StepBudget, now: float, prefilling: list[Request]) -> None:
        """Admit waiting requests in priority order while they fit (the head
        blocks the rest: no request overtakes a higher-priority one that does not
        fit), skipping those that follow a running prefill of their prefix."""
        self.waiting.order(now)
        admitted: list[Request] = []
        reserving = self.policy.decode_reserve_tokens > 0
        hybrid = self.kv.parts is not None
        bs = self.kv.block_size
        # (decoding requests never lead: they have one token left)
        leaders = prefill_leaders(prefilling, bs) if self.config.group_prefill else None
        prefetch = self.prefetcher if self.prefetcher else None
        for req in self.waiting:
            if step.budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if prefetch is not None and prefetch.in_flight(req.program_id):
                continue  # its KV is on its way back: admitted once it landed, not recomputed
            match = self.kv.match(req.token_ids, req.cache_salt, req.program.chain)
            if leaders and follows(req, match.num_tokens, leaders, bs):
                if not req.followed:
                    req.followed = True
                    self.stats.grouped_requests += 1
                continue  # admitted once its leader has computed (and indexed) the shared blocks
            # blocks the running requests may still take (None: no headroom applies). The policy may
            # hold a late request back only for KV (no headroom, as vLLM admits); under the hybrid
            # cache it still needs room for its own prompt: admitted on its first chunk alone, it
            # preempted itself at its next one (whose window parts take `pages` blocks a block), again
            # and again (4,046 times in 200 SWE-bench programs in the simulator)
            held = None
            if reserving and self.running:
                held = self._held if not self.policy.skips_headroom(req, now) else (0 if hybrid else None)
            if not self._admit(req, step, now, match, held):
                break
            admitted.append(req)
            if leaders is not None and req.num_tokens - req.num_computed_tokens > bs:
                leaders.append(req)
        self.waiting.remove_all(admitted)

    # --- speculation ---

    def _draft_slots(self, req: Request, draft: list[int], step: StepBudget) -> bool:
        """Cut `draft` to the step's token budget and give it KV slots from free
        blocks only: speculation never reclaims a pin or preempts a request."""
        del draft[max(0, step.budget - 1):]
        if not draft:
            return False
        if self.kv.blocks_for(req.num_computed_tokens + 1 + len(draft)) - len(req.block_table) \
                > self.kv.num_free_blocks - len(self.running):
            return False
        if not self.kv.allocate_slots(req.block_table, req.num_computed_tokens + 1 + len(draft)):
            return False
        self._rereserve(req)
        return True

    def _prefill_at(self, prefilling: list[Request], kv_blocked: bool) -> int | None:
        """Where this step's first prefill chunk starts: the first running
        prefill's position, else (a guess, before admission matches its
        prefix) a waiting turn's delta at the end of its prompt; None when no
        prefill waits, or the waiting ones were held back for KV last step."""
        if prefilling:
            return prefilling[0].num_computed_tokens
        if self.waiting and not kv_blocked and len(self.running) < self.config.max_num_seqs:
            return max(0, next(iter(self.waiting)).num_prompt_tokens - self.config.min_prefill_chunk)
        return None

    def check_integrity(self) -> None:
        self.kv.check_integrity(r.block_table for r in self.running)
        for r in self.running:
            assert r.status is RequestStatus.RUNNING and r.block_table is not None and len(r.block_table) > 0
        for r in self.waiting:
            assert r.status is RequestStatus.WAITING and r.block_table is None
        self.waiting.check()
        if self.policy.decode_reserve_tokens > 0:
            for r in self.running:
                assert r.reserve == self._reserve_of(r), f"{r}: reserve {r.reserve}, now {self._reserve_of(r)}"
        assert self._held == sum(r.reserve for r in self.running), "the running requests' reserves drifted"
