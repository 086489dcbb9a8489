"""What the engine thread tells the rest of the server: `EngineSnapshot`, the
scheduler and KV state at one instant (read by /metrics and the stats log
line), `take_snapshot`, which builds one on the engine thread, and
`EngineListener`, the progress callbacks the engine thread makes (the metrics
implement it)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from agentserve.engine.llm_engine import RequestOutput
from agentserve.engine.spec_decode import SpecStats
from agentserve.policy.toolcall_stream import ValidatorCounts

if TYPE_CHECKING:
    from agentserve.engine.scheduler import Scheduler


class EngineListener(Protocol):
    """Told about progress, on the engine thread (metrics implement it)."""

    def on_request_output(self, out: RequestOutput, now: float, last_token_time: float | None) -> None: ...

    def on_request_aborted(self) -> None: ...

    def on_program_end(self, jct: float) -> None: ...

    def on_ttl_decisions(self, ttls: list[float]) -> None: ...


@dataclass(frozen=True)
class EngineSnapshot:
    """Scheduler and KV state at one instant, taken on the engine thread."""

    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    num_pinned_blocks: int
    num_pinned_programs: int
    block_size: int
    steps: int
    preemptions: int
    admitted_prompt_tokens: int
    hit_tokens: int
    loaded_tokens: int
    pins_created: int
    pins_hit: int
    pins_expired: int
    pins_reclaimed: int
    pins_released_early: int
    pins_released_at_end: int
    prefill_tokens: int = 0
    decode_tokens: int = 0
    execute_s: float = 0.0
    executed_steps: int = 0
    capped_steps: int = 0  # steps whose prefill the step-time target held back
    decode_steps: int = 0  # executed steps with decodes running
    recent_decode_step_s: tuple[float, ...] = ()  # the latest of those steps' times, oldest first
    # the learned step-time model (engine/step_time.py): coefficients, margin; () until it has samples
    step_model: tuple[float, ...] = ()
    step_margin: float = 1.0
    speculation: SpecStats = field(default_factory=SpecStats)  # prompt-lookup speculation's counters
    grouped_requests: int = 0  # requests that waited for another's prefill of a shared prefix
    tool_calls: ValidatorCounts = ValidatorCounts()  # the streaming tool-call validators' counters
    # the server's caches: render_cache.RenderCacheStats, response_cache.ResponseCacheStats (None: off)
    render_cache: Any = None
    response_cache: Any = None
    # block-accounting checks (Scheduler.check_integrity) that failed when the engine went idle
    kv_integrity_failures: int = 0

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


def take_snapshot(scheduler: Scheduler, tool_calls: ValidatorCounts, render_cache: Any = None,
                  response_cache: Any = None, kv_integrity_failures: int = 0) -> EngineSnapshot:
    """The snapshot of `scheduler` (and its KV manager) now; on the engine thread.
    The caches are objects with `stats()` (None: off)."""
    s, kv = scheduler.stats, scheduler.kv
    return EngineSnapshot(
        num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
        num_blocks=kv.num_blocks, num_free_blocks=kv.num_free_blocks,
        num_pinned_blocks=kv.num_pinned_blocks, num_pinned_programs=len(kv.pins), block_size=kv.block_size,
        steps=s.steps, preemptions=s.preemptions, admitted_prompt_tokens=s.admitted_prompt_tokens,
        hit_tokens=s.hit_tokens, loaded_tokens=s.loaded_tokens, pins_created=s.pins_created,
        pins_hit=s.pins_hit, pins_expired=s.pins_expired, pins_reclaimed=s.pins_reclaimed,
        pins_released_early=s.pins_released_early, pins_released_at_end=s.pins_released_at_end,
        prefill_tokens=s.prefill_tokens, decode_tokens=s.decode_tokens, execute_s=s.execute_s,
        executed_steps=s.executed_steps, capped_steps=s.capped_steps, decode_steps=s.decode_steps,
        recent_decode_step_s=tuple(s.decode_step_history),
        step_model=scheduler.step_model.coefficients if scheduler.step_model.ready else (),
        step_margin=scheduler.step_model.margin, tool_calls=tool_calls,
        speculation=replace(scheduler.speculator.stats), grouped_requests=s.grouped_requests,
        render_cache=None if render_cache is None else render_cache.stats(),
        response_cache=None if response_cache is None else response_cache.stats(),
        kv_integrity_failures=kv_integrity_failures)
