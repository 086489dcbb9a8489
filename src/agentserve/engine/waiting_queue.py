"""The waiting requests, kept in the policy's order as they come and go.

A request's place (`Policy.priority`) is computed when it joins the queue and
kept on the request (`Request.queue_key`); the queue stays sorted by inserting
each newcomer where it belongs, so a step reads the order without sorting it.
A priority may depend on the request, its program and whether the program is
pinned: when a program's pin comes or goes, the scheduler re-places that
program's waiting requests (`replace_program`). While a policy's priorities
change with time itself (`Policy.time_dependent`, which a policy may switch on
and off), the queue is re-sorted every step, and once more when it stops: the
places kept meanwhile are stale."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Iterator

from agentserve.engine.request import Request


class WaitingQueue:
    def __init__(self, priority: Callable[[Request, float], tuple], time_dependent: Callable[[], bool]) -> None:
        self._priority = priority
        self._time_dependent = time_dependent
        self._stale = False  # places were kept while priorities moved with time: re-sort once more
        self._entries: list[tuple[tuple, int, Request]] = []  # sorted; the int breaks ties by arrival in the queue
        self._programs: dict[str, list[Request]] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __iter__(self) -> Iterator[Request]:
        """In priority order (as of the last `order`, for a time-dependent policy)."""
        return (e[2] for e in self._entries)

    def has_program(self, program_id: str) -> bool:
        return program_id in self._programs

    def push(self, req: Request, now: float) -> None:
        self._insert(req, now, next(self._seq))
        self._programs.setdefault(req.program_id, []).append(req)

    def remove(self, req: Request) -> None:
        self._take(req)
        reqs = self._programs[req.program_id]
        reqs.remove(req)
        if not reqs:
            del self._programs[req.program_id]

    def remove_all(self, gone: Iterable[Request]) -> None:
        """Remove several requests at once (one pass over the queue)."""
        gone = list(gone)
        if not gone:
            return
        if len(gone) <= 8:  # the usual step: a few admitted, each found by bisection
            for req in gone:
                self._take(req)
        else:
            out = set(gone)
            self._entries = [e for e in self._entries if e[2] not in out]
        for req in gone:
            req.queue_key = None
            reqs = self._programs[req.program_id]
            reqs.remove(req)
            if not reqs:
                del self._programs[req.program_id]

    def replace_program(self, program_id: str, now: float) -> None:
        """The program's pin came or went: its waiting requests take their new places."""
        for req in self._programs.get(program_id, ()):
            seq = req.queue_key[1]
            self._take(req)
            self._insert(req, now, seq)

    def order(self, now: float) -> None:
        """Bring the order up to date: only a time-dependent policy's changes by itself."""
        moving = self._time_dependent()
        stale, self._stale = self._stale, moving
        if (moving or stale) and self._entries:
            prio = self._priority
            entries = [(prio(e[2], now), e[1], e[2]) for e in self._entries]
            entries.sort()
            for e in entries:
                e[2].queue_key = e
            self._entries = entries

    # Changes replace the list instead of editing it, so a step that iterates the
    # queue while admitting (which may unpin, and so re-place, a program) is safe.

    def _insert(self, req: Request, now: float, seq: int) -> None:
        entry = (self._priority(req, now), seq, req)
        req.queue_key = entry
        if self._time_dependent():  # a place taken now may be stale once priorities stop moving
            self._stale = True
        entries = self._entries
        i = bisect.bisect_right(entries, entry)
        self._entries = entries[:i] + [entry] + entries[i:]

    def _take(self, req: Request) -> None:
        entry = req.queue_key
        entries = self._entries
        i = bisect.bisect_left(entries, entry)
        if i >= len(entries) or entries[i] is not entry:
            i = entries.index(entry)  # a time-dependent order moved it since
        self._entries = entries[:i] + entries[i + 1:]
        req.queue_key = None

    def check(self) -> None:
        moving = self._stale or self._time_dependent()
        assert all(a < b for a, b in zip(self._entries, self._entries[1:])) or moving, "out of order"
        assert sum(len(v) for v in self._programs.values()) == len(self._entries)
        for e in self._entries:
            assert e[2].queue_key is e and e[2] in self._programs[e[2].program_id]
            # kept, not recomputed: a place must still be the one the policy gives now
            assert moving or e[0] == self._priority(e[2], 0.0), f"{e[2]}: stale place {e[0]}"
