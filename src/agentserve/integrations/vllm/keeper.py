"""What agentserve's policy decides inside another engine's scheduler, kept free
of that engine: each request's turn of a program, the waiting order, the TTL a
finished turn's KV is held for, and the held KV's release (expiry, the policy's
review, reclaim under pressure, the program's end, the next turn's arrival).

The engine's blocks are opaque here: the scheduler hands over a list of them to
hold and gets them back through `release_blocks` when a pin goes. The policy
objects are the ones `agentserve serve` and the simulator run (policy/), built
from the same `--policy` spec; nothing of the TTL model is repeated."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agentserve.clock import Clock
from agentserve.policy.base import PolicyContext
from agentserve.policy.pressure import PressureMeter, pin_to_reclaim
from agentserve.policy.program import ProgramState, ProgramTable
from agentserve.policy.registry import make_policy, parse_policy_spec

log = logging.getLogger("agentserve.vllm")

# Seconds a prefill token costs before any step has been measured (an 8B model on one GPU
# prefills some thousands of tokens a second); the first measured steps replace it.
_PRIOR_PREFILL_S_PER_TOKEN = 2e-4
_RATE_WEIGHT = 0.2  # the share of a new measurement in the running prefill rate


@dataclass
class Turn:
    """One request of a program, as the policy reads it (policy.base.Request)."""

    request_id: str
    program_id: str
    program: ProgramState
    arrival_time: float
    num_prompt_tokens: int
    anonymous: bool = False  # no program named: the request is its own program
    ttl_hint: float | None = None
    end_program: bool = False
    release_program: bool = False
    waiting_since: float = 0.0
    preempted: bool = False
    num_computed_tokens: int = 0
    output_text: str | None = None
    tool_name: str | None = None
    admitted: bool = False


@dataclass
class HeldKV:
    """A pin: a finished turn's blocks, held for its program until `expiry`."""

    program_id: str
    blocks: list[Any]
    expiry: float
    program_arrival: float
    num_tokens: int


@dataclass
class KeeperCounts:
    """What happened to pins, for the engine's metrics."""

    pins_created: int = 0
    pin_hits: int = 0  # a program's next turn admitted while its pin held
    pins_expired: int = 0
    pins_reclaimed: int = 0  # released for another request's allocation
    pins_released_early: int = 0  # the policy's review
    pins_released_at_end: int = 0  # the program ended, or the client released it
    pins_refused: int = 0  # a pin that would have passed the cap on held blocks
    turns_finished: int = 0
    hints_ignored: int = 0


@dataclass(frozen=True)
class TurnIdentity:
    program_id: str | None  # None: the request is its own program
    ttl: float | None = None
    end_program: bool = False
    release_program: bool = False
    ignored: tuple[str, ...] = ()  # hints that were malformed, by name


# The program id, in the order the first present wins: agentserve's own field, vLLM's session,
# Continuum's job id.
_ID_KEYS = ("program_id", "session_id", "job_id")


def turn_identity(session_id: str | None, extra_args: Mapping[str, Any] | None) -> TurnIdentity:
    """A request's program and hints from what the engine carries: vLLM's `session_id` and
    `extra_args` (`vllm_xargs` in a request body). A malformed hint is ignored, not fatal:
    the engine has no way to refuse a request from its scheduler, and the turn is still
    served (its name is returned in `ignored`, so the caller can log it)."""
    extra = extra_args if isinstance(extra_args, Mapping) else {}
    ignored: list[str] = []
    pid = None
    for key in _ID_KEYS:
        value = session_id if key == "session_id" and session_id is not None else extra.get(key)
        if value is None:
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or not value.strip():
            ignored.append(key)
            continue
        pid = value.strip()
        break
    ttl = extra.get("ttl")
    if ttl is not None:
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) or ttl < 0:
            ignored.append("ttl")
            ttl = None
        else:
            ttl = float(ttl)
    flags = {}
    for key in ("end_program", "is_last_step", "release_program"):
        value = _flag(extra.get(key, False))
        if value is None:
            ignored.append(key)
            value = False
        flags[key] = value
    if pid is None:
        ttl, flags["release_program"] = None, False
    return TurnIdentity(pid, ttl, flags["end_program"] or flags["is_last_step"], flags["release_program"],
                        tuple(ignored))


