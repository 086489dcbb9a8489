"""What one scheduler step asks the executor to do."""

from __future__ import annotations

from dataclasses import dataclass, field

from agentserve.engine.request import Request


@dataclass(slots=True)
class ScheduledChunk:
    """`num_tokens` tokens of `request`, starting at position `start`
    (the tokens before `start` already have KV). `sample` is true when the
    chunk reaches the end of the request's tokens, so a token is sampled.
    A decode with a `draft` computes its last token and the draft tokens
    after it (num_tokens = 1 + len(draft)), and samples at every one of them
    to verify the draft."""

    request: Request
    start: int
    num_tokens: int
    sample: bool
    draft: tuple[int, ...] = ()

    @property
    def token_ids(self) -> list[int]:
        """The tokens this chunk computes."""
        if self.draft:
            return [self.request.token_ids[self.start], *self.draft]
        return self.request.token_ids[self.start:self.start + self.num_tokens]

    @property
    def is_decode(self) -> bool:
        """A decode row (or, with a draft, a decode and its draft rows)."""
        return (self.num_tokens == 1 or bool(self.draft)) and self.start >= self.request.num_prompt_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Copies the executor performs before the forward pass, or overlaps with it (engine/executor.py).
    blocks_to_load: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    blocks_to_offload: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    # the disk tier's (kv/disk_tier.py): spills run before the offloads, disk reloads after the reloads
    blocks_to_spill: list[tuple[int, int]] = field(default_factory=list)  # (host block, disk slot)
    blocks_to_load_disk: list[tuple[int, int]] = field(default_factory=list)  # (disk slot, device block)
    # disk -> host stages of a prefetch (kv/stage_copies.py), on the disk link after its reloads
    blocks_to_stage: list[tuple[int, int]] = field(default_factory=list)  # (disk slot, host block)
    copy_ticket: int = 0  # the five lists' batch, as the executor reports it (engine/executor.py)
    preempted: list[Request] = field(default_factory=list)
    # (prefill tokens, attention pairs, decode rows, decode context, draft rows, draft context),
    # gathered by the scheduler as it scheduled (None: step_features computes them from the chunks)
    features: tuple[int, int, int, int, int, int] | None = None

    @property
    def is_empty(self) -> bool:
        return not (self.chunks or self.has_copies)

    @property
    def has_copies(self) -> bool:
        return bool(self.blocks_to_load or self.blocks_to_offload or self.blocks_to_spill or self.blocks_to_load_disk
                    or self.blocks_to_stage)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if not c.is_decode)

    @property
    def num_decode_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if c.is_decode)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(c.draft) for c in self.chunks)
