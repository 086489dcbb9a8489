"""The Triton kernels of a CUDA step (runner/triton_kernels.py through
runner/triton_ops.py) against torch's expressions: paged decode attention
against SDPA over the gathered context (float64 reference), the KV write, and
the small per-layer ops against the torch code they replace in the model. On a
GPU they run there; without one under Triton's CPU interpreter (conftest.py),
which computes 16-bit values in float32 and rounds them by truncation: there
the 16-bit cases are checked to four units in the last place, on a GPU (whose
rounding is torch's) to two."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from agentserve.runner import triton_ops  # noqa: E402
from agentserve.runner.model import gelu_tanh_mul, rms_norm, silu_mul  # noqa: E402
from agentserve.runner.rope import apply_rotary  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEV.type == "cpu" and not triton_ops.interpreted():
    pytest.skip("no GPU and Triton's interpreter not chosen (TRITON_INTERPRET=1)", allow_module_level=True)


def reference_decode(q, kc, vc, tables, lens, scale, window):
    """float64 attention of each row over its context as the block table lays it out."""
    B, H, D = q.shape
    KVH, _, BS, _ = kc.shape
    out = torch.zeros(B, H, D, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        if n == 0:
            continue
        blocks = tables[b, :-(-n // BS)].long().cpu()
        k = kc.cpu()[:, blocks].reshape(KVH, -1, D)[:, :n].double()
        v = vc.cpu()[:, blocks].reshape(KVH, -1, D)[:, :n].double()
        lo = max(0, n - window) if window else 0
        qb = q[b].cpu().double().view(KVH, H // KVH, D)
        w = torch.softmax(qb @ k[:, lo:].transpose(1, 2) * scale, dim=-1)
        out[b] = (w @ v[:, lo:]).reshape(H, D)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block", [(4, 2, 16, 16), (5, 1, 80, 8), (3, 3, 32, 4)])
def test_paged_decode_matches_attention_over_the_gathered_context(dtype, heads, kv_heads, head_dim, block):
    g = torch.Generator().manual_seed(heads * 100 + head_dim)
    nb = 48
    kc = torch.randn(kv_heads, nb, block, head_dim, generator=g).to(dtype).to(DEV)
    vc = torch.randn(kv_heads, nb, block, head_dim, generator=g).to(dtype).to(DEV)
    # one token, a block less one, a block, a block and one, many blocks; a padding row (length 0)
    lens = torch.tensor([1, block - 1 or 1, block, block + 1, 37 * block // 2, 0], dtype=torch.int32)
    tables = torch.stack([torch.randperm(nb, generator=g)[:40] for _ in lens]).int()
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    tol = 2e-5 if dtype is torch.float32 else 2e-2
    for window in (None, 1, block - 1 or 1, block, block + 1, 3 * block):
        want = reference_decode(q, kc, vc, tables, lens, 0.3, window)
        for splits in (1, 2, 3, 8):
            got = triton_ops.paged_decode(q.to(DEV), kc, vc, tables.to(DEV), lens.to(DEV), 0.3, window, splits)
            err = (got.cpu().double() - want).abs().max().item()
            assert err < tol, (window, splits, err)


def test_paged_decode_reads_a_strided_query_and_a_float32_query_over_a_bfloat16_cache():
    g = torch.Generator().manual_seed(3)
    kc = torch.randn(2, 8, 16, 16, generator=g).bfloat16().to(DEV)
    vc = torch.randn(2, 8, 16, 16, generator=g).bfloat16().to(DEV)
    tables = torch.tensor([[3, 1, 4], [5, 0, 2]], dtype=torch.int32)
    lens = torch.tensor([40, 17], dtype=torch.int32)
    qkv = torch.randn(2, 8, 16, generator=g)  # q is the first 4 heads of a wider row, as the model slices it
    q = qkv[:, :4]
    got = triton_ops.paged_decode(q.to(DEV), kc, vc, tables.to(DEV), lens.to(DEV), 0.25, None, 2)
    want = reference_decode(q, kc, vc, tables, lens, 0.25, None)
    assert got.dtype is torch.float32
    assert (got.cpu().double() - want).abs().max().item() < 1e-4


def test_decode_splits_depend_on_the_batch_rounded_up():
    dev = torch.device("cpu")
    assert triton_ops.decode_splits(3, 2, dev) == triton_ops.decode_splits(4, 2, dev)
    assert triton_ops.decode_splits(1, 1, dev) >= triton_ops.decode_splits(64, 8, dev) == 1
    assert all(1 <= triton_ops.decode_splits(b, 8, dev) <= triton_ops.MAX_SPLITS for b in range(1, 300))


def _close(got: torch.Tensor, want: torch.Tensor, exact_f32: bool = False) -> None:
    """Within a few units in the last place of the values' scale (at least 1:
    after a cancellation the result is far smaller than what was rounded)."""
    got = got.cpu()
    if got.dtype is torch.float32 and exact_f32:
        assert torch.equal(got, want)
        return
    # float32: sums in another order, tanh from exp; 16-bit: two places (Gemma's normed sublayer output
    # rounds before the residual add, so a sum in another order can move both roundings), and more under
    # the interpreter, which truncates
    places = 64 if got.dtype is torch.float32 else 4 if triton_ops.interpreted() else 2
    scale = torch.maximum(want.float().abs(), torch.ones(()))
    err = ((got.float() - want.float()).abs() / scale).max().item()
    assert err <= places * torch.finfo(got.dtype).eps, err


def _slots_written(kc, vc, k, v, slots, bs):
    kw, vw = torch.zeros_like(kc), torch.zeros_like(vc)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            kw[:, s // bs, s % bs] = k[t]
            vw[:, s // bs, s % bs] = v[t]
    return kw, vw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_puts_rows_at_their_slots_and_skips_negative_ones(dtype):
    g = torch.Generator().manual_seed(1)
    kc = torch.zeros(2, 6, 8, 16, dtype=dtype)
    vc = torch.zeros_like(kc)
    k = torch.randn(5, 2, 16, generator=g).to(dtype)
    v = torch.randn(5, 4, 16, generator=g).to(dtype)[:, 1:3]  # a strided view, as the model's v is
    slots = torch.tensor([9, 0, -1, 47, 20])
    dk, dv = kc.to(DEV), vc.to(DEV)
    triton_ops.write_kv(k.to(DEV), v.to(DEV), dk, dv, slots.to(DEV))
    kw, vw = _slots_written(kc, vc, k, v, slots, 8)
    assert torch.equal(dk.cpu(), kw) and torch.equal(dv.cpu(), vw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("delta,gemma", [(False, False), (True, False), (True, True)])
def test_add_rms_norm_matches_the_models_expression(dtype, delta, gemma):
    g = torch.Generator().manual_seed(2)
    h = torch.randn(5, 96, generator=g).to(dtype)
    d = torch.randn(5, 96, generator=g).to(dtype) if delta else None
    w = (torch.rand(96, generator=g) + 0.5).to(dtype)
    dw = torch.rand(96, generator=g).to(dtype) if gemma else None
    want_h = h if d is None else h + (d if dw is None else rms_norm(d, dw, 1e-6))
    want = rms_norm(want_h, w, 1e-6)
    got_h, out = h.clone().to(DEV), torch.empty_like(h, device=DEV)
    triton_ops.TritonLayerOps().add_rms_norm(got_h, None if d is None else d.to(DEV), w.to(DEV), 1e-6, out,
                                             None if dw is None else dw.to(DEV))
    _close(got_h, want_h, exact_f32=not gemma)
    _close(out, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_activations_match_torch(dtype):
    g = torch.Generator().manual_seed(4)
    gu = (torch.randn(3, 2 * 1500, generator=g) * 4).to(dtype)  # more than one program's block per row
    ops = triton_ops.TritonLayerOps()
    _close(ops.silu_mul(gu.to(DEV)), silu_mul(gu))
    _close(ops.gelu_tanh_mul(gu.to(DEV)), gelu_tanh_mul(gu))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_kv_matches_norm_rotary_and_the_cache_write(dtype, qk_norm):
    g = torch.Generator().manual_seed(5)
    H, KVH, D, BS, T = 4, 2, 32, 8, 5
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g).to(dtype)
    pos = torch.tensor([0, 3, 7, 8, 20])
    slots = torch.tensor([5, 17, -1, 33, 70])
    cos = torch.randn(64, D, generator=g).to(dtype)
    sin = torch.randn(64, D, generator=g).to(dtype)
    norm = (torch.rand(H + KVH, D, generator=g) + 0.5).to(dtype) if qk_norm else None
    kc = torch.zeros(KVH, 10, BS, D, dtype=dtype)
    vc = torch.zeros_like(kc)
    dk, dv = kc.to(DEV), vc.to(DEV)
    q = triton_ops.TritonLayerOps().rope_kv(qkv.to(DEV), H, KVH, D, cos.to(DEV), sin.to(DEV), pos.to(DEV), dk, dv,
                                            slots.to(DEV), None if norm is None else norm.to(DEV), 1e-6)
    qk = qkv[:, :(H + KVH) * D].view(T, H + KVH, D)
    if norm is not None:
        qk = rms_norm(qk, norm, 1e-6)
    qk = apply_rotary(qk, cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
    v = qkv[:, (H + KVH) * D:].view(T, KVH, D)
    kw, vw = _slots_written(kc, vc, qk[:, H:], v, slots, BS)
    _close(q, qk[:, :H])
    _close(dk, kw)
    assert torch.equal(dv.cpu(), vw)  # v is copied as it is


def test_ops_leave_empty_steps_alone():
    ops = triton_ops.TritonLayerOps()
    empty = torch.empty(0, 64, dtype=torch.bfloat16, device=DEV)
    assert ops.add_rms_norm(empty, None, torch.ones(64, dtype=torch.bfloat16, device=DEV), 1e-6,
                            torch.empty_like(empty)).shape == (0, 64)
    assert ops.silu_mul(torch.empty(0, 8, dtype=torch.bfloat16, device=DEV)).shape == (0, 4)
