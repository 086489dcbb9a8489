"""The engine thread's inbox: callables that other threads put on a thread-safe
queue and the engine thread runs between steps, each result (or exception)
handed back through its future. A stop marker ends the loop; commands still
queued after it fail with the error the owner gives."""

from __future__ import annotations

import concurrent.futures
import logging
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("agentserve.server")


@dataclass
class Command:
    fn: Callable[[], Any]
    future: concurrent.futures.Future | None  # None: nobody waits (a failure is logged)


_STOP = object()


class CommandQueue:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Command | object] = queue.SimpleQueue()

    def put(self, fn: Callable[[], Any], future: concurrent.futures.Future | None = None) -> None:
        self._queue.put(Command(fn, future))

    def put_stop(self) -> None:
        self._queue.put(_STOP)

    def run(self, timeout: float | None) -> bool:
        """Run queued commands; with a timeout, wait up to that long for the first.
        True when the stop marker came (the commands behind it stay queued)."""
        try:
            cmd = self._queue.get(timeout=timeout) if timeout else self._queue.get_nowait()
        except queue.Empty:
            return False
        while True:
            if cmd is _STOP:
                return True
            _execute(cmd)  # type: ignore[arg-type]
            try:
                cmd = self._queue.get_nowait()
            except queue.Empty:
                return False

    def fail_pending(self, error: Callable[[], BaseException]) -> None:
        """Empty the queue without running it: each waiting future gets `error()`."""
        while True:
            try:
                cmd = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, Command) and cmd.future is not None:
                cmd.future.set_exception(error())


def _execute(cmd: Command) -> None:
    try:
        result = cmd.fn()
    except BaseException as e:
        if cmd.future is not None:
            cmd.future.set_exception(e)
        else:
            log.exception("engine command failed")
        return
    if cmd.future is not None:
        cmd.future.set_result(result)
