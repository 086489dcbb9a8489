"""The engine on one background thread, with an asyncio-facing API.

`LLMEngine` is not thread-safe, and a step (a forward pass) blocks for
milliseconds to seconds, so it cannot run on the event loop. One engine thread
owns the engine, the scheduler and the KV manager; everything else reaches them
through commands: a callable put on a thread-safe queue, run by the engine
thread between steps, its result handed back through a future. Adding a
request, aborting one, releasing or ending a program, taking a metrics snapshot
and checking block accounting are all such commands, so none of them races a
step.

The engine thread keeps no map of its own: a request's server-side state (its
stream, whether to release its program after it) hangs on the engine's record
of it (`Request.client`), found through the scheduler's registry; a program's
first arrival and last activity, from which its job completion time (JCT) is
measured, are in the scheduler's program table.

Outputs go the other way: after each step the engine thread hands the step's
`RequestOutput`s to the event loop in one `call_soon_threadsafe`, each into the
`asyncio.Queue` of its request's `RequestStream`. A stream that is closed before
its request finished (the client went away) aborts the request, which frees its
KV at the next command.

When nothing runs but pins exist, the thread still steps the scheduler at the
next pin expiry (and at least every second), so expired pins are released on
an idle server too.

Each time the engine runs out of work, the thread checks the block accounting
once (server/idle_integrity.py); a failure is logged and counted, and serving
goes on.

With a state file (`learned_state`, set by the app: `serve --state-dir`) the
thread exports what the policy and the step-time model learned at its
interval, for a writer thread to save, and `stop` saves it once more after the
thread has ended.

With a collector policy (`gc_policy`, engine/gc_policy.py; `agentserve serve`
gives the `--gc` one), `start` applies it (the model is loaded and the KV pool
built by then: the start-up heap is frozen), the thread runs the full
collections itself when the work runs out and, on an engine that stays busy,
as a rare backstop between steps; `stop` puts the collector back."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Hashable
from typing import Any

from agentserve.engine.gc_policy import GCController, GCPolicy, apply_gc_policy, restore_gc
from agentserve.engine.llm_engine import RequestOutput
from agentserve.engine.request import Request
from agentserve.engine.sampling_params import SamplingParams
from agentserve.policy.toolcall_stream import ValidatorStats
from agentserve.server.engine_commands import CommandQueue
from agentserve.server.engine_snapshot import EngineListener, EngineSnapshot, take_snapshot
from agentserve.server.engine_thread import EngineThread
from agentserve.server.idle_integrity import IdleIntegrity
from agentserve.server.program_commands import ProgramCommands
from agentserve.server.request_stream import EngineError, EngineStopped, RequestStream
from agentserve.server.stats_log import StatsLog

log = logging.getLogger("agentserve.server")

IDLE_WAKE_S = 1.0  # the longest the idle thread sleeps (pin review, program-table pruning)
NO_PROGRESS_WAIT_S = 0.005  # backoff when requests wait but nothing could be scheduled


class AsyncEngine(ProgramCommands):
    def __init__(self, llm: Any, *, max_queue: int | None = None, listener: EngineListener | None = None,
                 thread: EngineThread | None = None, stats_interval: float | None = None,
                 gc_policy: GCPolicy | None = None) -> None:
        """`llm` is an `agentserve.llm.LLM` (or anything with its `engine`,
        `scheduler`, `kv` and `check_integrity`). `max_queue`: requests that may
        wait for admission at once (None: no limit). `thread`: the thread that
        built `llm`, to run the loop on (see engine_thread.py); default a new one.
        `stats_interval`: seconds between the log lines of stats_log.py (None: none).
        `gc_policy`: how the process's cyclic collector runs, applied at `start`
        (None: left as it is)."""
        self.llm = llm
        self.engine = llm.engine
        self.scheduler = llm.scheduler
        self.kv = llm.scheduler.kv
        self.clock = llm.engine.clock
        self.max_queue = max_queue
        self.listener = listener
        self._commands = CommandQueue()
        self._home = thread
        self._owns_home = False
        self._running: concurrent.futures.Future | None = None  # the loop on its thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ttl_seen = self.scheduler.stats.pins_created
        self._stopping = False
        self._lock = threading.Lock()  # orders posting a command against the thread's final drain
        self._last_prune = 0.0
        self.stats_log = StatsLog(stats_interval) if stats_interval else None
        self.crashed: BaseException | None = None
        self._had_work = False  # requests ran since the last integrity check
        self.integrity = IdleIntegrity()
        self.tool_stats = ValidatorStats()  # counted by the requests' tool-call validators
        # the server's caches (objects with stats()), set by the app; snapshots read them (None: off)
        self.render_cache: Any = None
        self.response_cache: Any = None
        self.gc_policy = gc_policy
        self.gc: GCController | None = None  # the applied policy, from start to stop
        # the learned state's file (learned_state.py), set by the app: saved at intervals and at stop (None: off)
        self.learned_state: Any = None

    @property
    def integrity_checks(self) -> int:
        return self.integrity.checks

    @property
    def integrity_failures(self) -> int:
        return self.integrity.failures

    # --- lifecycle (event loop side) ---

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._running is not None:
            raise RuntimeError("the engine thread is already started")
        self._loop = loop or asyncio.get_running_loop()
        if self.gc_policy is not None:
            self.gc = apply_gc_policy(self.gc_policy, self.clock.now)  # once: the model and the KV pool are built
        if self._home is None:
            self._home = EngineThread()
            self._owns_home = True
        self._running = self._home.submit(self._main)

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is in flight (its streams get EngineStopped) and join the thread."""
        running = self._running
        if running is not None and not running.done():
            self._commands.put_stop()
            try:
                running.result(timeout)
            except concurrent.futures.TimeoutError:
                log.error("the engine thread did not stop within %.0f s", timeout)
            if self._owns_home and self._home is not None:
                self._home.close()
        if self.learned_state is not None:
            if running is None or running.done():
                self.learned_state.close(self.scheduler)
            else:
                log.error("the learned state is not saved at shutdown: the engine thread is still running")
        if self.gc is not None:
            restore_gc()
            self.gc = None

    async def drain(self, timeout: float) -> int:
        """Let the requests in flight finish for up to `timeout` seconds, then end
        the rest with EngineStopped (their streams close cleanly with an error
        event). For a graceful shutdown: call it once no new requests can arrive.
        Returns the number of requests that had to be ended."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while await self.call(lambda: self.engine.num_unfinished) and loop.time() < deadline:
                await asyncio.sleep(0.05)
            return await self.call(self._end_all_for_shutdown)
        except EngineStopped:
            return 0

    def _live(self) -> list[Request]:
        """The requests in the engine that the server submitted (engine thread)."""
        return [r for r in self.scheduler.requests.values() if r.client is not None]

    def _end_all_for_shutdown(self) -> int:
        n = len(self._live())
        if n:
            log.warning("shutting down: ending %d request(s) still in flight", n)
            self._fail_all(EngineStopped("the server is shutting down"))
        return n

    @property
    def alive(self) -> bool:
        return self._running is not None and not self._running.done() and not self._stopping

    # --- commands ---

    def _post(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self.alive:
                raise EngineStopped("the engine is not running" + (f" (it crashed: {self.crashed})"
                                                                   if self.crashed else ""))
            self._commands.put(fn, fut)
        return fut

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the engine thread between steps; its result or exception."""
        return await asyncio.wrap_future(self._post(fn))

    def call_sync(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """`call` for code on other threads (tests, a debugger): blocks until done."""
        return self._post(fn).result(timeout)

    async def submit(self, prompt_token_ids: list[int], params: SamplingParams, *, request_id: str,
                     program_id: str | None = None, ttl_hint: float | None = None, is_last_turn: bool = False,
                     release_after: bool = False, cache_salt: Hashable = None) -> RequestStream:
        """Add a request. Raises ValueError (it can never fit), QueueFullError or EngineStopped."""
        stream = RequestStream(self, request_id)
        await self.call(lambda: self._add(stream, prompt_token_ids, params, program_id, ttl_hint,
                                          is_last_turn, release_after, cache_salt))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request; returns at once (the engine thread frees its KV)."""
        with self._lock:
            if self.alive:
                self._commands.put(lambda: self._abort(request_id))

    async def release_program(self, program_id: str) -> bool:
        """Drop the program's pin now (and after any turn of it still in flight)."""
        return await self.call(lambda: self._release_program(program_id))

    async def end_program(self, program_id: str) -> bool:
        """The program is over: drop its pin, forget it, record its JCT. A turn
        still in flight becomes its last. False if the program was unknown."""
        return await self.call(lambda: self._end_program(program_id))

    async def check_integrity(self) -> None:
        await self.call(self.llm.check_integrity)

    async def snapshot(self) -> EngineSnapshot:
        return await self.call(self._snapshot)

    # --- the engine thread ---

    def _main(self) -> None:
        try:
            while not self._stopping:
                busy = self.engine.has_unfinished
                if not busy and self._had_work:  # the work just ran out
                    self._had_work = False
                    self.integrity.check(self.scheduler)
                    if self.gc is not None:
                        self.gc.on_idle()  # a full collection, if one is due, while nothing waits on it
                self._run_commands(None if busy else self._idle_wait())
                if self._stopping:
                    break
                if self.engine.has_unfinished:
                    self._had_work = True
                    if not self._step():
                        self._run_commands(NO_PROGRESS_WAIT_S)
                elif self.kv.pins or self.scheduler.prefetcher:
                    self._step()  # nothing to run: schedule() releases expired pins, issues due prefetches
                self._housekeeping()
        except BaseException as e:  # a bug in this loop: fail loudly, never hang clients
            self.crashed = e
            log.exception("the engine thread crashed")
        finally:
            with self._lock:
                self._stopping = True
            self._fail_all(EngineStopped("the server is shutting down" if self.crashed is None
                                         else f"the engine crashed: {self.crashed}"))
            self._commands.fail_pending(lambda: EngineStopped("the server is shutting down"))

    def _idle_wait(self) -> float:
        first = self.kv.pins.next_expiry()
        due = self.scheduler.prefetcher.next_due()  # a prefetch to issue (engine/prefetch.py)
        if due is not None and (first is None or due < first):
            first = due
        if first is None:
            return IDLE_WAKE_S
        return min(max(first - self.clock.now(), 0.001), IDLE_WAKE_S)

    def _run_commands(self, timeout: float | None) -> None:
        """Run queued commands; with a timeout, wait up to that long for the first."""
        if self._commands.run(timeout):
            self._stopping = True

    def _step(self) -> bool:
        """One engine step; False when it made no progress."""
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed; aborting the %d requests in flight", self.engine.num_unfinished)
            self._fail_all(EngineError(f"the engine failed: {type(e).__name__}: {e}"))
            return False
        now = self.clock.now()
        batch = []
        for out in outputs:
            req = out.request
            live = req.client if req is not None else None
            if live is None:
                continue
            self._notify("on_request_output", out, now, live.last_token_time)
            if out.new_token_ids:
                live.last_token_time = now
            if out.finished:
                req.client = None
                self._finished(req, live, now)
            batch.append((live.stream, out))
        self._deliver(batch)
        return bool(outputs) or self.scheduler.num_running > 0

    def _deliver(self, batch: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        if not batch or self._loop is None:
            return

        def put_all() -> None:
            for stream, item in batch:
                stream._put(item)
        try:
            self._loop.call_soon_threadsafe(put_all)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _fail_all(self, error: BaseException) -> None:
        batch: list[tuple[RequestStream, RequestOutput | BaseException]] = []
        for req in self._live():
            live, req.client = req.client, None
            try:
                self.engine.abort(req.request_id)
            except Exception:
                log.exception("aborting %s failed", req.request_id)
            batch.append((live.stream, error))
        self._deliver(batch)

    def _notify(self, method: str, *args: Any) -> None:
        if self.listener is None:
            return
        try:
            getattr(self.listener, method)(*args)
        except Exception:  # metrics must never take the engine down
            log.exception("listener %s failed", method)

    def _housekeeping(self) -> None:
        if self.gc is not None:
            self.gc.maybe_collect()  # only when busy for busy_full_interval_s without an idle moment
        stats = self.scheduler.stats
        new = stats.pins_created - self._ttl_seen
        if new > 0:
            hist = stats.ttl_history
            self._notify("on_ttl_decisions", list(hist[-min(new, len(hist)):]) if hist else [])
            self._ttl_seen = stats.pins_created
        now = self.clock.now()
        if now - self._last_prune >= IDLE_WAKE_S:
            self._last_prune = now
            self.scheduler.expire_programs()  # on an idle server too: abandoned programs end, without a JCT
        if self.stats_log is not None:
            self.stats_log.tick(now, self._snapshot)
        if self.learned_state is not None:
            self.learned_state.tick(now, self.scheduler)

    def _snapshot(self) -> EngineSnapshot:
        copier = self.llm.executor.copier
        return take_snapshot(self.scheduler, self.tool_stats.counts(), self.render_cache, self.response_cache,
                             self.integrity.failures, copier.backlog.num_waits if copier is not None else 0,
                             getattr(self.llm, "shared_kv", None))
