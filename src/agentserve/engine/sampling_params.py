"""How a request's tokens are chosen and when its output ends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None  # same seed and prompt: same output, whatever else is batched
    stop: list[str] = field(default_factory=list)  # the output ends before the first match
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # a grammar the runner holds the output to (tool_choice "required"/named); opaque here
    constraint: Any = None
    # one request's streaming tool-call validator (policy/toolcall_stream.py), opaque here: the
    # engine feeds it every output token's text and ends the request when it says so; it keeps
    # state, so it serves one request only
    tool_validator: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (or -1 for off), got {self.top_k!r}")
        if len(self.stop) > 16:
            raise ValueError("at most 16 stop strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1
