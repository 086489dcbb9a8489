"""The bodies of the commands that add a request, abort it, and release or end
its program, as the engine thread of server/async_engine.py runs them between
steps; and the server's side of a request in the engine (`_Live`, on
`Request.client`). `AsyncEngine` mixes them in: they use its `engine`,
`scheduler`, `kv`, `max_queue`, `_live()` (the requests the server submitted)
and `_notify` (its listener)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from agentserve.engine.request import Request
from agentserve.engine.sampling_params import SamplingParams
from agentserve.server.request_stream import QueueFullError, RequestStream


@dataclass
class _Live:
    """The server's side of a request in the engine (`Request.client`)."""

    stream: RequestStream
    release_after: bool
    last_token_time: float | None = None


class ProgramCommands:
    def _add(self, stream: RequestStream, ids: list[int], params: SamplingParams, program_id: str | None,
             ttl_hint: float | None, is_last_turn: bool, release_after: bool, cache_salt: Hashable = None) -> None:
        if self.max_queue is not None and self.scheduler.num_waiting >= self.max_queue:
            raise QueueFullError(f"{self.scheduler.num_waiting} requests are already waiting "
                                 f"(--max-queue {self.max_queue}); retry later")
        req = self.engine.add_request(ids, params, request_id=stream.request_id, program_id=program_id,
                                      ttl_hint=ttl_hint, is_last_turn=is_last_turn, cache_salt=cache_salt)
        stream.request = req
        req.client = _Live(stream, release_after)

    def _abort(self, request_id: str) -> None:
        req = self.engine.get(request_id)
        if req is None or req.client is None:
            return  # finished meanwhile
        req.client = None
        self.engine.abort(request_id)
        self._notify("on_request_aborted")
        if req.anonymous:
            self.scheduler.end_program(req.program_id)  # a one-request program: nothing comes back
        elif req.is_last_turn:
            self._end_program(req.program_id)

    def _finished(self, req: Request, live: _Live, now: float) -> None:
        if live.release_after and not req.is_last_turn:
            self.scheduler.release_program(req.program_id)
        if not req.anonymous and req.is_last_turn:
            # the scheduler ended the program as the turn finished: first arrival to now
            self._notify("on_program_end", now - req.program.arrival_time)

    def _in_flight(self, program_id: str) -> list[Request]:
        return [r for r in self._live() if r.program_id == program_id]

    def _release_program(self, program_id: str) -> bool:
        for req in self._in_flight(program_id):
            req.client.release_after = True
        return self.scheduler.release_program(program_id)

    def _end_program(self, program_id: str) -> bool:
        in_flight = self._in_flight(program_id)
        for req in in_flight:
            req.is_last_turn = True  # the scheduler ends the program when it finishes
        if in_flight:
            return True
        known = program_id in self.kv.pins
        prog = self.scheduler.end_program(program_id)
        if prog is not None and not prog.anonymous:
            known = True
            self._notify("on_program_end", prog.last_active - prog.arrival_time)
        return known

