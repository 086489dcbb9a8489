"""CUDA graphs for decode steps: the whole forward pass of a decode-only step
captured once per batch size of a ladder (1, 2, 4, ... up to the server's
running limit, at most 256), then replayed, so that a step costs the GPU's
work and not a few hundred kernel launches from Python.

A graph reads static buffers: token ids, positions, cache slots, block tables
and context lengths. A step of B rows copies its inputs into the first B rows
of the smallest graph of at least B rows; the rows after them are padding: slot
-1 (no KV is written) and length 0 (attention reads nothing). Steps with
prefill chunks or speculative drafts, batches above the ladder, contexts past
the buffers and the hybrid KV layout (a block table per layer group) run
eagerly. Graphs need the Triton decode kernel (runner/triton_ops.py): the
portable path's gather has a shape per step."""

from __future__ import annotations

import logging
import time

import torch

from agentserve.runner.attention_metadata import AttentionMetadata, GpuDecode
from agentserve.runner.triton_ops import unavailable

log = logging.getLogger("agentserve")

LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def ladder_for(max_batch: int) -> list[int]:
    """The batch sizes to capture for at most `max_batch` running requests."""
    cap = min(max_batch, LADDER[-1])
    return sorted({b for b in LADDER if b < cap} | {cap}) if cap >= 1 else []


class DecodeGraphs:
    def __init__(self, model, kv, sizes: list[int], max_positions: int) -> None:
        dev = model.device
        self.model, self.kv = model, kv
        self.max_blocks = -(-max_positions // kv.block_size)
        top = max(sizes)
        self.ids = torch.zeros(top, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(top, dtype=torch.int64, device=dev)
        self.slots = torch.full((top,), -1, dtype=torch.int64, device=dev)
        self.tables = torch.zeros((top, self.max_blocks), dtype=torch.int32, device=dev)
        self.lens = torch.zeros(top, dtype=torch.int32, device=dev)
        self.rows = torch.arange(top, dtype=torch.int64, device=dev)
        self.max_positions = max_positions
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.sizes: list[int] = []
        self.replays = 0  # steps served by a graph (the rest ran eagerly)

    @classmethod
    def capture_for(cls, model, kv, max_batch: int, max_positions: int) -> "DecodeGraphs | None":
        """Capture the ladder for `max_batch` on `model`'s device; None (with
        one log line saying why) where graphs do not apply."""
        why = unavailable(model.device) if model.device.type == "cuda" else "not a CUDA device"
        if why is None and kv.layout is not None:
            why = "the hybrid KV layout reads a block table per layer group"
        sizes = ladder_for(max_batch)
        if why is None and not sizes:
            why = "no batch size to capture"
        if why is not None:
            log.warning("CUDA graphs off, decode steps run eagerly: %s", why)
            return None
        graphs = cls(model, kv, sizes, max_positions)
        graphs.capture(sizes)
        return graphs if graphs.graphs else None

    def _meta(self, b: int) -> AttentionMetadata:
        meta = AttentionMetadata(self.slots[:b], gpu=GpuDecode(b, self.tables[:b], self.lens[:b]))
        meta.max_context = self.max_positions + 1  # every sliding window applies (as it would to a long row)
        return meta

    @torch.inference_mode()
    def capture(self, sizes: list[int]) -> None:
        dev = self.model.device
        free = torch.cuda.mem_get_info(dev)[0]
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        skipped = []
        for b in sorted(sizes, reverse=True):  # the largest first: the smaller ones fit in its pool
            meta = self._meta(b)
            args = (self.ids[:b], self.pos[:b], meta, self.kv, self.rows[:b])
            try:
                side = torch.cuda.Stream(dev)  # warm-up (Triton compiles, cuBLAS picks) off the capture
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    self.model.forward_eager(*args)
                torch.cuda.current_stream(dev).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model.forward_eager(*args)
            except torch.cuda.OutOfMemoryError:
                skipped.append(b)
                torch.cuda.empty_cache()
                continue
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize(dev)
        self.sizes = sorted(self.graphs)
        used = free - torch.cuda.mem_get_info(dev)[0]
        if skipped:
            log.warning("CUDA graphs: out of memory capturing batch %s: those batches run on the next larger "
                        "graph or eagerly", ", ".join(map(str, sorted(skipped))))
        if self.sizes:
            log.info("CUDA graphs: decode steps of batch %s captured in %.1f s, %.0f MiB of GPU memory",
                     ",".join(map(str, self.sizes)), time.perf_counter() - t0, used / 2**20)

    def bucket(self, batch: int) -> int | None:
        """The smallest captured batch size holding `batch` rows."""
        return next((b for b in self.sizes if b >= batch), None)

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               logit_rows: torch.Tensor) -> torch.Tensor | None:
        """The decode step on its graph: float32 logits [len(logit_rows), vocab],
        or None where no graph applies (the caller runs it eagerly)."""
        gpu = meta.gpu
        n, nb = gpu.num_rows, gpu.tables.shape[1]
        b = self.bucket(n)
        if b is None or nb > self.max_blocks or input_ids.shape[0] != n:
            return None
        self.ids[:n].copy_(input_ids)
        self.pos[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.lens[:n].copy_(gpu.lens)
        self.tables[:n, :nb].copy_(gpu.tables)
        if b > n:  # padding rows: no KV written, nothing read
            self.slots[n:b].fill_(-1)
            self.lens[n:b].zero_()
        graph, out = self.graphs[b]
        graph.replay()
        self.replays += 1
        return out[logit_rows]  # a copy: the next replay overwrites `out`
