"""Programs: the unit agentserve schedules. A program is one agent run, a
sequence of LLM calls (turns) separated by tool calls."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class ProgramState:
    program_id: str
    arrival_time: float  # arrival of the program's first request
    last_active: float = 0.0  # its latest request's arrival or finish (idle expiry and the JCT count from it)
    turns_finished: int = 0
    attained_service: float = 0.0  # seconds of engine steps its requests took part in
    last_finish_time: float | None = None
    last_tool: str | None = None
    ended: bool = False
    anonymous: bool = False  # a request without a program id: not a sample of program behaviour
    history: list[int] | None = None  # token ids of its last finished turn, which the next should extend
    chain: Any = None  # where its last turn's blocks lie in the prefix index (kv ChainHint): its next match's start


class ProgramTable:
    """Live programs, bounded: a program is forgotten when it ends, or after
    `idle_timeout` seconds without activity (a client that never said it ended).
    The one program table: the scheduler, its policy and the server read it."""

    def __init__(self, idle_timeout: float = 600.0, max_programs: int = 100_000) -> None:
        self.idle_timeout = idle_timeout
        self.max_programs = max_programs
        self._programs: OrderedDict[str, ProgramState] = OrderedDict()  # least recently active first

    def get(self, program_id: str) -> ProgramState | None:
        return self._programs.get(program_id)

    def touch(self, program_id: str, now: float) -> ProgramState:
        """The program's state, created on its first request."""
        p = self._programs.get(program_id)
        if p is None:
            p = ProgramState(program_id, now)
            self._programs[program_id] = p
            if len(self._programs) > self.max_programs:
                self._programs.popitem(last=False)
        else:
            self._programs.move_to_end(program_id)
        p.last_active = now
        return p

    def active(self, program: ProgramState, now: float) -> None:
        """A request of `program` finished: it was active now (if it still lives)."""
        if self._programs.get(program.program_id) is program:
            self._programs.move_to_end(program.program_id)
            program.last_active = now

    def end(self, program_id: str) -> ProgramState | None:
        p = self._programs.pop(program_id, None)
        if p is not None:
            p.ended = True
        return p

    def expire_idle(self, now: float, busy: set[str] | frozenset[str] = frozenset()) -> list[ProgramState]:
        """End the programs idle for longer than the timeout (none of `busy`)."""
        gone = []
        for pid, p in list(self._programs.items()):
            if now - p.last_active <= self.idle_timeout:
                break  # ordered by activity: the rest are newer
            if pid in busy:
                continue
            gone.append(self.end(pid))
        return gone

    def entries(self) -> list[tuple[str, ProgramState]]:
        """(id, state) of every live program, least recently active first: a copy made
        in one C-level call, so that another thread (a router's load report) can read
        the table while the engine changes it."""
        return list(self._programs.items())

    def __len__(self) -> int:
        return len(self._programs)

    def __contains__(self, program_id: str) -> bool:
        return program_id in self._programs
