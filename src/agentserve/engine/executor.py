"""The seam between the scheduler and whatever computes: the real model runner
or the simulator's cost model.

An executor reports the tier copies that failed (positions in the output's
`blocks_to_offload` / `blocks_to_load`) and computes no chunk of a request
whose table holds a block whose reload failed (`run_copies`, `readable`): the
scheduler then cuts that request back to the KV it really has.

A step's copies are one batch under the output's `copy_ticket`. An executor
either runs them inside the step (the result's `failed_*` then report them),
or, overlapping them with compute, hands them to a copy engine and says so
(`ExecutorResult.copies_pending`): it reports each batch later, from
`poll_copies`, as `CopiesDone`s. It may report a batch in two parts, one per
link (`CopiesDone.tier`): the host link (offloads and host reloads) and the
disk link (spills and disk reloads), each in the order the batches were
given; a request then waits only for the link its reloads are on. Such an
executor reads an offload's device block before the step's forward pass may
write it (a snapshot), and relies on the scheduler for the rest: a request
whose blocks are still being reloaded is not scheduled (it waits for its own
reloads; the others compute), and a reload keeps its device block referenced
until it lands (kv/copies.py)."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agentserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput

# runs a list of copies (pairs of block ids); returns the positions of those that failed
CopyFn = Callable[[list[tuple[int, int]]], Sequence[int]]


@dataclass
class CopiesDone:
    """A batch of copies an overlapping executor finished (`Executor.poll_copies`):
    the positions that failed in each of the lists of the step that queued it."""

    ticket: int  # the SchedulerOutput.copy_ticket of that step
    failed_offloads: Sequence[int] = ()
    failed_loads: Sequence[int] = ()
    failed_spills: Sequence[int] = ()
    failed_disk_loads: Sequence[int] = ()
    # the part of the batch this reports: "host" (offloads, reloads), "disk" (spills,
    # disk reloads, stages) or None (all of it); the other part's failed_* are unused
    tier: str | None = None
    failed_stages: Sequence[int] = ()


@dataclass
class ExecutorResult:
    # request_id -> sampled token ids (one per chunk with sample=True; more with speculation)
    sampled: dict[str, list[int]] = field(default_factory=dict)
    elapsed: float = 0.0  # seconds the step took (measured, or modelled in simulation)
    failed_offloads: Sequence[int] = ()  # positions in SchedulerOutput.blocks_to_offload
    failed_loads: Sequence[int] = ()  # positions in SchedulerOutput.blocks_to_load
    failed_spills: Sequence[int] = ()  # positions in SchedulerOutput.blocks_to_spill
    failed_disk_loads: Sequence[int] = ()  # positions in SchedulerOutput.blocks_to_load_disk
    failed_stages: Sequence[int] = ()  # positions in SchedulerOutput.blocks_to_stage
    # the step's copies went to a copy engine: `poll_copies` reports them later (the failed_* are unused)
    copies_pending: bool = False


def run_copies(out: SchedulerOutput, offload: CopyFn, load: CopyFn) -> tuple[list[int], list[int], set[int]]:
    """The step's offloads, then its reloads: (failed offload positions, failed
    reload positions, the device blocks those reloads were to fill)."""
    failed_off = list(offload(out.blocks_to_offload)) if out.blocks_to_offload else []
    failed_ld = list(load(out.blocks_to_load)) if out.blocks_to_load else []
    return failed_off, failed_ld, {out.blocks_to_load[i][1] for i in failed_ld}


def run_all_copies(out: SchedulerOutput, offload: CopyFn, load: CopyFn, spill: CopyFn,
                   load_disk: CopyFn, stage: CopyFn | None = None) -> tuple[ExecutorResult, set[int]]:
    """The step's spills (before the offloads that may overwrite their host
    slots), offloads, reloads, disk reloads and disk -> host stages: a result
    carrying the failed positions, and the device blocks the failed reloads
    were to fill. `stage` None: an executor without stages fails any asked."""
    failed_sp = list(spill(out.blocks_to_spill)) if out.blocks_to_spill else []
    failed_off, failed_ld, unloaded = run_copies(out, offload, load)
    failed_dl = list(load_disk(out.blocks_to_load_disk)) if out.blocks_to_load_disk else []
    unloaded |= {out.blocks_to_load_disk[i][1] for i in failed_dl}
    n = len(out.blocks_to_stage)
    failed_st = [] if not n else list(range(n)) if stage is None else list(stage(out.blocks_to_stage))
    return ExecutorResult(failed_offloads=failed_off, failed_loads=failed_ld, failed_spills=failed_sp,
                          failed_disk_loads=failed_dl, failed_stages=failed_st), unloaded


def readable(chunks: list[ScheduledChunk], unloaded: set[int]) -> list[ScheduledChunk]:
    """The chunks whose request holds none of the `unloaded` device blocks (a
    block, or a page of a window part its table holds: kv/window_tier.py)."""
    if not unloaded:
        return chunks
    return [c for c in chunks if unloaded.isdisjoint(c.request.block_table.block_ids)
            and not any(p.block_id in unloaded for b in c.request.block_table.window.values() for p in b.wpart or ())]


class Executor(abc.ABC):
    @abc.abstractmethod
    def execute(self, output: SchedulerOutput) -> ExecutorResult:
        """Run the copies, then one forward pass over the scheduled chunks."""

    def release(self, request_id: str) -> None:
        """The request is over: drop any per-request state (a sampler's seed)."""

    def poll_copies(self, wait: float = 0.0) -> list[CopiesDone]:
        """The batches of copies finished since the last call, oldest first;
        with `wait` > 0, wait up to that many seconds for one when none is
        finished yet. An executor that runs its copies in the step has none."""
        return []
