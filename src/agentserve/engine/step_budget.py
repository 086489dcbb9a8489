"""One step being scheduled (`StepBudget`): the token budget left and, while
decodes run under a step-time target, the prefill time the step-time model
(engine/step_time.py) says is left."""

from __future__ import annotations

from agentserve.engine.request import Request
from agentserve.engine.step_time import COLD_CHUNKS, StepTimeModel, draft_context


class StepBudget:
    """One step being scheduled: the chunks so far, the token budget left and,
    while decodes run under a step-time target, the prefill time left."""

    __slots__ = ("budget", "scheduled", "decode_rows", "decode_context", "draft_rows", "draft_context", "time_left",
                 "per_token", "prefill_tokens", "attention",
                 "capped", "model", "min_chunk", "cold")

    def __init__(self, budget: int, model: StepTimeModel, min_chunk: int) -> None:
        self.budget = budget
        self.scheduled: dict[Request, int] = {}  # in the order the chunks are emitted
        self.decode_rows = 0
        self.decode_context = 0
        self.draft_rows = 0  # speculative draft rows and the context they attend to
        self.draft_context = 0
        self.time_left: float | None = None  # None: no cap
        # tokens the least-served decoding stream expects from this step (1: one has no draft)
        self.per_token = 1.0
        self.prefill_tokens = 0
        self.attention = 0  # attention pairs of the prefill chunks
        self.capped = False
        self.model = model
        self.min_chunk = min_chunk
        self.cold = False  # decodes run under a target the model cannot price yet

    def add(self, req: Request, n: int) -> None:
        self.scheduled[req] = n
        self.budget -= n

    def drop(self, req: Request) -> None:
        """An already scheduled request was preempted: its tokens, and its rows in
        the step's features, go back (its position has not advanced yet)."""
        n = self.scheduled.pop(req, None)
        if n is None:
            return
        self.budget += n
        c = req.num_computed_tokens
        if c >= req.num_prompt_tokens and len(req.token_ids) - c == 1:  # a decode (and its draft)
            self.decode_rows -= 1
            self.decode_context -= self.model.shape.context(c + 1)
            if n > 1:
                self.draft_rows -= n - 1
                self.draft_context -= draft_context(c, n - 1)
        else:
            self.prefill_tokens -= n
            self.attention -= self.model.shape.pairs(c, n)

    def prefill_time_left(self, target_ms: float | None) -> float | None:
        """Seconds of prefill the step may add under the step-time target, per
        token of the least-served decoding stream (a step whose every stream
        carries a draft may take longer); None when no cap applies (no decode
        this step, no target, too few samples)."""
        if not self.decode_rows or not target_ms or not self.model.ready:
            return None
        return target_ms / 1000.0 * self.per_token - self.model.base_time(
            self.decode_rows, self.decode_context, self.draft_rows, self.draft_context)

    def allow(self, start: int, want: int) -> int:
        """Prefill tokens a chunk after `start` may take of the `want` it could."""
        if self.time_left is None or want <= 0:
            room = COLD_CHUNKS * self.min_chunk - self.prefill_tokens
            if self.cold and want > room:
                self.capped = True
                return max(room, 0)
            return want
        n = self.model.max_chunk(start, self.time_left)
        if not self.prefill_tokens:
            n = max(n, self.min_chunk)  # prefills always progress
        if n < want:
            self.capped = True
            return n
        return want

    def add_prefill(self, req: Request, start: int, n: int) -> None:
        self.add(req, n)
        self.prefill_tokens += n
        self.attention += self.model.shape.pairs(start, n)
        if self.time_left is not None:
            self.time_left -= self.model.chunk_time(start, n)

    @property
    def features(self) -> tuple[int, int, int, int, int, int]:
        """The step's features for the step-time model, as `step_features` gives them."""
        return (self.prefill_tokens, self.attention, self.decode_rows, self.decode_context, self.draft_rows,
                self.draft_context)
