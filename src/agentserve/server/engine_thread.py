"""The thread that owns the model: it builds it, then runs the engine loop.

Why one thread for both: torch's CPU build parallelises ops with libgomp, and
once one thread has run a parallel region (loading and packing the weights
does), parallel regions entered from a second thread run much slower (a bf16
decode step took well over half as long again when the model was loaded on one
thread and stepped on another; OMP_WAIT_POLICY and GOMP_SPINCOUNT do not change
it). So `cmd_serve` builds
the LLM with `EngineThread.run` and hands the same thread to `AsyncEngine`."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any

_CLOSE = object()


class EngineThread:
    """A daemon thread that runs the callables given to it, one at a time, in order."""

    def __init__(self, name: str = "agentserve-engine") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _CLOSE:
                return
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to whoever waits on the future
                fut.set_exception(e)

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        if not self._thread.is_alive():
            raise RuntimeError(f"thread {self._thread.name} has exited")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, fut))
        return fut

    def run(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on this thread; its result, or its exception re-raised here."""
        if threading.current_thread() is self._thread:
            return fn()
        return self.submit(fn).result()

    def close(self) -> None:
        """Exit once the jobs already given have run."""
        self._jobs.put(_CLOSE)

    @property
    def name(self) -> str:
        return self._thread.name
