"""The workload format: one LLM call a record, grouped into programs.

A JSONL trace has one `TraceCall` a line. The generators write the same format,
so generated and recorded workloads round-trip through one loader."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TraceCall:
    program_id: str
    turn: int  # 0-based position of this call in its program
    arrival: float  # seconds; the program's arrival offset for turn 0 (later turns: as recorded, informational)
    prompt_tokens: int  # the whole prompt of this call
    new_tokens: int  # tokens not shared with the previous call's prompt + output
    output_tokens: int
    tool_name: str | None  # tool called after this call; None when the program ends or a human answers
    tool_duration: float  # seconds from this call's response to the next call's arrival (0 on the last call)
    # Optional exact prefix structure: ids of the prompt's full blocks of
    # `hash_block_size` tokens (same id at the same position = same content).
    hash_ids: list[int] | None = None
    hash_block_size: int = 64
    # Leading prompt tokens shared by every program of the workload (a system prompt).
    shared_prefix_tokens: int = 0


@dataclass
class Program:
    program_id: str
    calls: list[TraceCall] = field(default_factory=list)

    @property
    def arrival(self) -> float:
        return self.calls[0].arrival

    @property
    def num_turns(self) -> int:
        return len(self.calls)
