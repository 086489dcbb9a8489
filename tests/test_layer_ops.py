"""The native per-layer operations of a bfloat16 forward (csrc/layer_ops.c):
each one bit for bit against the torch expressions it replaces, the fused
forward against the torch forward of the same model, and the fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import hf_gemma3, hf_llama, hf_qwen3, loaded, loaded_as, teacher_forced_logits

from agentserve.llm import LLM
from agentserve.runner import native
from agentserve.runner.config import ModelConfig
from agentserve.runner.layer_ops import LayerOps
from agentserve.runner.model import gelu_tanh_mul, rms_norm
from agentserve.runner.rope import RotaryTable, apply_rotary

OPS = LayerOps.create(torch.bfloat16, torch.device("cpu"))
needs_ops = pytest.mark.skipif(OPS is None, reason=f"native kernels unavailable: {native.unavailable_reason()}")


@needs_ops
@pytest.mark.parametrize("rows", [1, 5, 200])
def test_add_rms_norm_equals_torch(rows):
    g = torch.Generator().manual_seed(rows)
    h = (torch.randn(rows, 576, generator=g) * 3).bfloat16()
    delta = torch.randn(rows, 576, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(576, generator=g)).bfloat16()
    want_h = h + delta
    out = torch.empty_like(h)
    OPS.add_rms_norm(h, delta, w, 1e-5, out)
    assert torch.equal(h, want_h)  # the residual stream, updated in place
    assert torch.equal(out, rms_norm(want_h, w, 1e-5))
    OPS.add_rms_norm(h, None, w, 1e-6, out)
    assert torch.equal(h, want_h) and torch.equal(out, rms_norm(want_h, w, 1e-6))


@needs_ops
def test_silu_mul_equals_torch():
    gu = (torch.randn(9, 2 * 1536, generator=torch.Generator().manual_seed(0)) * 4).bfloat16()
    gu[0, :4] = torch.tensor([0.0, -100.0, 100.0, float("inf")])
    g, u = gu.chunk(2, dim=-1)
    assert torch.equal(OPS.silu_mul(gu), F.silu(g) * u)


@needs_ops
def test_silu_mul_vector_and_tail_paths_agree_with_torch_over_the_range():
    # 37 columns: two 16-lane vectors and a scalar tail of 5; values from -86 to 120 (below -87
    # the kernel returns -0 where torch still has products under 1e-36: exp_neg's range ends there)
    x = torch.linspace(-86, 120, 3 * 37, dtype=torch.float32).view(3, 37)
    gu = torch.cat([x, torch.randn(3, 37, generator=torch.Generator().manual_seed(1))], dim=1).bfloat16()
    g, u = gu.chunk(2, dim=-1)
    assert torch.equal(OPS.silu_mul(gu), F.silu(g) * u)


def _bf16_values(lo: float, hi: float) -> torch.Tensor:
    """Every finite bfloat16 value x with lo <= |x| <= hi, both signs."""
    v = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    a = v.float().abs()
    return v[torch.isfinite(v.float()) & (a >= lo) & (a <= hi)]


@needs_ops
def test_gelu_tanh_mul_equals_torch_on_every_bfloat16_gate():
    # rows of 2048 gates (whole vectors, as torch's vectorized kernel takes them): exactly torch's
    # bfloat16 result, F.gelu(gate, approximate="tanh") rounded, times up rounded, for every finite
    # bfloat16 gate up to 1e4 in size (the negative tail, where 1 + tanh cancels, included)
    x = _bf16_values(0.0, 1e4)
    n = -(-x.numel() // 2048) * 2048
    gate = torch.cat([x, torch.zeros(n - x.numel(), dtype=torch.bfloat16)]).view(-1, 2048)
    up = (torch.randn(gate.shape, generator=torch.Generator().manual_seed(2)) * 3).bfloat16()
    gu = torch.cat([gate, up], dim=1)
    assert torch.equal(OPS.gelu_tanh_mul(gu), F.gelu(gate, approximate="tanh") * up)


@needs_ops
def test_gelu_tanh_mul_special_values_and_tail_columns():
    # 37 columns: four 8-lane vectors and a scalar tail of 5, each value in both places; torch's
    # own scalar tail rounds 1 + tanh differently from its vector body for gates near -5.1
    # (|result| < 2e-7), so there the product may differ by that much
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e30, -1e30, 3e-30]),
                   torch.linspace(-12, 12, 29)]).bfloat16()
    gate = torch.stack([x, x.roll(16), x.roll(33)])
    up = torch.randn(gate.shape, generator=g).bfloat16()
    out = OPS.gelu_tanh_mul(torch.cat([gate, up], dim=1))
    ref = F.gelu(gate, approximate="tanh") * up
    assert out.shape == (3, 37) and out.dtype is torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -8, atol=4e-7, equal_nan=True)
    assert torch.isnan(out[0, 3]) and out[0, 2] == float("inf") * up[0, 2]
    assert (out == ref).float().mean() > 0.9


@needs_ops
@pytest.mark.parametrize("rows,inter", [(1, 640), (3, 2047), (300, 1152)])
def test_gelu_tanh_mul_random_shapes_near_torch(rows, inter):
    # Gemma 3's shapes (intermediate 2048 at 270M, 1152-wide models), one row (decode) to many
    # (threaded): equal to torch's bfloat16 result but for the last-place tails above
    g = torch.Generator().manual_seed(rows)
    gu = (torch.randn(rows, 2 * inter, generator=g) * 2.5).bfloat16()
    gate, up = gu.chunk(2, dim=-1)
    out = OPS.gelu_tanh_mul(gu)
    ref = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -8, atol=4e-7)
    assert (out != ref).sum() <= rows * (inter % 32)  # only in torch's scalar tail, if anywhere


@needs_ops
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_rope_kv_equals_rotary_and_cache_write(heads, kv_heads, head_dim):
    cfg = ModelConfig(vocab_size=16, hidden_size=heads * head_dim, intermediate_size=32, num_layers=1,
                      num_heads=heads, num_kv_heads=kv_heads, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=4096)
    rope = RotaryTable(cfg, 4096, torch.bfloat16, torch.device("cpu"))
    g = torch.Generator().manual_seed(heads)
    T = 11
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g).bfloat16()
    pos = torch.randint(0, 4096, (T,), generator=g)
    k_cache = torch.zeros(kv_heads, 8, 16, head_dim, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(128, generator=g)[:T]
    q = OPS.rope_kv(qkv, heads, kv_heads, head_dim, rope.cos, rope.sin, pos, k_cache, v_cache, slots)
    cos, sin = rope.lookup(pos)
    qk = apply_rotary(qkv[:, :(heads + kv_heads) * head_dim].view(T, heads + kv_heads, head_dim), cos, sin)
    assert torch.equal(q, qk[:, :heads])
    flat = lambda c: c.view(kv_heads, -1, head_dim)[:, slots].transpose(0, 1)  # noqa: E731
    assert torch.equal(flat(k_cache), qk[:, heads:])
    assert torch.equal(flat(v_cache), qkv[:, (heads + kv_heads) * head_dim:].view(T, kv_heads, head_dim))
    untouched = torch.ones(kv_heads * 128, dtype=torch.bool)
    for h in range(kv_heads):
        untouched[h * 128 + slots] = False
    assert not k_cache.view(-1, head_dim)[untouched].any()


@needs_ops
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3"])
def test_fused_forward_agrees_with_torch_forward(arch):
    """Exact through the first layers (the ops are exact; only the RMS sums are
    added in another order), and the same greedy choices at the end; Gemma 3
    and Qwen3 with their q/k norms (and Gemma's norms on the sublayer outputs)
    in the native calls."""
    hf = {"llama": lambda: hf_llama(layers=4), "gemma3": lambda: hf_gemma3(window=32),
          "qwen3": lambda: hf_qwen3(layers=3)}[arch]()
    llm = LLM(loaded_as(hf, arch) if arch != "llama" else loaded(hf), dtype="bfloat16", device="cpu",
              kv_cache_tokens=512, max_model_len=512)
    model = llm.model
    assert model.ops is not None
    ids = torch.randint(0, 300, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    for rows in (1, 7, 120):
        fused = teacher_forced_logits(llm, ids, rows)
        model.ops = None
        try:
            ref = teacher_forced_logits(llm, ids, rows)
        finally:
            model.ops = OPS
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.5
        assert clear.sum() > 60
        assert torch.equal(fused.argmax(-1)[clear], ref.argmax(-1)[clear]), rows
        assert ((fused - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()) < 0.02


@needs_ops
def test_position_beyond_the_rotary_table_is_refused():
    llm = LLM(loaded(hf_llama(layers=1)), dtype="bfloat16", device="cpu", kv_cache_tokens=64, max_model_len=64)
    m = llm.model
    from agentserve.runner.attention import build_metadata

    meta = build_metadata([[0]], [1], [], 16, torch.device("cpu"), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rotary table"):
        m.forward(torch.tensor([3]), torch.tensor([m.rope.max_positions]), meta, llm.kv_cache, torch.tensor([0]))


def test_float32_and_the_env_switch_keep_torch(monkeypatch):
    assert LayerOps.create(torch.float32, torch.device("cpu")) is None
    monkeypatch.setenv("AGENTSERVE_LAYER_OPS", "torch")
    assert LayerOps.create(torch.bfloat16, torch.device("cpu")) is None
    llm = LLM(loaded(hf_llama(layers=1)), dtype="bfloat16", device="cpu", kv_cache_tokens=64, max_model_len=64)
    assert llm.model.ops is None
    assert llm.generate([[1, 2, 3]])[0].token_ids  # the torch path still serves


F32 = LayerOps.create(torch.float32, torch.device("cpu"), quantized=True)


@needs_ops
def test_float32_ops_only_for_gguf_kept_weights():
    """float32 on dense weights is the path exact against transformers: torch's kernels."""
    assert F32 is not None and F32.f32
    assert LayerOps.create(torch.float32, torch.device("cpu")) is None


@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemma_norm_add_norm_in_one_call(dtype):
    """h += RMSNorm(delta) * wd, out = RMSNorm(h) * w: Gemma's norm on a sublayer's
    output, the residual add and the next norm; bfloat16 rounds as torch does."""
    ops = OPS if dtype is torch.bfloat16 else F32
    g = torch.Generator().manual_seed(3)
    h = (torch.randn(6, 640, generator=g) * 3).to(dtype)
    delta = (torch.randn(6, 640, generator=g) * 50).to(dtype)
    wd, w = ((1 + 0.1 * torch.randn(2, 640, generator=g)).to(dtype))
    want_h = h + rms_norm(delta, wd, 1e-6)
    want = rms_norm(want_h, w, 1e-6)
    out = torch.empty_like(h)
    ops.add_rms_norm(h, delta, w, 1e-6, out, wd)
    if dtype is torch.bfloat16:
        assert torch.equal(h, want_h) and torch.equal(out, want)
    else:
        torch.testing.assert_close(h, want_h, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    ops.add_rms_norm(h, None, w, 1e-6, out)
    torch.testing.assert_close(out, rms_norm(h, w, 1e-6), rtol=1e-6 if dtype is torch.float32 else 0, atol=1e-6)


@needs_ops
@pytest.mark.parametrize("dtype,cache", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                         (torch.float32, torch.float32)])
def test_rope_kv_with_qk_norm_equals_norm_then_rotary(dtype, cache):
    heads, kv_heads, head_dim, T = 4, 1, 256, 5
    cfg = ModelConfig(vocab_size=16, hidden_size=640, intermediate_size=32, num_layers=1, num_heads=heads,
                      num_kv_heads=kv_heads, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=1024,
                      head_dim=head_dim)
    rope = RotaryTable(cfg, 1024, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    qkv = (torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g) * 4).to(dtype)
    qk_norm = (1 + 0.2 * torch.randn(heads + kv_heads, head_dim, generator=g)).to(dtype)
    pos = torch.randint(0, 1024, (T,), generator=g)
    k_cache = torch.zeros(kv_heads, 4, 16, head_dim, dtype=cache)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(64, generator=g)[:T]
    ops = OPS if dtype is torch.bfloat16 else F32
    q = ops.rope_kv(qkv, heads, kv_heads, head_dim, rope.cos, rope.sin, pos, k_cache, v_cache, slots, qk_norm, 1e-6)
    assert q.dtype is cache
    cos, sin = rope.lookup(pos)
    qk = rms_norm(qkv[:, :(heads + kv_heads) * head_dim].view(T, heads + kv_heads, head_dim), qk_norm, 1e-6)
    qk = apply_rotary(qk, cos, sin).to(cache)
    flat = lambda c: c.view(kv_heads, -1, head_dim)[:, slots].transpose(0, 1)  # noqa: E731
    v = qkv[:, (heads + kv_heads) * head_dim:].view(T, kv_heads, head_dim).to(cache)
    assert torch.equal(flat(v_cache), v)
    if dtype is torch.bfloat16:
        assert torch.equal(q, qk[:, :heads]) and torch.equal(flat(k_cache), qk[:, heads:])
    else:  # the RMS sums in another order: at most a rounding apart
        tol = dict(rtol=1e-5, atol=1e-5) if cache is torch.float32 else dict(rtol=2 ** -7, atol=1e-6)  # one bfloat16 step
        torch.testing.assert_close(q, qk[:, :heads], **tol)
        torch.testing.assert_close(flat(k_cache), qk[:, heads:], **tol)


@needs_ops
def test_gelu_tanh_mul_float32_near_torch():
    g = torch.Generator().manual_seed(7)
    gu = torch.randn(3, 2 * 2051, generator=g) * 4
    gu[0, :8] = torch.tensor([0.0, -0.0, 1e-4, -1e-4, 20.0, -20.0, 9.0, -9.0])
    ref = gelu_tanh_mul(gu)
    torch.testing.assert_close(F32.gelu_tanh_mul(gu), ref, rtol=1e-5, atol=1e-6)  # where 1 + tanh cancels


@needs_ops
def test_float32_gguf_decode_takes_the_native_ops_and_stays_near_torch():
    """A float32 model on GGUF-kept weights: decode-sized steps take the native ops
    (the greedy choices of torch's ops on clear positions, and logits that differ
    from torch's ops' far less than either differs from the dequantized model:
    the two orders of float32 roundings meet activation codes that a last-bit
    difference can move by a step), prefill-sized ones multiply the dense copies
    on torch's ops, equal to the dequantized model."""
    from test_runner_kquant import tiny_kquant_model

    opts = dict(dtype="float32", device="cpu", kv_cache_tokens=256, max_model_len=256, block_size=16)
    llm = LLM(tiny_kquant_model(), weights="native", **opts)
    model = llm.model
    assert model.ops is not None and model.ops.f32 and model.codes_rows >= 1
    ids = torch.randint(0, 300, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    ops = model.ops
    got = {rows: teacher_forced_logits(llm, ids, rows) for rows in (1, 48)}
    model.ops = None
    try:
        ref = {rows: teacher_forced_logits(llm, ids, rows) for rows in (1, 48)}
    finally:
        model.ops = ops
    assert torch.equal(got[48], ref[48])
    top2 = ref[1].topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1
    assert clear.sum() > 20
    assert torch.equal(got[1].argmax(-1)[clear], ref[1].argmax(-1)[clear])
    exact = teacher_forced_logits(LLM(tiny_kquant_model(), weights="fp32", **opts), ids, 48)
    dist = lambda a, b: ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()  # noqa: E731
    assert dist(got[1], ref[1]) < 0.25 * dist(ref[1], exact)
