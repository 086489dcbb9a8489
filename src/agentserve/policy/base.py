"""The scheduling-policy interface. A policy decides three things and nothing
else: the order of waiting requests (`priority`), what happens to a turn's KV
when it ends (`retention`), and which pins to drop early (`review_pins`). The
scheduler loop, the KV manager and the pin mechanics are shared by all."""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

from agentserve.policy.decision_log import Decision, DecisionLog, TTLInputs
from agentserve.policy.prefetch import PrefetchPlan
from agentserve.policy.program import ProgramState, ProgramTable
from agentserve.policy.tool_stats import NO_TOOL_CALL, ToolDurationStats
from agentserve.policy.toolcalls import first_tool_name

if TYPE_CHECKING:
    from agentserve.kv.pins import Pin


class Request(Protocol):
    """What a policy reads of a request, and the one field it sets (`tool_name`).
    The engine's `engine.request.Request` is the record that has them; it is
    declared here so that `policy/` stays below `engine/` (no import of it)."""

    request_id: str
    program_id: str
    arrival_time: float
    waiting_since: float  # when it last started to wait (arrival, or its preemption)
    preempted: bool
    num_prompt_tokens: int
    num_computed_tokens: int
    output_text: str | None
    tool_name: str | None
    ttl_hint: float | None


@dataclass
class PolicyContext:
    # Seconds to rebuild n tokens of KV after eviction: the prefill time, or
    # the reload time when a host tier keeps evicted blocks (Prefill-Reload(r)).
    reload_cost: Callable[[int], float]
    programs: ProgramTable = field(default_factory=ProgramTable)
    is_pinned: Callable[[str], bool] = lambda pid: False
    running_tokens: Callable[[], int] = lambda: 0  # KV tokens held by running requests
    host_tier: bool = False
    # share of recent time a waiting request was held back for KV (policy/pressure.py);
    # 1.0, the paper's assumption, where nothing measures it
    kv_pressure: Callable[[], float] = lambda: 1.0
    # What a tier-aware policy weighs a pin against (policy/policies/agentserve.py): the
    # prefill time of n tokens (None: reload_cost), the seconds to bring n tokens back from
    # each tier below the device, nearest first ("host", then "disk"), and how long a copy
    # written to a tier lasts there (policy/pressure.py TurnoverMeter; inf: no turnover yet).
    prefill_cost: Callable[[int], float] | None = None
    tier_reload: dict[str, Callable[[int], float]] = field(default_factory=dict)
    tier_residency: Callable[[str], float] = lambda tier: math.inf
    kv_tokens: int = 0  # the device KV's size in tokens (0: not known)


@dataclass(frozen=True)
class Retention:
    # "free" (end-of-turn eviction), "pin" (keep for ttl seconds), "swap" (copy to host now, then
    # free), "disk" (a long wait: copy to host now, first in line to move on to the disk tier)
    action: str
    ttl: float = 0.0
    inputs: TTLInputs | None = field(default=None, compare=False)  # what a TTL model decided from (the dashboard)

    @staticmethod
    def free() -> Retention:
        return _FREE


_FREE = Retention("free")