_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def _flag(value: Any) -> bool | None:
    """A boolean hint as it arrives: vLLM's `vllm_xargs` holds only strings and numbers, so a
    client's JSON `true` reaches the scheduler as 1. None: not a boolean in any spelling."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    return None


class ProgramKeeper:
    """The policy, the program table and the pins for one engine's scheduler.

    `release_blocks(blocks)` gives held blocks back to the engine's pool;
    `frees_any(blocks)` says whether doing so would return at least one block to
    its free set (a block another request also holds would not). Pins together
    hold at most `max_pinned_share` of the `num_blocks` blocks, whatever TTL a
    client asks for."""

    def __init__(self, spec: str, clock: Clock, num_blocks: int, block_size: int,
                 release_blocks: Callable[[list[Any]], None], frees_any: Callable[[list[Any]], bool],
                 max_pinned_share: float = 0.9, program_idle_timeout: float = 600.0) -> None:
        if not 0.0 < max_pinned_share <= 1.0:
            raise ValueError(f"max_pinned_share must be in (0, 1], got {max_pinned_share!r}")
        name, options = parse_policy_spec(spec)
        self.spec = spec
        self.clock = clock
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_pinned_blocks = int(num_blocks * max_pinned_share)
        self._release = release_blocks
        self._frees_any = frees_any
        self.programs = ProgramTable(program_idle_timeout)
        self.pins: dict[str, HeldKV] = {}
        self.pinned_blocks = 0
        self.pressure = PressureMeter()
        self.counts = KeeperCounts()
        self.running_tokens = 0  # KV tokens of the running requests, as the scheduler last counted
        self._s_per_token = _PRIOR_PREFILL_S_PER_TOKEN
        self._next_idle_check = 0.0
        ctx = PolicyContext(
            reload_cost=self.prefill_seconds,
            programs=self.programs,
            is_pinned=lambda pid: pid in self.pins,
            running_tokens=lambda: self.running_tokens,
            kv_pressure=lambda: self.pressure.value(self.clock.now()),
            kv_tokens=num_blocks * block_size,
        )
        self.policy = make_policy(name, ctx, **options)

    # --- what the engine measured ---

    def prefill_seconds(self, tokens: int) -> float:
        """What rebuilding `tokens` of KV costs, at the engine's measured prefill rate."""
        return max(0, tokens) * self._s_per_token

    def observe_step(self, prefill_tokens: int, seconds: float, blocked: bool) -> None:
        """A step ran `prefill_tokens` of prompt in `seconds`; `blocked`: a request was held
        back for KV (or preempted) in it."""
        if prefill_tokens >= 64 and seconds > 0:  # a decode-only step says little of prefill
            rate = seconds / prefill_tokens
            self._s_per_token += _RATE_WEIGHT * (rate - self._s_per_token)
        self.pressure.observe(self.clock.now(), blocked)

    # --- turns ---

    def arrive(self, request_id: str, ident: TurnIdentity, num_prompt_tokens: int) -> Turn:
        now = self.clock.now()
        anonymous = ident.program_id is None
        pid = f"request:{request_id}" if anonymous else ident.program_id
        prog = self.programs.touch(pid, now)
        prog.anonymous = anonymous
        if ident.ignored:
            self.counts.hints_ignored += len(ident.ignored)
            log.warning("request %s: ignored malformed %s", request_id, ", ".join(ident.ignored))
        turn = Turn(request_id, pid, prog, now, num_prompt_tokens, anonymous, ident.ttl, ident.end_program,
                    ident.release_program, waiting_since=now)
        self.policy.on_arrival(turn, prog, now)
        return turn

    def priority(self, turn: Turn, now: float) -> tuple:
        return self.policy.priority(turn, turn.program, now)

    def admitted(self, turn: Turn, num_cached_tokens: int) -> None:
        """The turn got KV for the first time (`num_cached_tokens` of its prompt from the
        prefix cache). Its program's pin has served: it goes, the turn now holds the blocks."""
        if turn.admitted:
            return
        now = self.clock.now()
        turn.admitted = True
        prog = turn.program
        history = len(prog.history) if prog.history else 0
        returning_evicted = prog.turns_finished > 0 and num_cached_tokens + self.block_size < history
        self.policy.on_admitted(turn, prog, now, now - turn.waiting_since, returning_evicted)
        if self._drop(turn.program_id):
            self.counts.pin_hits += 1

    def withdrawn(self, turn: Turn) -> None:
        """The turn was aborted while it waited."""
        if not turn.admitted:
            self.policy.on_withdrawn(turn, self.clock.now())

    def finish(self, turn: Turn, output_text: str | None, token_ids: list[int], aborted: bool) -> float:
        """The turn ended. Returns the seconds its KV is to be held (0: free it now)."""
        now = self.clock.now()
        prog = turn.program
        prog.turns_finished += 1
        prog.last_finish_time = now
        self.programs.active(prog, now)
        self.counts.turns_finished += 1
        if aborted:  # a client that went away; its program lives on, without retention
            return 0.0
        if turn.anonymous or turn.end_program:
            self.end_program(turn.program_id)
            return 0.0
        turn.output_text = output_text
        turn.num_computed_tokens = len(token_ids)  # the KV it holds: what a miss would rebuild
        decision = self.policy.on_turn_end(turn, prog, now)
        prog.last_tool = turn.tool_name
        prog.history = list(token_ids)
        log.debug("program %s: turn %s ended (tool %s): %s %.1fs", turn.program_id, turn.request_id,
                  turn.tool_name, decision.action, decision.ttl)
        if turn.release_program:
            if self._drop(turn.program_id):
                self.counts.pins_released_at_end += 1
            return 0.0
        return decision.ttl if decision.action == "pin" and decision.ttl > 0 else 0.0

    def hold(self, turn: Turn, blocks: list[Any], ttl: float) -> bool:
        """Pin `blocks` for `ttl` seconds (a program's earlier pin, if any, is replaced: the
        new turn's blocks extend it). False, and the blocks given back, where the pins would
        pass their cap."""
        pid = turn.program_id
        old = self.pins.get(pid)
        held = self.pinned_blocks - (len(old.blocks) if old else 0)
        if held + len(blocks) > self.max_pinned_blocks:
            self.counts.pins_refused += 1
            self._release(blocks)
            return False
        now = self.clock.now()
        self.pins[pid] = HeldKV(pid, blocks, now + ttl, turn.program.arrival_time,
                                len(turn.program.history or ()))
        self.pinned_blocks = held + len(blocks)
        if old is not None:
            self._release(old.blocks)
        self.counts.pins_created += 1
        return True

    def end_program(self, program_id: str) -> None:
        if self._drop(program_id):
            self.counts.pins_released_at_end += 1
        prog = self.programs.end(program_id)
        if prog is not None:
            prog.ended = True
            self.policy.on_program_end(prog)

    # --- pins over time ---

    def release_due(self, waiting_programs: Iterable[str]) -> None:
        """Release the pins that expired or that the policy reviews away, except those
        whose program's next turn already waits (it is about to use them); forget
        programs idle past the table's timeout (checked once a second). Called every
        step: `waiting_programs` (lazy: the engine's queue) is read only when needed."""
        now = self.clock.now()
        due = [pid for pid, pin in self.pins.items() if pin.expiry <= now] if self.pins else []
        review = self.policy.review_pins(self.pins, now) if self.pins else []
        idle_check = now >= self._next_idle_check
        if not (due or review or idle_check):
            return
        waiting = set(waiting_programs)
        for pid in due:  # one whose next turn waits is released once that turn is admitted
            if pid not in waiting and self._drop(pid):
                self.counts.pins_expired += 1
        for pid in review:
            if pid in self.pins and pid not in waiting and self._drop(pid):
                self.counts.pins_released_early += 1
        if idle_check:
            self._next_idle_check = now + 1.0
            for prog in self.programs.expire_idle(now, waiting | set(self.pins)):
                self.policy.on_program_end(prog)

    def reclaim(self, turn: Turn | None, any_program: bool) -> bool:
        """Release one pin so that `turn` can get KV: the latest-arriving program's, later
        than `turn`'s own unless `any_program`, among pins whose release frees a block.
        True if one was released."""
        pin = pin_to_reclaim(self.pins.values(), turn.program_id if turn is not None else None,
                             turn.program.arrival_time if turn is not None else math.inf, any_program,
                             lambda p: self._frees_any(p.blocks))
        if pin is None:
            return False
        self._drop(pin.program_id)
        self.counts.pins_reclaimed += 1
        return True

    def make_room(self, turn: Turn | None, any_program: bool, idle: bool) -> bool:
        """Release one pin for `turn`, whose KV allocation failed: `reclaim`'s rule; and
        when no other request runs (`idle`), no KV comes back by itself, so any
        program's pin, and last the turn's own (a turn that does not extend its
        pinned prefix, such as a compacted conversation, or another client's turn
        under the same session id, would otherwise wait on its own pin for ever,
        and the queue behind it too). True if one was released."""
        if self.reclaim(turn, any_program or idle):
            return True
        if idle and turn is not None and self._drop(turn.program_id):
            self.counts.pins_reclaimed += 1
            return True
        return False

    def release_all(self) -> None:
        for pid in list(self.pins):
            self._drop(pid)

    def _drop(self, program_id: str) -> bool:
        pin = self.pins.pop(program_id, None)
        if pin is None:
            return False
        self.pinned_blocks -= len(pin.blocks)
        self._release(pin.blocks)
        return True
