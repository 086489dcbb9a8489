"""agentserve's policy as vLLM's scheduler. vLLM keeps doing everything it does;
the subclass changes three things and calls the keeper (keeper.py) for each:

- the waiting queue is ordered by the policy's priority (program order: pinned
  programs' turns and programs under way first), not by arrival;
- a finished turn's KV blocks are held for the TTL the policy gives (they stay
  referenced, so vLLM's prefix cache serves the program's next turn) and given
  back to vLLM's pool when the TTL runs out, the policy's review drops them, the
  program ends, or its next turn has been admitted on them;
- an allocation that fails while blocks are held releases pins (the latest
  program's first; with nothing else running, any, the request's own last) and
  tries again, so a pin never makes vLLM preempt a running request or stall the
  queue.

Program identity comes from vLLM's `session_id` (body field or `X-Session-ID`
header) or `vllm_xargs` (`program_id`, Continuum's `job_id` and
`is_last_step`, `ttl`, `end_program`, `release_program`). The policy spec is
read from `AGENTSERVE_POLICY` (default `agentserve`, the options as
`agentserve serve --policy` takes them); `AGENTSERVE_MAX_PINNED_SHARE` caps the
share of the pool pins may hold (default 0.9)."""

from __future__ import annotations

import logging
import os

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from agentserve.clock import WallClock
from agentserve.integrations.vllm.keeper import ProgramKeeper, Turn, turn_identity
from agentserve.integrations.vllm.metrics import PinMetrics, multiprocess_export
from agentserve.integrations.vllm.versions import require_supported

log = logging.getLogger("agentserve.vllm")
ENV_POLICY = "AGENTSERVE_POLICY"
ENV_MAX_PINNED_SHARE = "AGENTSERVE_MAX_PINNED_SHARE"
_SUMMARY_EVERY_S = 60.0
_KEPT = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


def _log_as_vllm() -> None:
    """The plugin's log lines through vLLM's handlers and level, so they sit in vLLM's log as its own do."""
    ours, theirs = logging.getLogger("agentserve.vllm"), logging.getLogger("vllm")
    if theirs.handlers and not ours.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.level)
        ours.propagate = False


