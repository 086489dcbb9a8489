"""Sliding-window paged attention against a float64 reference whose mask is
transformers' own (masking_utils.sdpa_mask with sliding_window_causal_mask_function,
as Mistral and Gemma 3 build it): decode rows, fresh chunks and chunks after a
prefix at contexts of 1, W-1, W, W+1 and many windows, mixed steps, GQA groups,
block sizes that do and do not divide W, Gemma 3 270M's head shape, both paths
(torch; native where it builds), float32 and bfloat16. The blocks before a
row's window are filled with NaN, so a path that read them would fail. Also:
window None is today's attention, bit for bit."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import masking_utils as hf_masks

from agentserve.runner import attention as A
from agentserve.runner import native

HAVE_KERNEL = native.paged_attention_kernel() is not None
PATHS = ["torch", pytest.param("native", marks=pytest.mark.skipif(
    not HAVE_KERNEL, reason=f"native kernel unavailable: {native.unavailable_reason()}"))]
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}  # bfloat16: the output's own rounding, values O(1)
CPU = torch.device("cpu")


def hf_mask(start: int, n: int, window: int) -> torch.Tensor:
    """[n, start + n] bool: which keys the rows at positions start..start+n-1 see, per transformers."""
    m = hf_masks.sdpa_mask(batch_size=1, q_length=n, kv_length=start + n, q_offset=start, kv_offset=0,
                           mask_function=hf_masks.sliding_window_causal_mask_function(window),
                           allow_is_causal_skip=False, local_size=window)
    return m[0, 0]


def run_step(dtype, decode_lens, prefills, window, path, bs=16, kvh=2, group=2, d=64, seed=0, poison=True,
             meta_hook=None):
    """One step on random caches: (output [T, H, d] as float, float64 reference).
    With `poison` every block wholly before a row's window holds NaN."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = sum(-(-n // bs) for n in decode_lens) + sum(-(-(s + n) // bs) for s, n in prefills)
    nb = need + 3
    kc = torch.randn(kvh, nb, bs, d, generator=g).to(dtype)
    vc = torch.randn(kvh, nb, bs, d, generator=g).to(dtype)
    free = list(range(1, nb))
    rng.shuffle(free)
    dec_tables = [[free.pop() for _ in range(-(-n // bs))] for n in decode_lens]
    pf = [([free.pop() for _ in range(-(-(s + n) // bs))], s, n) for s, n in prefills]
    rows = [(t, n - 1, 1) for t, n in zip(dec_tables, decode_lens)] + pf  # (table, start, rows)
    if poison and window is not None:
        for table, start, _ in rows:
            before = max(0, start - window + 1) // bs  # blocks wholly before the first row's window
            kc[:, table[:before]] = float("nan")
            vc[:, table[:before]] = float("nan")
    T = sum(n for _, _, n in rows)
    q = torch.randn(T, kvh * group, d, generator=g).to(dtype)
    k = torch.randn(T, kvh, d, generator=g).to(dtype)
    v = torch.randn(T, kvh, d, generator=g).to(dtype)
    scale = d ** -0.5
    meta = A.build_metadata(dec_tables, decode_lens, pf, bs, CPU, kernel=path == "native", dtype=dtype)
    if meta_hook:
        meta_hook(meta)
    out = A.paged_attention(q, k, v, kc, vc, meta, scale, window=window).float().view(T, kvh * group, d)
    ref = torch.empty(T, kvh * group, d, dtype=torch.float64)
    r = 0
    for table, start, n in rows:
        ctx = start + n
        K = kc[:, table].reshape(kvh, -1, d)[:, :ctx].double().repeat_interleave(group, 0)
        V = vc[:, table].reshape(kvh, -1, d)[:, :ctx].double().repeat_interleave(group, 0)
        mask = hf_mask(start, n, window) if window is not None else \
            torch.arange(ctx)[None, :] <= (start + torch.arange(n))[:, None]
        unseen = ~mask.any(0)  # the poisoned positions are among these
        K[:, unseen] = 0
        V[:, unseen] = 0
        s_ = (torch.einsum("nhd,htd->hnt", q[r:r + n].double(), K) * scale).masked_fill(~mask, float("-inf"))
        ref[r:r + n] = torch.einsum("hnt,htd->nhd", s_.softmax(-1), V)
        r += n
    return out, ref


def edges(w: int) -> list[int]:
    return sorted({n for n in (1, w - 1, w, w + 1, 5 * w + 3) if n >= 1})


def test_the_rule_is_transformers_sliding_window():
    # the rule attention.py implements, written out, against transformers' mask at several offsets
    for w in (1, 2, 5, 16):
        for start, n in ((0, 40), (7, 3), (30, 1), (3, 50)):
            p = torch.arange(start, start + n)[:, None]
            j = torch.arange(start + n)[None, :]
            assert torch.equal(hf_mask(start, n, w), (j <= p) & (j > p - w)), (w, start, n)
            assert int(hf_mask(start, n, w)[-1].sum()) == min(w, start + n)  # W keys, its own included


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs,w", [(4, 16), (16, 16), (5, 16), (7, 16), (16, 13), (16, 1)])
def test_decode_rows_at_the_window_edges(path, dtype, bs, w):
    lens = edges(w) + [2, 3 * w, 7 * w + 5]
    out, ref = run_step(dtype, lens, [], w, path, bs=bs, seed=bs * w)
    assert (out.double() - ref).abs().max() < TOL[dtype]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs", [16, 5])
def test_fresh_chunks_at_the_window_edges(path, dtype, bs):
    w = 16
    out, ref = run_step(dtype, [], [(0, n) for n in edges(w)], w, path, bs=bs, seed=bs)
    assert (out.double() - ref).abs().max() < TOL[dtype]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs", [16, 8, 7])
def test_chunks_after_a_prefix(path, dtype, bs):
    w = 16
    chunks = [(w - 1, 1), (w, 1), (w - 2, 3), (w + 1, w + 2), (3 * w, 2 * w + 5), (2, 5 * w + 3),
              (5 * w + 3, 1), (9 * w + 4, 100)]
    out, ref = run_step(dtype, [], chunks, w, path, bs=bs, seed=bs + 1)
    assert (out.double() - ref).abs().max() < TOL[dtype]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kvh,group", [(1, 1), (2, 2), (1, 4), (2, 3), (1, 7)])
def test_mixed_steps_and_gqa_groups(path, dtype, kvh, group):
    # decode rows and chunks (fresh, after a prefix, longer than the window) in one call
    w = 24
    out, ref = run_step(dtype, [1, 23, 24, 25, 200], [(0, 30), (50, 7), (10, 70), (0, 5), (300, 1)], w, path,
                        bs=16, kvh=kvh, group=group, seed=kvh * 10 + group)
    assert (out.double() - ref).abs().max() < TOL[dtype]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma3_270m_head_shape(path, dtype):
    # head_dim 256, one KV head, four query heads, window 512 (Gemma 3 270M's local layers)
    w = 512
    out, ref = run_step(dtype, [1, 511, 512, 513, 5 * w + 3], [(0, 600), (1000, 40), (w - 3, 9)], w, path,
                        bs=16, kvh=1, group=4, d=256, seed=2)
    assert (out.double() - ref).abs().max() < TOL[dtype]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("d", [48, 128])
def test_other_head_dims(path, d):
    # 48 is not a multiple of 16: the kernel's portable loop
    out, ref = run_step(torch.float32, [40, 41, 170], [(0, 45), (60, 20)], 40, path, bs=8, d=d, seed=d)
    assert (out.double() - ref).abs().max() < 2e-5


@pytest.mark.skipif(not HAVE_KERNEL, reason="native kernel unavailable")
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_contexts_with_a_window(monkeypatch, dtype):
    # few rows and tiny partitions: a row's window is split across cores, the first part starting
    # inside a block, some parts empty for some rows, merged by log-sum-exp
    monkeypatch.setattr(A, "MIN_PARTITION_TOKENS", 16)
    out, ref = run_step(dtype, [1000, 8192], [(5000, 20)], 100, "native", bs=16, kvh=1, group=4, seed=9)
    assert (out.double() - ref).abs().max() < TOL[dtype]
    monkeypatch.setattr(A, "MIN_PARTITION_TOKENS", 1)  # more parts than blocks: empty parts
    out, ref = run_step(dtype, [70], [], 37, "native", bs=16, kvh=1, group=2, seed=10)
    assert (out.double() - ref).abs().max() < TOL[dtype]


@pytest.mark.skipif(not HAVE_KERNEL, reason="native kernel unavailable")
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_chunks_the_window_cuts_stay_on_the_kernel(dtype):
    # flash attention has no window mask: a long chunk whose context passes the window goes to the
    # kernel under that window; one inside the window keeps the path it has without one
    pf = [(list(range(1, 20)), 0, 300), (list(range(20, 33)), 100, 100)]  # contexts 300 and 200
    meta = A.build_metadata([], [], pf, 16, CPU, kernel=True, dtype=dtype)
    cut = meta.for_window(64)
    assert not cut.prefills and cut.native is not None and cut.native.count >= 2 and cut.window == 64
    assert meta.for_window(64) is cut  # laid out once per step and window
    assert meta.for_window(300) is meta  # no row's context exceeds it: unchanged
    wide = meta.for_window(250)  # cuts the first chunk only
    assert len(wide.prefills) == len(meta.prefills) - (1 if meta.prefills else 0)
    for prefills in ([(0, 300)], [(200, 100)], [(0, 300), (100, 100)]):
        out, ref = run_step(dtype, [], prefills, 64, "native", seed=len(prefills))
        assert (out.double() - ref).abs().max() < TOL[dtype]


@pytest.mark.parametrize("path", PATHS)
def test_window_none_and_windows_past_the_context_are_unchanged(path):
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(2, 40, 16, 64, generator=g).bfloat16()
    vc = torch.randn_like(kc)
    tables = [list(range(1, 9)), list(range(9, 12))]
    pf = [(list(range(12, 39)), 300, 130)]
    q = torch.randn(2 + 130, 4, 64, generator=g).bfloat16()
    k = torch.randn(2 + 130, 2, 64, generator=g).bfloat16()
    v = torch.randn_like(k)
    outs = []
    for window in ("absent", None, 430, 10 ** 9):
        meta = A.build_metadata(tables, [128, 40], pf, 16, CPU, kernel=path == "native", dtype=torch.bfloat16)
        args = (q, k, v, kc.clone(), vc.clone(), meta, 0.125)
        outs.append(A.paged_attention(*args) if window == "absent" else A.paged_attention(*args, window=window))
        if window is not None and window != "absent":
            assert meta.for_window(window) is meta
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    cut = A.build_metadata(tables, [128, 40], pf, 16, CPU, kernel=path == "native", dtype=torch.bfloat16)
    assert not torch.equal(A.paged_attention(q, k, v, kc.clone(), vc.clone(), cut, 0.125, window=429), outs[0])


@pytest.mark.skipif(not HAVE_KERNEL, reason="native kernel unavailable")
def test_a_step_without_spans_attends_without_its_own_kv_under_any_window():
    # the fused bfloat16 forward calls attend_native(q, None, None, ...) when a step has no spans;
    # a window never adds one
    g = torch.Generator().manual_seed(4)
    kc = torch.randn(1, 30, 16, 64, generator=g).bfloat16()
    vc = torch.randn_like(kc)
    meta = A.build_metadata([list(range(1, 20))], [300], [(list(range(20, 30)), 100, 50)], 16, CPU,
                            kernel=True, dtype=torch.bfloat16)
    if meta.prefills:
        pytest.skip("this build sends 50-row bfloat16 chunks to torch's flash kernel")
    q = torch.randn(51, 4, 64, generator=g).bfloat16()
    k = torch.randn(51, 1, 64, generator=g).bfloat16()
    v = torch.randn_like(k)
    want = A.paged_attention(q, k, v, kc, vc, meta, 0.125, window=40)
    assert torch.equal(A.attend_native(q, None, None, kc, vc, meta, 0.125, window=40), want)


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "512"])
def test_a_bad_window_is_refused(bad):
    meta = A.build_metadata([[1]], [5], [], 16, CPU, kernel=False)
    with pytest.raises(ValueError, match="sliding window"):
        meta.for_window(bad)


def test_a_layout_for_one_window_refuses_another():
    meta = A.build_metadata([[1, 2]], [20], [], 16, CPU, kernel=False)
    with pytest.raises(ValueError, match="window 8"):
        meta.for_window(8).for_window(9)
    assert meta.for_window(8).for_window(8) is meta.for_window(8)


def test_torch_decode_gathers_only_the_window_blocks():
    # a 32k context on a window-512 layer: the torch path gathers the window's 33 blocks, not 2048
    table = list(range(2048))
    meta = A.build_metadata([table], [32768], [], 16, CPU, kernel=False).for_window(512)
    assert meta.decode.max_blocks == 32 and meta.decode.mask is None  # 32768 - 512 is on a block edge
    meta = A.build_metadata([table[:-1] + [5000]], [32760], [], 16, CPU, kernel=False).for_window(512)
    assert meta.decode.max_blocks == 33 and int(meta.decode.mask.sum()) == 512
