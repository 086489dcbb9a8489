"""What the engine thread tells the rest of the server: `EngineSnapshot`, the
scheduler and KV state at one instant (read by /metrics and the stats log
line), `take_snapshot`, which builds one on the engine thread, and
`EngineListener`, the progress callbacks the engine thread makes (the metrics
implement it)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Protocol

from agentserve.engine.llm_engine import RequestOutput
from agentserve.engine.scheduler_config import SchedulerStats
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


_STAT_FIELDS = frozenset(f.name for f in fields(SchedulerStats))


@dataclass(frozen=True)
class EngineSnapshot:
    """Scheduler and KV state at one instant, taken on the engine thread. The
    scheduler's counters are its `SchedulerStats` (declared there once, copied
    here), read as the snapshot's own: `snapshot.steps` is `snapshot.stats.steps`."""

    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    num_pinned_blocks: int
    num_pinned_programs: int
    block_size: int
    num_protected_blocks: int = 0  # free blocks of multi-turn programs between turns (kv/protected_zone.py)
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    recent_decode_step_s: tuple[float, ...] = ()  # the latest times of steps with decodes, oldest first
    # the learned step-time model (engine/step_time.py): coefficients, margin; () until it has samples
    step_model: tuple[float, ...] = ()
    step_margin: float = 1.0
    speculation: SpecStats = field(default_factory=SpecStats)  # prompt-lookup speculation's counters
    tool_calls: ValidatorCounts = ValidatorCounts()  # the streaming tool-call validators' counters
    # the server's caches: render_cache.RenderCacheStats, response_cache.ResponseCacheStats (None: off)
    render_cache: Any = None
    response_cache: Any = None
    # block-accounting checks (Scheduler.check_integrity) that failed when the engine went idle
    kv_integrity_failures: int = 0
    # the tiers below the device: slots in all and in use, blocks written to disk, copies that failed
    host_blocks: int = 0
    host_blocks_used: int = 0
    disk_blocks: int = 0
    disk_blocks_used: int = 0
    disk_blocks_written: int = 0
    tier_copy_failures: int = 0
    # batches of spills that waited for the disk tier's writes to catch up (kv/disk_tier.py SpillBacklog)
    spill_backlog_waits: int = 0
    # the shared KV directory's counters (runner/shared_kv.py `stats`; None: no shared directory)
    shared_kv: dict[str, int] | None = None
    # the hybrid cache's window parts (kv/window_parts.py): blocks a part takes, parts in all, parts no
    # request or pin holds (free, evictable), parts evicted so far (0 each without the hybrid cache)
    window_part_blocks: int = 0
    window_parts: int = 0
    window_parts_unheld: int = 0
    window_parts_evicted: int = 0
    # the share of the device KV running requests may hold now (Policy.running_kv_share; 1.0: no bound)
    running_kv_share: float = 1.0
    # seconds a request arriving now may wait before it goes first (Policy.max_wait; 0: no deadline)
    max_wait_s: float = 0.0
    # the share of recent time a request was held back for KV (engine/scheduler.py's PressureMeter)
    kv_pressure: float = 0.0

    def __getattr__(self, name: str) -> Any:
        if name in _STAT_FIELDS:
            return getattr(object.__getattribute__(self, "stats"), name)
        raise AttributeError(name)

    @classmethod
    def of(cls, **values: Any) -> EngineSnapshot:
        """A snapshot from flat values, the scheduler's counters among them."""
        stats = {k: values.pop(k) for k in list(values) if k in _STAT_FIELDS}
        return cls(**values, stats=SchedulerStats(**stats))

    def but(self, **values: Any) -> EngineSnapshot:
        """This snapshot with some values changed, the scheduler's counters among them."""
        stats = {k: values.pop(k) for k in list(values) if k in _STAT_FIELDS}
        return replace(self, **values, stats=replace(self.stats, **stats))

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


def take_snapshot(scheduler: Scheduler, tool_calls: ValidatorCounts, render_cache: Any = None,
                  response_cache: Any = None, kv_integrity_failures: int = 0,
                  spill_backlog_waits: int = 0, shared_kv: Any = None) -> EngineSnapshot:
    """The snapshot of `scheduler` (and its KV manager) now; on the engine thread.
    The caches and `shared_kv` are objects with `stats()` (None: off);
    `spill_backlog_waits` is the copy engine's count (runner/copy_engine.py)."""
    s, kv = scheduler.stats, scheduler.kv
    return EngineSnapshot(
        num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
        num_blocks=kv.num_blocks, num_free_blocks=kv.num_free_blocks,
        num_pinned_blocks=kv.num_pinned_blocks, num_pinned_programs=len(kv.pins), block_size=kv.block_size,
        num_protected_blocks=kv.num_protected_blocks,
        # a copy: the counters go on changing on the engine thread (the histories are left out)
        stats=replace(s, ttl_history=[], decode_step_history=deque(maxlen=1)),
        recent_decode_step_s=tuple(s.decode_step_history),
        step_model=scheduler.step_model.coefficients if scheduler.step_model.ready else (),
        step_margin=scheduler.step_model.margin, tool_calls=tool_calls,
        speculation=replace(scheduler.speculator.stats),
        render_cache=None if render_cache is None else render_cache.stats(),
        response_cache=None if response_cache is None else response_cache.stats(),
        kv_integrity_failures=kv_integrity_failures, shared_kv=None if shared_kv is None else shared_kv.stats(),
        host_blocks=kv.host.num_slots, host_blocks_used=kv.host.num_used, disk_blocks=kv.disk.num_slots,
        disk_blocks_used=kv.disk.num_used, disk_blocks_written=kv.disk_copies.num_spilled,
        tier_copy_failures=kv.copies.num_failed + kv.disk_copies.num_failed, spill_backlog_waits=spill_backlog_waits,
        running_kv_share=scheduler.policy.running_kv_share, max_wait_s=scheduler.policy.max_wait() or 0.0,
        kv_pressure=scheduler.policy.ctx.kv_pressure(), **_window_parts(kv.parts))


def _window_parts(parts: Any) -> dict[str, int]:
    if parts is None:
        return {}
    return dict(window_part_blocks=parts.pages, window_parts=parts.num_parts,
                window_parts_unheld=parts.num_free_pages // parts.pages, window_parts_evicted=parts.num_evicted)
