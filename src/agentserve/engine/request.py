"""The one request model: a request owns its token ids, and `num_computed_tokens`
catches up with `num_tokens`. Prefix hits, reloads from the host tier, chunked
prefill and decode all advance that one counter."""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentserve.kv.block_table import BlockTable
    from agentserve.policy.program import ProgramState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")


@dataclass(eq=False)
class Request:
    request_id: str
    program_id: str
    # Any sequence of ints; not kept apart: `prompt_token_ids` reads the first num_prompt_tokens of
    # token_ids (a second copy of a few thousand ids per request would be one more container for the
    # cyclic collector to walk item by item; see engine/gc_policy.py).
    prompt_token_ids: InitVar[Sequence[int]]
    max_tokens: int
    arrival_time: float
    eos_token_ids: frozenset[int] = frozenset()
    # Client hints (server: body/header fields; simulator: the trace).
    is_last_turn: bool = False
    ttl_hint: float | None = None
    # No program id was given: the request is its own one-turn program, which
    # no later turn can come back to, so it is no sample of how programs behave.
    anonymous: bool = False
    # Prefix-cache hits only among requests with an equal salt (kv/prefix_index.py):
    # the server's tenant and the body's `cache_salt`; None shares with every unsalted request.
    cache_salt: Hashable = None
    # Opaque to the engine: sampling parameters for the runner, a scripted
    # output for the simulator, the detokenized text for the tool parser.
    sampling: Any = None
    sim_output: list[int] | None = None
    output_text: str | None = None

    # --- state, owned by the scheduler ---
    # Its program, bound at arrival: the request keeps its program's place
    # (arrival time) even if the table forgets or ends the program meanwhile.
    program: ProgramState | None = field(default=None, repr=False)
    output_token_ids: list[int] = field(default_factory=list)
    block_table: BlockTable | None = field(default=None, repr=False)  # its KV while it runs (None: holds none)
    token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-hit tokens found at first admission (-1: not admitted yet)
    num_loaded_tokens: int = 0  # of those, tokens reloaded from the host tier
    prefetch: str | None = None  # how a prefetch of its KV before it came ended (engine/prefetch.py): used, late, wasted
    status: RequestStatus = RequestStatus.WAITING
    preempted: bool = False
    num_preemptions: int = 0
    waiting_since: float = field(init=False)
    queue_time: float = 0.0  # total time spent waiting (first admission and after preemptions)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    tool_name: str | None = None  # set by the policy's tool-call parser at finish
    followed: bool = False  # waited for another request's prefill of a shared prefix (grouped prefill)
    spec: Any = field(default=None, repr=False)  # speculation state (engine/spec_decode.py), made on first draft
    reserve: int = 0  # while running: KV blocks it may still take within the policy's headroom (admission.py)
    queue_key: Any = field(default=None, repr=False)  # while waiting: its place in the queue (waiting_queue.py)
    # Its output processing (detokenizer, stop strings, what was streamed: llm_engine.py)
    # and the server's side of it (its stream: server/async_engine.py). The request is
    # the one record every layer shares; none keeps a map of its own.
    output_state: Any = field(default=None, repr=False)
    client: Any = field(default=None, repr=False)

    def __post_init__(self, prompt_token_ids: Sequence[int]) -> None:
        self.token_ids = list(prompt_token_ids)  # a copy: the caller's list is not aliased
        if not self.token_ids:
            raise ValueError("a request needs at least one prompt token")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        self.num_prompt_tokens = len(self.token_ids)  # read every step: a field, not a property
        self.waiting_since = self.arrival_time

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, program={self.program_id!r}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, {self.status.value})")


def _prompt_token_ids(self: Request) -> list[int]:
    """The prompt's token ids (a new list)."""
    return self.token_ids[:self.num_prompt_tokens]


# set after the dataclass is made, so that `prompt_token_ids` stays the constructor's argument
Request.prompt_token_ids = property(_prompt_token_ids)  # type: ignore[assignment,method-assign]