class ProgramQueue(RequestQueue):
    """vLLM's waiting queue in the policy's order: sorted when read after a change,
    and on every read for a policy whose priorities move with time."""

    def __init__(self, key, time_dependent: bool, now) -> None:
        self._items: list[Request] = []
        self._key = key
        self._now = now
        self._time_dependent = time_dependent
        self._sorted = True

    def _order(self) -> list[Request]:
        if not self._sorted or self._time_dependent:
            now = self._now()
            self._items.sort(key=lambda r: self._key(r, now))
            self._sorted = True
        return self._items

    def add_request(self, request: Request) -> None:
        self._items.append(request)
        self._sorted = False

    def pop_request(self) -> Request:
        items = self._order()
        if not items:
            raise IndexError("pop from an empty queue")
        return items.pop(0)

    def peek_request(self) -> Request:
        items = self._order()
        if not items:
            raise IndexError("peek from an empty queue")
        return items[0]

    def prepend_request(self, request: Request) -> None:  # the policy decides where it goes
        self.add_request(request)

    def prepend_requests(self, requests) -> None:
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: Request) -> None:
        self._items.remove(request)

    def remove_requests(self, requests) -> None:
        gone = requests if isinstance(requests, set) else set(requests)
        self._items = [r for r in self._items if r not in gone]

    def __bool__(self) -> bool:
        return bool(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(list(self._order()))


class ProgramScheduler(Scheduler):
    def __new__(cls, vllm_config, *args, **kwargs):
        # One name for users: with async scheduling on (vLLM's default where it can), the
        # async variant, so the plugin does not cost vLLM its overlap of steps.
        if cls is ProgramScheduler and vllm_config.scheduler_config.async_scheduling:
            cls = AsyncProgramScheduler
        return super().__new__(cls)

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        require_supported()
        super().__init__(vllm_config, *args, **kwargs)
        _log_as_vllm()
        self.clock = WallClock()
        pool = self.kv_cache_manager.block_pool
        share = float(os.environ.get(ENV_MAX_PINNED_SHARE, "0.9"))
        self.keeper = ProgramKeeper(
            os.environ.get(ENV_POLICY, "agentserve"), self.clock, num_blocks=pool.num_gpu_blocks,
            block_size=self.block_size, release_blocks=self._give_back,
            frees_any=lambda blocks: any(b.ref_cnt == 1 for b in blocks), max_pinned_share=share)
        self.turns: dict[str, Turn] = {}
        self.waiting = ProgramQueue(self._waiting_key, self.keeper.policy.time_dependent, self.clock.now)
        self._allocate_slots = self.kv_cache_manager.allocate_slots
        self.kv_cache_manager.allocate_slots = self._allocate  # reclaim pins before vLLM gives up
        self._tokenizer = None
        if not vllm_config.model_config.skip_tokenizer_init:
            from vllm.tokenizers import cached_tokenizer_from_config

            self._tokenizer = cached_tokenizer_from_config(vllm_config.model_config)
        self.metrics = PinMetrics()
        # each step's start and prompt tokens, by its output (with a batch queue a schedule
        # may have no update of its own, or the update comes a step later)
        self._steps: dict[int, tuple[float, int]] = {}
        self._last_update = self.clock.now()
        self._blocked = False
        self._next_summary = self.clock.now() + _SUMMARY_EVERY_S
        log.info("agentserve scheduler: policy %s, pins up to %d of %d blocks%s", self.keeper.spec,
                 self.keeper.max_pinned_blocks, pool.num_gpu_blocks,
                 "" if multiprocess_export() else " (PROMETHEUS_MULTIPROC_DIR unset: the plugin's series stay "
                 "out of /metrics; a summary is logged instead)")

    # --- requests in ---

    def add_request(self, request: Request) -> None:
        if request.request_id not in self.requests:
            extra = request.sampling_params.extra_args if request.sampling_params is not None else None
            ident = turn_identity(request.session_id, extra)
            self.turns[request.request_id] = self.keeper.arrive(request.request_id, ident,
                                                                request.num_prompt_tokens)
        super().add_request(request)

    def _turn(self, request: Request) -> Turn:
        turn = self.turns.get(request.request_id)
        if turn is None:  # a request that reached the queue without add_request (none known)
            turn = self.turns[request.request_id] = self.keeper.arrive(
                request.request_id, turn_identity(None, None), request.num_prompt_tokens)
        return turn

    def _waiting_key(self, request: Request, now: float) -> tuple:
        turn = self._turn(request)
        turn.preempted = request.num_preemptions > 0
        turn.num_computed_tokens = request.num_computed_tokens
        return self.keeper.priority(turn, now)

    # --- a step ---

    def schedule(self, *args, **kwargs):
        self.keeper.running_tokens = sum(r.num_computed_tokens for r in self.running)
        self.keeper.release_due(self.turns[r.request_id].program_id for r in self.waiting
                                if r.request_id in self.turns)
        self._blocked = False
        out = super().schedule(*args, **kwargs)
        for new in out.scheduled_new_reqs:
            turn = self.turns.get(new.req_id)
            if turn is not None:
                self.keeper.admitted(turn, new.num_computed_tokens)
        if out.total_num_scheduled_tokens > 0:
            if len(self._steps) > 64:  # outputs that never came back
                self._steps.clear()
            decodes = len(out.num_scheduled_tokens)
            self._steps[id(out)] = (self.clock.now(), max(0, out.total_num_scheduled_tokens - decodes))
        self.metrics.update(self.keeper.counts, self.keeper.pinned_blocks)
        self._summarize()
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        now = self.clock.now()
        step = self._steps.pop(id(scheduler_output), None)
        if step is not None:
            started, prefill = step
            self.keeper.observe_step(prefill, now - max(started, self._last_update), self._blocked)
        self._last_update = now
        return super().update_from_output(scheduler_output, model_runner_output)

    def _allocate(self, request: Request, *args, **kwargs):
        blocks = self._allocate_slots(request, *args, **kwargs)
        while blocks is None and self.keeper.pins:
            turn = self._turn(request)
            any_program = (request.status == RequestStatus.RUNNING
                           or self.keeper.policy.late(turn, self.clock.now()))
            idle = all(r is request for r in self.running)
            if not self.keeper.make_room(turn, any_program, idle):
                break
            blocks = self._allocate_slots(request, *args, **kwargs)
        if blocks is None:
            self._blocked = True
        return blocks

    # --- requests out ---

    def _free_blocks(self, request: Request) -> None:
        turn = self.turns.pop(request.request_id, None)
        if turn is None:
            super()._free_blocks(request)
            return
        if not turn.admitted:
            self.keeper.withdrawn(turn)
        kept = request.status in _KEPT
        ttl = self.keeper.finish(turn, self._text(request) if kept else None, list(request.all_token_ids),
                                 aborted=not kept)
        if ttl <= 0 or not self._request_blocks_can_be_freed(request):
            super()._free_blocks(request)
            return
        blocks = self.kv_cache_manager.pop_blocks_for_free(request)
        del self.requests[request.request_id]
        # only full, hashed blocks can serve a prefix hit: the rest go back now, tail first
        held = [b for b in blocks if b.block_hash is not None and not b.is_null]
        rest = [b for b in blocks if b.block_hash is None or b.is_null]
        if rest:
            self._give_back(rest)
        self.keeper.hold(turn, held, ttl)

    def _give_back(self, blocks: list) -> None:
        self.kv_cache_manager.block_pool.free_blocks(reversed(blocks))

    def _text(self, request: Request) -> str | None:
        if self._tokenizer is None:
            return None
        return self._tokenizer.decode(list(request.output_token_ids), skip_special_tokens=False)

    def reset_prefix_cache(self, *args, **kwargs):
        # a reset drops every cached block: held ones first, or vLLM would find them in use
        self.keeper.release_all()
        return super().reset_prefix_cache(*args, **kwargs)

    def shutdown(self) -> None:
        self.keeper.release_all()
        super().shutdown()

    def _summarize(self) -> None:
        now = self.clock.now()
        if now < self._next_summary:
            return
        self._next_summary = now + _SUMMARY_EVERY_S
        c = self.keeper.counts
        if c.turns_finished == 0:
            return
        log.info("agentserve: %d programs pinned (%d blocks); pins %d, hits %d, expired %d, reclaimed %d, "
                 "released early %d, at end %d, refused %d", len(self.keeper.pins), self.keeper.pinned_blocks,
                 c.pins_created, c.pin_hits, c.pins_expired, c.pins_reclaimed, c.pins_released_early,
                 c.pins_released_at_end, c.pins_refused)


class AsyncProgramScheduler(ProgramScheduler, AsyncScheduler):
    """ProgramScheduler over vLLM's AsyncScheduler (chosen by ProgramScheduler itself)."""
