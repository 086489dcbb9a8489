"""The real model behind the scheduler's Executor interface: one step = the
host-tier copies the KV manager asked for, then one forward pass over the
step's chunks, then sampling for the chunks that reach the end of their
request's tokens: one token each, or, for a decode with a speculative
draft, one at each of its positions (the scheduler compares them with the
draft).

With `overlap_copies` the copies do not run in the step: they go to the copy
engine (runner/copy_engine.py), which runs them beside the forward pass and
reports them through `poll_copies`; the scheduler must then be configured to
match (SchedulerConfig.overlap_copies), so that no request computes before
its own reloads landed."""

from __future__ import annotations

import time

import torch

from agentserve.engine.executor import CopiesDone, Executor, ExecutorResult, readable, run_all_copies
from agentserve.engine.scheduler_output import SchedulerOutput
from agentserve.runner.attention import build_metadata
from agentserve.runner.copy_engine import CopyEngine
from agentserve.runner.kv_cache import PagedKVCache
from agentserve.runner.model import LlamaModel
from agentserve.runner.sampler import GREEDY, Sampler


class ModelExecutor(Executor):
    def __init__(self, model: LlamaModel, kv: PagedKVCache, overlap_copies: bool = False) -> None:
        self.model = model
        self.kv = kv
        self.device = model.device
        self.sampler = Sampler(model.device)
        self.copier = CopyEngine(kv) if overlap_copies else None

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)

    def poll_copies(self, wait: float = 0.0) -> list[CopiesDone]:
        return self.copier.poll(wait) if self.copier is not None else []

    def execute(self, out: SchedulerOutput) -> ExecutorResult:
        t0 = time.perf_counter()
        if self.copier is None:
            # spills, then offloads: a block written out this step may be reused by a load
            res, unloaded = run_all_copies(out, self.kv.offload, self.kv.load, self.kv.spill, self.kv.load_disk,
                                           self.kv.stage_disk)
            chunks = readable(out.chunks, unloaded)  # a request whose reload failed computes nothing
        else:
            res, chunks = ExecutorResult(copies_pending=out.has_copies), out.chunks
            if out.has_copies:
                self.copier.submit(out)
        if chunks:
            try:
                res.sampled = self._forward(chunks)
            except BaseException:
                if self.copier is not None:
                    self.copier.drain()  # the caller fails the step's copies: none may still be running
                raise
        res.elapsed = time.perf_counter() - t0
        return res

    def _forward(self, chunks) -> dict[str, list[int]]:
        decodes = [c for c in chunks if c.num_tokens == 1 and c.start > 0]
        prefills = [c for c in chunks if not (c.num_tokens == 1 and c.start > 0)]
        ids: list[int] = []
        pos: list[int] = []
        for c in decodes:
            ids.append(c.request.token_ids[c.start])
            pos.append(c.start)
        for c in prefills:
            ids.extend(c.token_ids)
            pos.extend(range(c.start, c.start + c.num_tokens))
        bs = self.kv.block_size
        need = lambda c: -(-(c.start + c.num_tokens) // bs)  # noqa: E731
        layout = self.kv.layout
        groups = 1 if layout is None else 1 + layout.pages
        metas = [build_metadata(
            [group_table(c.request.block_table, g, need(c)) for c in decodes],
            [c.start + 1 for c in decodes],
            [(group_table(c.request.block_table, g, need(c)), c.start, c.num_tokens) for c in prefills],
            bs, self.device, dtype=self.model.dtype) for g in range(groups)]
        meta = metas[0]
        if layout is not None:
            meta.groups = metas
        # rows to sample: the last of each chunk that reaches its request's end, and
        # every row of a draft (each verifies the draft token before it)
        rows: list[int] = []
        params, rids, steps, verifies = [], [], [], []
        row = 0
        for c in decodes + prefills:
            row += c.num_tokens
            if not c.sample:
                continue
            n = len(c.draft) + 1
            req = c.request
            rows.extend(range(row - n, row))
            params.extend([req.sampling or GREEDY] * n)
            rids.extend([req.request_id] * n)
            steps.extend(range(req.num_output_tokens, req.num_output_tokens + n))
            verifies.extend([*c.draft, None])
        dev = self.device
        logits = self.model.forward(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta, self.kv,
                                    torch.tensor(rows, device=dev, dtype=torch.int64))
        sampled: dict[str, list[int]] = {}
        if rows:
            for rid, tok in zip(rids, self.sampler.sample(logits, params, rids, steps, verifies)):
                sampled.setdefault(rid, []).append(tok)
        return sampled


def group_table(table, group: int, n: int) -> list[int]:
    """The blocks layer group `group` (runner/kv_cache.py's HybridLayout) reads
    for a table's first `n` blocks: group 0 the blocks, group j page j - 1 of
    each block's window part. A block whose part is gone is outside every
    window the step reads (kv/window_parts.py): its own id stands in, a block
    the kernels skip."""
    if group == 0:
        return table.block_ids[:n]
    j = group - 1
    return [b.block_id if b.wpart is None else b.wpart[j].block_id for b in table.blocks[:n]]
