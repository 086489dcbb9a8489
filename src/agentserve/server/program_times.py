"""The server's clock of each program a client named: its first arrival, its
last activity and its requests in flight, from which the job completion time
(JCT) of an ended program is measured. Used on the engine thread only; a
program idle for longer than the idle timeout is forgotten without a JCT."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Times:
    first_arrival: float
    last_activity: float
    in_flight: set[str] = field(default_factory=set)


class ProgramTimes:
    def __init__(self) -> None:
        self._programs: dict[str, _Times] = {}

    def __contains__(self, program_id: str) -> bool:
        return program_id in self._programs

    def __len__(self) -> int:
        return len(self._programs)

    def add(self, program_id: str, request_id: str, arrival: float, now: float) -> None:
        """A request of the program entered the engine."""
        prog = self._programs.get(program_id)
        if prog is None:
            prog = self._programs[program_id] = _Times(arrival, now)
        prog.last_activity = now
        prog.in_flight.add(request_id)

    def aborted(self, program_id: str, request_id: str) -> None:
        prog = self._programs.get(program_id)
        if prog is not None:
            prog.in_flight.discard(request_id)

    def finished(self, program_id: str, request_id: str, now: float, last_turn: bool) -> float | None:
        """A request of the program finished. When it was the last turn the
        program is forgotten and its JCT (first arrival to now) returned."""
        prog = self._programs.get(program_id)
        if prog is None:
            return None
        prog.in_flight.discard(request_id)
        prog.last_activity = now
        if not last_turn:
            return None
        del self._programs[program_id]
        return now - prog.first_arrival

    def end(self, program_id: str) -> float | None:
        """Forget the program; its JCT (first arrival to last activity), None if unknown."""
        prog = self._programs.pop(program_id, None)
        return None if prog is None else prog.last_activity - prog.first_arrival

    def prune(self, now: float, idle_timeout: float) -> None:
        """Forget (without a JCT) the programs with nothing in flight and idle for over `idle_timeout` s."""
        idle = [pid for pid, p in self._programs.items() if not p.in_flight and now - p.last_activity > idle_timeout]
        for pid in idle:
            del self._programs[pid]
