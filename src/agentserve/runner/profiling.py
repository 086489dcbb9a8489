"""Measuring this machine with the real model: prefill time against context
length (fitted to the paper's t(L) = a*L^2 + b*L + c), decode step time
against batch size and context, and host copy bandwidth. The result is a
profile in the simulator's format, so the simulator and the TTL cost model
read the same numbers; `tier_costs_for` turns it into the Prefill-Reload(r)
the policies price a pin with.

Timing runs the model directly on scratch KV blocks (no scheduler), each point
a median of repeats after a warm-up, so it measures the kernels and the
Python dispatch, not queueing."""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from agentserve.cost.cost_model import CostModel
from agentserve.cost.profile import ModelSpec, Profile, load_profile
from agentserve.engine.attention_shape import AttentionShape
from agentserve.runner.attention import build_metadata
from agentserve.runner.device import dtype_name
from agentserve.runner.kv_cache import read_host, write_host
from agentserve.runner.random_model import PREFIX as RANDOM_PREFIX
from agentserve.runner.random_model import is_random_spec
from agentserve.runner.tier_speed import disk_bandwidth

if TYPE_CHECKING:
    from agentserve.engine.scheduler import Scheduler
    from agentserve.runner.config import ModelConfig
    from agentserve.runner.kv_cache import PagedKVCache
    from agentserve.runner.model import LlamaModel

log = logging.getLogger("agentserve")


