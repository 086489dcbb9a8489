"""The model runner's copy engine: tier copies overlapped with the forward pass.

Two worker threads, one a link, each run the batches in the order they were
handed over and report their part of each (`poll`, `CopiesDone.tier`):
- the host link: the batch's spills' host slots copied out (staged), then
  offloads (-> host slot), then reloads (host slot -> device block);
- the disk link: the staged spills written to their files, then disk reloads
  (disk file -> device block), then a prefetch's stages (disk file -> host
  slot).
A request waits only for the link its reloads are on: nobody waits for a
spill, so a slow disk never holds up a host reload. The staged spills wait in
memory within a bound (kv/disk_tier.py `SpillBacklog`): a batch whose spills
do not fit waits on the host link for the disk link to catch up. Torch's
copies, file I/O and checksums release the GIL, so both run while the main
thread computes.

What keeps the bytes right without waiting:
- an offload's device block is read when its batch is handed over (`submit`,
  on the main thread, into a staging tensor): the step's forward pass may
  write that block right after (an evicted block is reused at once); the
  worker then only writes the snapshot into the host slot;
- a spill's host slot is read (staged) before the batch's offloads, which may
  reuse that slot, on the same link; its file is only read by a disk reload
  once the spill is confirmed, which comes after the disk link wrote it;
- a reload's device block is read and written by no one until the reload
  lands: the scheduler computes no request whose reloads are in flight and
  the reload holds the block (kv/copies.py);
- host slots are touched by the host link only, disk files by the disk link
  only, each in order; except a stage's host slot, which the disk link writes:
  the slot is pending and held (kv/stage_copies.py) until the stage is
  reported, so no host-link copy reads or reuses it meanwhile, and a copy it
  held before (spilled as the stage took the slot) was staged out by the host
  link before the batch reached the disk link.

On CUDA each link issues its copies on a stream of its own (the host link
after an event that marks the snapshot on the compute stream) and waits for
that stream before it reports: the compute stream never waits for a copy."""

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
from agentserve.kv.disk_tier import SpillBacklog
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
    stages: list[tuple[int, int]]  # (disk slot, host slot)
    event: torch.cuda.Event | None  # recorded on the compute stream after the snapshot

    @property
    def host_part(self) -> bool:
        return bool(self.offloads or self.loads)

    @property
    def disk_part(self) -> bool:
        return bool(self.spills or self.disk_loads or self.stages)


class CopyEngine:
    def __init__(self, kv: PagedKVCache) -> None:
        self.kv = kv
        cuda = kv.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=kv.device) if cuda else None
        self.disk_stream = torch.cuda.Stream(device=kv.device) if cuda else None
        host_blocks = 0 if kv.host_kv is None else kv.host_kv.shape[0]
        self.backlog = SpillBacklog(host_blocks, kv.block_bytes)
        self._jobs: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._disk_jobs: queue.SimpleQueue[tuple[_Batch, torch.Tensor | None] | None] = queue.SimpleQueue()
        self._done: deque[CopiesDone] = deque()
        self._cv = threading.Condition()
        self._in_flight = 0  # parts of batches (one a link) handed over and not done
        self._threads: list[threading.Thread] = []  # started with the first batch
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
                       out.blocks_to_load_disk, out.blocks_to_stage, event)
        if not self._threads:
            self._threads = [threading.Thread(target=self._run_host, name="agentserve-kv-copies", daemon=True),
                             threading.Thread(target=self._run_disk, name="agentserve-kv-disk", daemon=True)]
            for t in self._threads:
                t.start()
        with self._cv:
            self._in_flight += batch.host_part + batch.disk_part
        self.num_batches += 1
        self._jobs.put(batch)

    def poll(self, wait: float = 0.0) -> list[CopiesDone]:
        """The parts of batches done since the last call, each link's in the
        order handed over; with `wait`, wait up to that many seconds for one if
        none is done yet."""
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
        if self._threads:
            self._jobs.put(None)  # the host link passes it on to the disk link
            for t in self._threads:
                t.join()
            self._threads = []

    def _report(self, done: CopiesDone) -> None:
        with self._cv:
            self._done.append(done)
            self._in_flight -= 1
            self._cv.notify_all()

    def _run_host(self) -> None:
        while (batch := self._jobs.get()) is not None:
            if batch.disk_part:
                self._disk_jobs.put((batch, self._stage(batch)))
            if batch.host_part:
                self._report(self._copy_host(batch))
        self._disk_jobs.put(None)

    def _run_disk(self) -> None:
        while (job := self._disk_jobs.get()) is not None:
            self._report(self._copy_disk(*job))

    def _stage(self, b: _Batch) -> torch.Tensor | None:
        """The spills' host slots, copied out once the backlog has room for them
        (None: no spills, or the copy failed and so do they)."""
        if not b.spills:
            return None
        n = len(b.spills)
        with self._cv:
            if not self.backlog.fits(n):
                if not self.backlog.num_waits:
                    log.warning("disk KV tier: the disk writes slower than the host tier evicts; tier copies now "
                                "wait for it when %d spilled blocks are pending (agentserve:kv_spill_backlog_waits "
                                "counts the waits)", self.backlog.cap)
                self.backlog.num_waits += 1
                self._cv.wait_for(lambda: self.backlog.fits(n))
        try:
            staged = self.kv.stage_spills([h for h, _ in b.spills])
        except Exception:  # as a copy: the spills fail, the batch goes on
            log.exception("staging %d KV blocks to spill failed", n)
            return None
        with self._cv:
            self.backlog.add(n)
        return staged

    def _copy_host(self, b: _Batch) -> CopiesDone:
        kv = self.kv
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                if b.event is not None:
                    self.stream.wait_event(b.event)
                failed_off = []
                if b.offloads:
                    failed_off = kv.offload(b.offloads, b.staged) if b.staged is not None else range(len(b.offloads))
                failed_ld = kv.load(b.loads) if b.loads else []
                if self.stream is not None:
                    self.stream.synchronize()
        except Exception:  # a batch is never lost: what did not report fails as a whole
            log.exception("a batch of %d KV copies failed", len(b.offloads) + len(b.loads))
            return CopiesDone(b.ticket, range(len(b.offloads)), range(len(b.loads)), tier="host")
        return CopiesDone(b.ticket, failed_off, failed_ld, tier="host")

    def _copy_disk(self, b: _Batch, staged: torch.Tensor | None) -> CopiesDone:
        kv = self.kv
        failed_sp = range(len(b.spills)) if staged is None else []
        try:
            if staged is not None:
                try:
                    failed_sp = kv.write_spills(b.spills, staged)
                finally:
                    with self._cv:
                        self.backlog.written(len(b.spills))
                        self._cv.notify_all()
            with torch.cuda.stream(self.disk_stream) if self.disk_stream is not None else contextlib.nullcontext():
                failed_dl = kv.load_disk(b.disk_loads) if b.disk_loads else []
                if self.disk_stream is not None:
                    self.disk_stream.synchronize()
            failed_st = kv.stage_disk(b.stages) if b.stages else []
        except Exception:  # as on the host link: the part fails as a whole
            log.exception("a batch of %d KV disk copies failed", len(b.spills) + len(b.disk_loads) + len(b.stages))
            return CopiesDone(b.ticket, failed_spills=range(len(b.spills)), failed_disk_loads=range(len(b.disk_loads)),
                              tier="disk", failed_stages=range(len(b.stages)))
        return CopiesDone(b.ticket, failed_spills=failed_sp, failed_disk_loads=failed_dl, tier="disk",
                          failed_stages=failed_st)
