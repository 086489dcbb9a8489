"""The model runner's copy engine: tier copies overlapped with the forward pass.

One worker thread runs each step's batch of copies in the order the batches
were handed over, and within a batch in the order the step would run them
(runner/kv_cache.py): spills (host slot -> disk file), offloads (-> host
slot), reloads (host slot -> device block), disk reloads (disk file -> device
block); it reports each batch's failed positions (`poll`). Torch's copies,
file I/O and hashing release the GIL, so they run while the main thread
computes.

What keeps the bytes right without waiting:
- an offload's device block is read when its batch is handed over (`submit`,
  on the main thread, into a staging tensor): the step's forward pass may
  write that block right after (an evicted block is reused at once); the
  worker then only writes the snapshot into the host slot;
- a reload's device block is read and written by no one until the reload
  lands: the scheduler computes no request whose reloads are in flight and
  the reload holds the block (kv/copies.py);
- host slots and disk files are touched by the worker only, in order.

On CUDA the worker issues its copies on a stream of its own, after an event
that marks the snapshot on the compute stream, and waits for that stream
before it reports the batch: the compute stream never waits for a copy."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass

import torch

from agentserve.engine.executor import CopiesDone
from agentserve.engine.scheduler_output import SchedulerOutput
from agentserve.runner.kv_cache import PagedKVCache

log = logging.getLogger(__name__)


@dataclass
class _Batch:
    ticket: int
    spills: list[tuple[int, int]]
    offloads: list[tuple[int, int]]
    staged: torch.Tensor | None  # the offloads' device blocks, read at hand-over (None: that read failed)
    loads: list[tuple[int, int]]
    disk_loads: list[tuple[int, int]]
    event: torch.cuda.Event | None  # recorded on the compute stream after the snapshot


class CopyEngine:
    def __init__(self, kv: PagedKVCache) -> None:
        self.kv = kv
        self.stream = torch.cuda.Stream(device=kv.device) if kv.device.type == "cuda" else None
        self._jobs: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._done: deque[CopiesDone] = deque()
        self._cv = threading.Condition()
        self._in_flight = 0  # batches handed over and not done
        self._thread: threading.Thread | None = None  # started with the first batch
        self.num_batches = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, out: SchedulerOutput) -> None:
        """Hand over the step's copies; returns at once (after the offloads' snapshot)."""
        staged = None
        if out.blocks_to_offload:
            try:
                staged = self.kv.gather([d for d, _ in out.blocks_to_offload])
            except (RuntimeError, MemoryError) as e:  # the offloads fail; the rest goes on
                log.warning("snapshot of %d KV blocks to offload failed: %s", len(out.blocks_to_offload), e)
        event = None
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record()
        batch = _Batch(out.copy_ticket, out.blocks_to_spill, out.blocks_to_offload, staged, out.blocks_to_load,
                       out.blocks_to_load_disk, event)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="agentserve-kv-copies", daemon=True)
            self._thread.start()
        with self._cv:
            self._in_flight += 1
        self.num_batches += 1
        self._jobs.put(batch)

    def poll(self, wait: float = 0.0) -> list[CopiesDone]:
        """The batches done since the last call, in the order handed over; with
        `wait`, wait up to that many seconds for one if none is done yet."""
        with self._cv:
            if wait > 0 and not self._done and self._in_flight:
                self._cv.wait(wait)
            done = list(self._done)
            self._done.clear()
        return done

    def drain(self) -> None:
        """Wait until every batch handed over is done (their reports stay for `poll`)."""
        with self._cv:
            self._cv.wait_for(lambda: self._in_flight == 0)

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while (batch := self._jobs.get()) is not None:
            done = self._copy(batch)
            with self._cv:
                self._done.append(done)
                self._in_flight -= 1
                self._cv.notify_all()

    def _copy(self, b: _Batch) -> CopiesDone:
        kv = self.kv
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                if b.event is not None:
                    self.stream.wait_event(b.event)
                failed_sp = kv.spill(b.spills) if b.spills else []
                failed_off = []
                if b.offloads:
                    failed_off = kv.offload(b.offloads, b.staged) if b.staged is not None else range(len(b.offloads))
                failed_ld = kv.load(b.loads) if b.loads else []
                failed_dl = kv.load_disk(b.disk_loads) if b.disk_loads else []
                if self.stream is not None:
                    self.stream.synchronize()
        except Exception:  # a batch is never lost: what did not report fails as a whole
            log.exception("a batch of %d KV copies failed", len(b.spills) + len(b.offloads) + len(b.loads)
                          + len(b.disk_loads))
            return CopiesDone(b.ticket, range(len(b.offloads)), range(len(b.loads)), range(len(b.spills)),
                              range(len(b.disk_loads)))
        return CopiesDone(b.ticket, failed_off, failed_ld, failed_sp, failed_dl)
