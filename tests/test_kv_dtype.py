"""A bfloat16 KV cache under float32 compute (`--kv-dtype`): the choice, the
bytes, and that every attention path reads the cache it wrote.

With native weights on a CPU without native bf16 the model computes in float32
and `auto` keeps the KV in bfloat16 (half the bytes, as llama.cpp keeps f16);
K and V are rounded once, as they are written, and every path (the native
kernel's decode and short chunks, the matrix kernels' long chunks, torch's
path) reads those rounded values; the native kernel also takes q in the
cache's dtype (as llama.cpp converts Q to its cache's type), so feeding a
prompt in chunks of any size stays within that rounding of float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import hf_gemma3, hf_llama, loaded, teacher_forced_logits

from agentserve.engine.sampling_params import SamplingParams
from agentserve.llm import LLM
from agentserve.runner import attention
from agentserve.runner import device as devices


CPU = torch.device("cpu")
OPTS = dict(device="cpu", kv_cache_tokens=512, max_model_len=512, block_size=16)


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def test_resolve_kv_dtype_rules():
    f32, bf16 = torch.float32, torch.bfloat16
    assert devices.resolve_kv_dtype("auto", f32, native=True) is bf16
    assert devices.resolve_kv_dtype("auto", f32, native=False) is f32  # the exact path stays exact
    assert devices.resolve_kv_dtype("auto", bf16, native=True) is bf16
    assert devices.resolve_kv_dtype("bfloat16", f32, native=False) is bf16
    assert devices.resolve_kv_dtype("float32", f32, native=True) is f32
    with pytest.raises(ValueError, match="float32 KV cache needs float32 compute"):
        devices.resolve_kv_dtype("float32", bf16, native=False)
    with pytest.raises(ValueError, match="not one of"):
        devices.resolve_kv_dtype("float16", f32, native=False)


def test_a_bfloat16_cache_takes_half_the_bytes():
    model = loaded(hf_llama())
    full = LLM(model, dtype="float32", **OPTS)
    half = LLM(model, dtype="float32", kv_dtype="bfloat16", **OPTS)
    assert full.kv_cache.device_kv.dtype is torch.float32 and half.kv_cache.device_kv.dtype is torch.bfloat16
    assert half.kv_cache.bytes * 2 == full.kv_cache.bytes
    assert half.kv.num_blocks == full.kv.num_blocks  # the same tokens


@pytest.mark.parametrize("kernel", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_every_chunk_size_reads_the_rounded_cache(arch, kernel, monkeypatch):
    if not kernel:
        monkeypatch.setattr(attention, "use_native", lambda device, dtype: False)
    model = loaded(hf_llama() if arch == "llama" else hf_gemma3(window=8))
    exact = LLM(model, dtype="float32", **OPTS)
    half = LLM(model, dtype="float32", kv_dtype="bfloat16", **OPTS)
    ids = [int(i) for i in np.random.default_rng(3).integers(3, 250, 150)]
    ref = teacher_forced_logits(exact, ids, len(ids))
    # 150 rows at once (the matrix kernels), 20-row chunks after a prefix, one token a step (decode rows)
    got = {c: teacher_forced_logits(half, ids, c) for c in (len(ids), 20, 1)}
    for c, x in got.items():
        assert rel(x, ref) < 2e-2, c  # bf16 rounding of K and V (and q on the kernel), nothing worse
    clear = ref.topk(2, -1).values
    clear = (clear[:, 0] - clear[:, 1]) > 0.1 * ref.std(-1)
    for x in got.values():
        assert torch.equal(x.argmax(-1)[clear], ref.argmax(-1)[clear])


def test_engine_runs_programs_on_a_bfloat16_cache():
    """A second turn served from the cache answers as a fresh server does."""
    model = loaded(hf_llama())
    llm = LLM(model, dtype="float32", kv_dtype="bfloat16", **OPTS)
    ids = [int(i) for i in np.random.default_rng(5).integers(3, 250, 90)]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    first = llm.generate([ids], params)[0]
    turn2 = ids + first.token_ids + ids[:20]
    again = llm.generate([turn2], params)[0]
    assert again.num_cached_tokens >= 96  # the prefix came from the bf16 cache
    fresh = LLM(model, dtype="float32", kv_dtype="bfloat16", **OPTS).generate([turn2], params)[0]
    assert fresh.num_cached_tokens == 0 and again.token_ids == fresh.token_ids
    llm.kv.check_integrity()  # raises on a leak