class Policy(abc.ABC):
    name: ClassVar[str]
    time_dependent: ClassVar[bool] = False  # priorities change as time passes: re-sort every step
    tracks_service: ClassVar[bool] = False  # reads ProgramState.attained_service (kept only then: per row a step)
    # Admission headroom. 0: admit a waiting request as soon as its next chunk
    # fits, as vLLM does; under KV pressure that admits requests that later
    # preempt each other and evict the cached prefixes of programs between
    # turns (recomputed on their next turn). N > 0: admit only when the
    # request's whole prompt plus up to N of its output tokens fit, with the
    # same headroom kept for every running request, so the programs already
    # running keep their KV and the rest wait their turn (SGLang reserves
    # decode room for running requests in the same spirit).
    decode_reserve_tokens: ClassVar[int] = 0
    # What becomes of an ended program's own KV. False: it is freed like any
    # turn's, newest in eviction order, as vLLM frees a finished request. True:
    # the blocks no other chain shares go to the cold end (KVCacheManager.retire),
    # since no turn will match them again.
    retire_ended: bool = False
    # The share of the device KV that running requests (their blocks and
    # headroom) may hold when more than one runs; the rest is left to programs
    # between turns. 1.0: no bound but the memory itself.
    running_kv_share: float = 1.0

    def late(self, req: Request, now: float) -> bool:
        """`req` waited past the policy's deadline: it goes first and may reclaim any pin."""
        return False

    def skips_headroom(self, req: Request, now: float) -> bool:
        """`req` is admitted without the decode headroom, held back only for KV
        (as vLLM admits): by default once it is late."""
        return self.late(req, now)

    def max_wait(self) -> float | None:
        """Seconds a request arriving now may wait before it is late (None: no deadline)."""
        return None

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.tool_stats = ToolDurationStats()
        self.decisions = DecisionLog()  # the latest retention decisions with their inputs

    # --- events (the scheduler calls these) ---

    def on_arrival(self, req: Request, program: ProgramState, now: float) -> None:
        """A request arrived: if its program's last turn called a tool, that
        tool's duration is now known."""
        seen = self.tool_stats.on_arrival(req.program_id, now)
        if seen is not None:
            self.on_tool_duration(seen[0], seen[1])

    def on_tool_duration(self, tool: str, seconds: float) -> None:
        pass

    def on_admitted(self, req: Request, program: ProgramState, now: float, queue_delay: float,
                    returning_evicted: bool) -> None:
        """`req` got KV. `returning_evicted`: a later turn whose KV was not retained."""

    def on_withdrawn(self, req: Request, now: float) -> None:
        """`req` left the waiting queue without ever being admitted (aborted)."""

    def on_turn_end(self, req: Request, program: ProgramState, now: float) -> Retention:
        """A non-final turn finished: record its tool call, then decide."""
        if req.tool_name is None and req.output_text:
            req.tool_name = first_tool_name(req.output_text)
        tool = req.tool_name or NO_TOOL_CALL
        self.tool_stats.on_finish(req.program_id, tool, now)
        decision = self.retention(req, program, now)
        self.decisions.add(Decision(now, req.request_id, req.program_id, tool, decision.action,
                                    decision.ttl if decision.action == "pin" else 0.0, self.tool_stats.mean(tool),
                                    self.tool_stats.count(tool), decision.inputs))
        return decision

    def on_program_end(self, program: ProgramState) -> None:
        self.tool_stats.forget_program(program.program_id)

    # --- learned state (kept over a restart by server/learned_state.py) ---

    def export_state(self) -> dict:
        """What the policy learned, as plain data: the tool-duration windows (and, in policies
        with a TTL model, what else it learned)."""
        return {"tool_stats": self.tool_stats.export_state()}

    def import_state(self, state: dict) -> None:
        """Take up what `export_state` gave (a part it does not name is left as it is).
        ValueError, TypeError or KeyError on malformed data."""
        if "tool_stats" in state:
            self.tool_stats.import_state(state["tool_stats"])

    # --- decisions ---

    @abc.abstractmethod
    def priority(self, req: Request, program: ProgramState, now: float) -> tuple:
        """Sort key of a waiting request: smaller goes first. The preemption
        victim is the running request with the largest key."""

    def retention(self, req: Request, program: ProgramState, now: float) -> Retention:
        return Retention.free()

    def review_pins(self, pins: dict[str, Pin], now: float) -> list[str]:
        """Programs whose pin should be released now, before expiry."""
        return []

    def swap_on_preempt(self, req: Request) -> bool:
        return False

    def prefetch_plan(self, req: Request, program: ProgramState, now: float) -> PrefetchPlan | None:
        """When to reload the KV of the program whose turn `req` just ended, should
        it have gone below the device by then (engine/prefetch.py); None: never."""
        return None


POLICIES: dict[str, type[Policy]] = {}  # filled by @register; read through policy/registry.py


def register(cls: type[Policy]) -> type[Policy]:
    POLICIES[cls.name] = cls
    return cls
