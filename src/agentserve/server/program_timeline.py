"""The dashboard's memory of recent programs: each program's latest turns with
when they arrived, were admitted, gave their first token and ended, so the
page can draw turns, the queueing before them and the tool gaps between them.

Bounded whatever the traffic: at most `max_programs` programs (the least
recently active is forgotten first) with at most `max_turns` turns each, and
the latest `max_one_shot` requests that named no program (those would
otherwise crowd the programs out). Used on the engine thread only: it is one
of the engine's listeners (fed each request's outputs) and `observe` is called
by the dashboard's command, which also sees the requests that are still
waiting (no output yet) and notices requests that went away without a last
output (aborted: the client left)."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from agentserve.engine.llm_engine import RequestOutput


@dataclass
class Turn:
    request_id: str
    program_id: str
    arrival: float
    admitted: float | None = None  # first admission (the end of its queueing)
    first_token: float | None = None
    end: float | None = None
    outcome: str = "waiting"  # "waiting", "running", then a finish reason ("stop", "length") or "abort"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    @property
    def open(self) -> bool:
        return self.end is None


@dataclass
class ProgramTrack:
    program_id: str
    first_arrival: float
    last_activity: float
    turns: deque[Turn] = field(default_factory=deque)


class ProgramTimeline:
    def __init__(self, max_programs: int = 48, max_turns: int = 32, max_one_shot: int = 48) -> None:
        self.max_programs = max_programs
        self.max_turns = max_turns
        self._programs: OrderedDict[str, ProgramTrack] = OrderedDict()  # least recently active first
        self.one_shot: deque[Turn] = deque(maxlen=max_one_shot)
        self._open: dict[str, Turn] = {}  # turns not ended yet, by request id

    # --- the engine's listener (engine_snapshot.EngineListener) ---

    def on_request_output(self, out: RequestOutput, now: float, last_token_time: float | None) -> None:
        turn = self._open.get(out.request_id)
        req = out.request  # the engine's record (None from an engine that does not attach it)
        if turn is None:  # its first output (or its program had left the ring: active again)
            anonymous = req.anonymous if req is not None else out.program_id == out.request_id
            turn = self._turn(out.request_id, out.request_id if anonymous else out.program_id, out.arrival_time, now)
        if turn.admitted is None:
            scheduled = req.first_scheduled_time if req is not None else None
            turn.admitted = scheduled if scheduled is not None else out.arrival_time + out.queue_time
        turn.outcome = "running"
        if turn.first_token is None:
            turn.first_token = out.first_token_time
        if req is not None:
            turn.output_tokens = req.num_output_tokens
        elif out.finished and out.token_ids:  # the whole output comes with the last output only
            turn.output_tokens = len(out.token_ids)
        else:
            turn.output_tokens += len(out.new_token_ids)
        turn.prompt_tokens = out.num_prompt_tokens
        turn.cached_tokens = max(out.num_cached_tokens, 0)
        if out.finished:
            turn.end = out.finish_time if out.finish_time is not None else now
            turn.outcome = out.finish_reason or "stop"
            del self._open[out.request_id]

    def on_request_aborted(self) -> None:
        pass  # noticed by `observe`: the request is gone from the scheduler

    def on_program_end(self, jct: float) -> None:
        pass

    def on_ttl_decisions(self, ttls: list[float]) -> None:
        pass

    # --- the dashboard's command ---

    def observe(self, live: Iterable[Any], now: float) -> None:
        """`live`: the scheduler's requests now (waiting and running). Adds those
        not seen yet, and ends the open turns that are no longer among them."""
        seen = set()
        for req in live:
            rid = req.request_id
            seen.add(rid)
            turn = self._open.get(rid)
            if turn is None:
                pid = req.program_id if not req.anonymous else rid
                turn = self._turn(rid, pid, req.arrival_time, now)
                turn.prompt_tokens = req.num_prompt_tokens
            if req.first_scheduled_time is not None and turn.admitted is None:
                turn.admitted = req.first_scheduled_time
            turn.outcome = req.status.value if req.status.value in ("waiting", "running") else turn.outcome
        for rid in [rid for rid in self._open if rid not in seen]:
            turn = self._open.pop(rid)
            turn.end = now
            turn.outcome = "abort"

    def programs(self) -> list[ProgramTrack]:
        """Most recently active first."""
        return list(reversed(self._programs.values()))

    def __len__(self) -> int:
        return len(self._programs)

    # --- bookkeeping ---

    def _turn(self, request_id: str, program_id: str, arrival: float, now: float) -> Turn:
        """A new turn; `program_id` is the request's own id when it named no program."""
        turn = Turn(request_id, program_id, arrival)
        self._open[request_id] = turn
        if program_id == request_id:
            self._append(self.one_shot, turn)
            return turn
        track = self._programs.get(program_id)
        if track is None:
            track = self._programs[program_id] = ProgramTrack(program_id, arrival, now)
            while len(self._programs) > self.max_programs:
                _, old = self._programs.popitem(last=False)
                for t in old.turns:
                    self._open.pop(t.request_id, None)
        else:
            self._programs.move_to_end(program_id)
            track.last_activity = now
        if len(track.turns) >= self.max_turns:
            self._open.pop(track.turns.popleft().request_id, None)
        track.turns.append(turn)
        return turn

    def _append(self, ring: deque[Turn], turn: Turn) -> None:
        if ring.maxlen is not None and len(ring) >= ring.maxlen:
            self._open.pop(ring[0].request_id, None)
        ring.append(turn)