class ModelHost(Protocol):
    """What profiling reads of a built model: `agentserve.llm.LLM` is one. Declared
    here so the runner does not import the offline API built on top of it."""

    model: LlamaModel
    kv_cache: PagedKVCache
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    model_source: str  # the file or folder the model came from
    scheduler: Scheduler  # its config: the batch limits a profile records


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], object], device: torch.device, repeats: int = 3, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class ModelTimer:
    """Runs bare forward passes of an LLM's model on its own KV tensors. The
    blocks it writes are scratch: use it on an LLM that serves nothing else."""

    def __init__(self, llm: ModelHost) -> None:
        self.llm = llm
        self.model = llm.model
        self.kv = llm.kv_cache
        self.bs = llm.kv_cache.block_size
        self.device = llm.device
        self.vocab = llm.config.vocab_size

    def _blocks(self, first: int, tokens: int) -> list[int]:
        n = -(-tokens // self.bs)
        if first + n > self.kv.num_blocks:
            raise ValueError(f"the KV cache has {self.kv.num_blocks} blocks; {first + n} needed for this measurement")
        return list(range(first, first + n))

    def prefill(self, length: int) -> Callable[[], object]:
        """One forward over a `length`-token prompt; logits for the last row only."""
        g = torch.Generator().manual_seed(length)
        ids = torch.randint(0, self.vocab, (length,), generator=g).to(self.device)
        pos = torch.arange(length, device=self.device)
        meta = build_metadata([], [], [(self._blocks(0, length), 0, length)], self.bs, self.device,
                              dtype=self.model.dtype)
        rows = torch.tensor([length - 1], device=self.device)
        return lambda: self.model.forward(ids, pos, meta, self.kv, rows)

    def decode(self, batch: int, context: int) -> Callable[[], object]:
        """One decode step of `batch` sequences each with `context` tokens of KV."""
        per = -(-(context + 1) // self.bs)
        tables = [self._blocks(i * per, context + 1) for i in range(batch)]
        meta = build_metadata(tables, [context + 1] * batch, [], self.bs, self.device)
        ids = torch.randint(0, self.vocab, (batch,)).to(self.device)
        pos = torch.full((batch,), context, device=self.device)
        rows = torch.arange(batch, device=self.device)
        return lambda: self.model.forward(ids, pos, meta, self.kv, rows)

    def _metadata(self, decode_tables: list[list[int]], decode_lens: list[int],
                  prefills: list[tuple[list[int], int, int]]):
        return build_metadata(decode_tables, decode_lens, prefills, self.bs, self.device, dtype=self.model.dtype)

    def chunked_prefill(self, length: int, chunk: int) -> Callable[[], object]:
        """A `length`-token prompt prefilled as the engine steps it with a
        `chunk`-token budget: one forward per chunk, each later chunk attending
        to the earlier ones through the paged cache; logits for the last row
        of the last chunk only (what the callable returns). Metadata is built
        beforehand, as in prefill."""
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        g = torch.Generator().manual_seed(length)
        ids = torch.randint(0, self.vocab, (length,), generator=g).to(self.device)
        steps = []
        for start in range(0, length, chunk):
            n = min(chunk, length - start)
            meta = self._metadata([], [], [(self._blocks(0, start + n), start, n)])
            pos = torch.arange(start, start + n, device=self.device)
            rows = torch.tensor([n - 1] if start + n == length else [], dtype=torch.int64, device=self.device)
            steps.append((ids[start:start + n], pos, meta, rows))

        def run() -> torch.Tensor:
            for step_ids, pos, meta, rows in steps:
                out = self.model.forward(step_ids, pos, meta, self.kv, rows)
            return out  # the last chunk's: the prompt's last row
        return run

    def mixed(self, decodes: int, context: int, chunk: int, prefix: int) -> Callable[[], object]:
        """One step of `decodes` decode rows, each the `context`-th token of its
        sequence (position context - 1), plus one `chunk`-token prefill chunk of
        another sequence after a `prefix`-token prefix already in the cache:
        the step the engine runs when a long prompt arrives while others decode.
        Logits for every decode row and the chunk's last row."""
        per = -(-context // self.bs)
        tables = [self._blocks(i * per, context) for i in range(decodes)]
        ptable = self._blocks(decodes * per, prefix + chunk)
        meta = self._metadata(tables, [context] * decodes, [(ptable, prefix, chunk)])
        ids = torch.randint(0, self.vocab, (decodes + chunk,)).to(self.device)
        pos = torch.cat([torch.full((decodes,), context - 1), torch.arange(prefix, prefix + chunk)]).to(self.device)
        rows = torch.tensor(list(range(decodes)) + [decodes + chunk - 1], dtype=torch.int64, device=self.device)
        return lambda: self.model.forward(ids, pos, meta, self.kv, rows)

    def copy_bandwidth(self, num_blocks: int) -> tuple[float, float]:
        """Seconds to offload and reload `num_blocks` blocks through a scratch host
        buffer, by the host tier's own copies (kv_cache.write_host / read_host);
        returns (bytes per second, seconds of a one-block copy)."""
        kv = self.kv
        num_blocks = min(num_blocks, kv.num_blocks)
        host = torch.empty((num_blocks, *kv.block_shape), dtype=kv.dtype, pin_memory=self.device.type == "cuda")
        idx = torch.arange(num_blocks, device=self.device)

        def roundtrip(n: int) -> Callable[[], object]:
            def run() -> None:
                write_host(host, kv.gather(list(range(n))), list(range(n)))
                kv.device_kv[:, :, :, idx[:n]] = read_host(host, list(range(n)), self.device)
            return run

        t_many = median_time(roundtrip(num_blocks), self.device)
        t_one = median_time(roundtrip(1), self.device)
        moved = 2 * host.numel() * host.element_size()
        bw = moved / max(t_many - t_one, 1e-9)
        return bw, t_one / 2


def fit_quadratic(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y = a*x^2 + b*x + c with a, b >= 0 (refit without a term that comes out negative)."""
    X = torch.tensor([[x * x, x, 1.0] for x in xs], dtype=torch.float64)
    Y = torch.tensor(ys, dtype=torch.float64)[:, None]
    a, b, c = torch.linalg.lstsq(X, Y).solution.squeeze(1).tolist()
    if a < 0:
        b, c = torch.linalg.lstsq(X[:, 1:], Y).solution.squeeze(1).tolist()
        a = 0.0
    return a, max(b, 1e-12), max(c, 0.0)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    X = torch.tensor([[x, 1.0] for x in xs], dtype=torch.float64)
    Y = torch.tensor(ys, dtype=torch.float64)[:, None]
    slope, icpt = torch.linalg.lstsq(X, Y).solution.squeeze(1).tolist()
    return slope, icpt


def measure_profile(llm: ModelHost, prefill_lengths: list[int], batch_sizes: list[int],
                    contexts: tuple[int, int] = (128, 1024), copy_blocks: int = 256,
                    progress: Callable[[str], None] = lambda s: None) -> tuple[Profile, dict]:
    timer = ModelTimer(llm)
    dev = llm.device
    raw: dict = {"prefill": {}, "decode": {}, "copy": {}}
    for n in prefill_lengths:
        t = median_time(timer.prefill(n), dev)
        raw["prefill"][n] = t
        progress(f"prefill {n:6d} tokens: {t * 1e3:8.1f} ms  ({n / t:8.0f} tok/s)")
    a, b, c = fit_quadratic(list(raw["prefill"]), list(raw["prefill"].values()))
    slopes = []
    for ctx in contexts:
        pts = {}
        for bsz in batch_sizes:
            t = median_time(timer.decode(bsz, ctx), dev, repeats=5)
            pts[bsz] = t
            progress(f"decode batch {bsz:3d} at context {ctx:5d}: {t * 1e3:8.1f} ms/step  ({bsz / t:8.0f} tok/s)")
        raw["decode"][ctx] = pts
        slopes.append(fit_line(list(pts), list(pts.values())))
    # t(B, ctx) = base + B * (per_seq + kv * ctx): two contexts separate the two slopes
    (s1, i1), (s2, i2) = slopes
    kv_per_token = max((s2 - s1) / (contexts[1] - contexts[0]), 0.0)
    per_seq = max(s1 - kv_per_token * contexts[0], 0.0)
    base = max((i1 + i2) / 2, 0.0)
    bw, latency = timer.copy_bandwidth(copy_blocks)
    raw["copy"] = {"bytes_per_s": bw, "latency_s": latency}
    progress(f"host copy: {bw / 1e9:.2f} GB/s, {latency * 1e6:.0f} us per copy")
    disk = {}
    if llm.kv_cache.disk is not None:
        write_bw, read_bw = disk_bandwidth(llm.kv_cache.disk, copy_blocks)
        raw["disk"] = {"write_bytes_per_s": write_bw, "read_bytes_per_s": read_bw}
        disk = {"disk_write_bandwidth_bytes_s": write_bw, "disk_read_bandwidth_bytes_s": read_bw}
        progress(f"disk tier ({llm.kv_cache.disk.dir}): write {write_bw / 1e9:.2f} GB/s, read {read_bw / 1e9:.2f} GB/s "
                 "(through its block files, checksums included)")
    cfg = llm.config
    elt = kv_element_size(llm)
    name = profile_name(llm)
    derivation = (
        f"Measured by `agentserve profile` on this machine ({os.cpu_count()} CPUs visible, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, device {dev}). Prefill: median of 3 forwards per "
        f"length {prefill_lengths}, least-squares fit t(L) = a*L^2 + b*L + c. Decode: median of 5 steps per batch size "
        f"{batch_sizes} at contexts {list(contexts)}, fitted per context as a line in the batch size; the two slopes "
        f"give the per-sequence and per-context-token costs, the mean intercept the weight-read term (step overhead "
        f"folded in). Host copy: offload+reload of {copy_blocks} blocks minus one block, both directions.")
    prof = Profile(
        name=name, description=f"{cfg.name} ({llm.model_source}) in {dtype_name(llm.dtype)} on {dev}",
        derivation=derivation,
        model=model_spec(cfg, elt),
        kv_bytes_per_token=cfg.kv_bytes_per_token(elt),
        kv_capacity_tokens=llm.kv_cache.num_blocks * llm.kv_cache.block_size,
        host_kv_capacity_tokens=0, host_copy_bandwidth_bytes_s=bw,
        max_num_batched_tokens=llm.scheduler.config.max_num_batched_tokens,
        max_num_seqs=llm.scheduler.config.max_num_seqs,
        step_overhead_s=c, prefill_a_s_per_token2=a, prefill_b_s_per_token=b,
        decode_weight_read_s=base, kv_read_s_per_token=kv_per_token, per_seq_overhead_s=per_seq,
        host_copy_latency_s=latency, gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "", **disk)
    return prof, raw


def model_spec(cfg, elt: int) -> ModelSpec:
    """The profile's model, with its layer kinds where some layers have a sliding window (so the
    simulator and the TTL model price those layers' attention and KV up to the window)."""
    windowed = sum(1 for i in range(cfg.num_layers) if cfg.is_sliding(i))
    return ModelSpec(cfg.name, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size,
                     float(cfg.num_params()), elt, num_global_layers=cfg.num_layers - windowed if windowed else None,
                     sliding_window=cfg.sliding_window if windowed else 0)


def profile_name(llm: ModelHost) -> str:
    """<model>-<device>-<dtype>: the model file's stem, or random-<shape> for a random-weight model."""
    source = llm.model_source
    stem = "random-" + source.removeprefix(RANDOM_PREFIX) if is_random_spec(source) else Path(source).stem
    return f"{stem}-{llm.device.type}-{dtype_name(llm.dtype)}"


def default_profile_path(llm: ModelHost) -> Path:
    base = Path(os.environ.get("AGENTSERVE_CACHE", Path.home() / ".cache" / "agentserve"))
    return base / "profiles" / f"{profile_name(llm)}.json"


def reload_cost_for(profile: str | None, llm: ModelHost, host_tier: bool) -> Callable[[int], float]:
    """Prefill-Reload(r) in seconds for r tokens (the paper's: the host tier's
    reload where there is one, else the prefill); see `tier_costs_for`."""
    prefill, reloads = tier_costs_for(profile, llm)
    return reloads["host"] if host_tier else prefill


# Rough copy rates where no profile says: a memcpy-bound host copy, a plain SSD read.
_EST_HOST_COPY_BYTES_S = {"cuda": 2e10, "cpu": 5e9}
_EST_DISK_READ_BYTES_S = 1e9


def tier_costs_for(profile: str | None, llm: ModelHost) -> tuple[Callable[[int], float], dict]:
    """(prefill seconds of r tokens, {"host": reload seconds, "disk": reload
    seconds}) from the given profile, else the one `agentserve profile` saved
    for this model, device and dtype, else rough estimates (logged, so the
    user knows to profile): a FLOP estimate for the prefill and nominal copy
    rates for the tiers."""
    path = Path(profile) if profile else default_profile_path(llm)
    if profile or path.exists():
        cost = CostModel(load_profile(path), llm.kv_cache.block_size)
        log.info("reload costs from profile %s", path)
        return cost.prefill_time, cost.tier_reloads()
    flops = 3e14 if llm.device.type == "cuda" else 2e11
    per_token = 2 * llm.config.num_params() / flops
    # attention: 4 FLOPs a query-key pair a head a dimension (scores and weighted values), each
    # layer's pairs counted within its window (engine/attention_shape.py): the re-prefill of a
    # long context costs what its attention reads, not tokens times a constant
    cfg = llm.config
    per_pair = 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers / flops
    shape = AttentionShape.of(llm.model.windows)
    kv_bytes = llm.config.kv_bytes_per_token(kv_element_size(llm))
    host_s = kv_bytes / _EST_HOST_COPY_BYTES_S.get(llm.device.type, 5e9)
    disk_s = kv_bytes / _EST_DISK_READ_BYTES_S + host_s
    log.info("no profile for this model and device (run `agentserve profile`); prefill cost estimated at "
             "%.2f ms per 1000 tokens, host and disk reloads at %.3f and %.3f ms", per_token * 1e6, host_s * 1e6,
             disk_s * 1e6)
    return (lambda n: per_token * n + per_pair * shape.pairs(0, n)), \
        {"host": lambda n: host_s * n, "disk": lambda n: disk_s * n}


def write_profile(prof: Profile, raw: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.dump(path)
    raw_path = path.with_suffix(".raw.json")
    raw_path.write_text(json.dumps(raw, indent=2) + "\n")


def read_bandwidth(device: torch.device, gib: float = 1.0) -> float:
    """Bytes per second streamed by a reduction over a `gib`-GiB float32 tensor (median of 5)."""
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32, device=device)
    t = median_time(lambda: x.sum(), device, repeats=5)
    return x.numel() * 4 / t


def kv_element_size(llm: ModelHost) -> int:
    """Bytes of one element of the KV cache (2 for bfloat16)."""
    return llm.kv_cache.device_kv.element_size()
