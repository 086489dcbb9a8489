"""The scheduler's settings and the counters it keeps."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from agentserve.engine.attention_shape import FULL, AttentionShape
from agentserve.engine.spec_decode import SpecConfig


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 256  # running requests at most
    max_model_len: int | None = None
    program_idle_timeout: float = 600.0
    # While decodes run, cap a step's draft rows and prefill tokens so that its predicted
    # time stays under this many ms a token for the least-served decoding request (a step
    # whose every decode carries a draft expects more than one token each); None or 0: no
    # cap, the whole token budget as without decodes.
    max_step_ms_with_decodes: float | None = 200.0
    # prefill tokens a capped step still computes (speculation's drafts leave room for
    # them; late in a long prompt each costs as much as a decode row, so few)
    min_prefill_chunk: int = 16
    # a waiting request whose next prompt block a running request is about to compute waits for it
    group_prefill: bool = True
    # prompt-lookup speculation (engine/spec_decode.py); off unless the executor verifies drafts
    speculation: SpecConfig = field(default_factory=SpecConfig)
    # the executor overlaps tier copies with compute (engine/executor.py): a request admitted with
    # reloads computes once they land, not in its admission step (False: copies run in the step)
    overlap_copies: bool = False
    # the model's layers by attention (sliding windows): how the step-time model counts attention
    attention_shape: AttentionShape = FULL

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.max_step_ms_with_decodes is not None and not self.max_step_ms_with_decodes >= 0:
            raise ValueError("max_step_ms_with_decodes must be >= 0 (0 or None: no cap)")
        if self.min_prefill_chunk < 1:
            raise ValueError("min_prefill_chunk must be >= 1")


@dataclass
class SchedulerStats:
    steps: int = 0
    preemptions: int = 0
    admitted_prompt_tokens: int = 0  # tokens of requests at admission
    hit_tokens: int = 0  # of those, found in the prefix cache (device or host)
    loaded_tokens: int = 0  # of the hits, reloaded from the host tier
    reload_failed_blocks: int = 0  # reloads from the host tier that failed (their requests recompute)
    pins_created: int = 0
    pins_hit: int = 0  # the program's next turn was admitted while its pin held
    pins_expired: int = 0
    pins_reclaimed: int = 0
    pins_released_early: int = 0
    pins_released_at_end: int = 0
    swapped_turns: int = 0  # turns whose KV the policy had copied to host memory at their end
    onward_turns: int = 0  # of those, put first in line for the disk tier (a long wait)
    grouped_requests: int = 0  # requests that waited for another's prefill of their shared prefix
    superseded_blocks: int = 0  # cached blocks of a program's history that its next turn left, demoted
    retired_blocks: int = 0  # cached blocks only an ended program's chain held, demoted
    # prefetches of a program's KV from a tier before its next turn (engine/prefetch.py): issued (and
    # their blocks), and how they ended: used, late (the turn came during the reload), wasted (blocks
    # evicted before the turn, or the program ended first), cancelled (not issued under KV pressure)
    prefetch_issued: int = 0
    prefetch_blocks: int = 0
    prefetch_used: int = 0
    prefetch_late: int = 0
    prefetch_wasted: int = 0
    prefetch_wasted_blocks: int = 0
    prefetch_cancelled: int = 0
    # the disk -> host stage of a prefetch (its KV on disk): issued (and blocks), and how it ended
    # (used: the turn found every staged block in the host tier or on the device; late; wasted:
    # evicted from the host tier first, or the program ended), cancelled (no host slot to be had)
    prefetch_staged: int = 0
    prefetch_staged_blocks: int = 0
    prefetch_stage_used: int = 0
    prefetch_stage_late: int = 0
    prefetch_stage_wasted: int = 0
    prefetch_stage_wasted_blocks: int = 0
    prefetch_stage_cancelled: int = 0
    prefill_tokens: int = 0  # prompt (and recomputed) tokens run through the model
    decode_tokens: int = 0  # tokens sampled
    execute_s: float = 0.0  # time inside the executor (copies, forward, sampling)
    executed_steps: int = 0  # steps that ran the executor (`steps` also counts empty scheduling passes)
    ttl_sum: float = 0.0
    ttl_history: list[float] = field(default_factory=list)  # recent TTL decisions (bounded)
    capped_steps: int = 0  # steps whose prefill the step-time target held back
    decode_steps: int = 0  # executed steps with at least one decode
    decode_step_max_s: float = 0.0  # the longest of those
    decode_step_history: deque[float] = field(default_factory=lambda: deque(maxlen=1024))  # the latest of those

    def decode_step_p99_s(self) -> float:
        """p99 of the recent steps' times that had decodes (0 if none)."""
        return p99(sorted(self.decode_step_history)) if self.decode_step_history else 0.0


def p99(ordered) -> float:
    """The nearest-rank p99 of sorted, non-empty `ordered` (of fewer than 100 values, the largest)."""
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
