"""The native paged-attention kernel against the torch path and a dense reference:
decode rows with contexts up to 8k, short and long prefill chunks with and
without a prefix, mixed batches, shuffled block tables, both dtypes; and the
fallback when the kernel cannot be built."""

from __future__ import annotations

import random

import pytest
import torch

from agentserve.runner import attention as A
from agentserve.runner import attention_metadata
from agentserve.runner import native

needs_kernel = pytest.mark.skipif(native.paged_attention_kernel() is None,
                                  reason=f"native kernel unavailable: {native.unavailable_reason()}")


def _case(dtype, decode_lens, prefills, bs=16, kvh=3, group=3, d=64, seed=0):
    """Random caches and step; returns (outputs by path, dense reference)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = sum(-(-n // bs) for n in decode_lens) + sum(-(-(s + n) // bs) for s, n in prefills)
    nb = need + 5
    kc = torch.randn(kvh, nb, bs, d, generator=g).to(dtype)
    vc = torch.randn(kvh, nb, bs, d, generator=g).to(dtype)
    free = list(range(1, nb))
    rng.shuffle(free)
    dec_tables = [[free.pop() for _ in range(-(-n // bs))] for n in decode_lens]
    pf = [([free.pop() for _ in range(-(-(s + n) // bs))], s, n) for s, n in prefills]
    T = len(decode_lens) + sum(n for _, n in prefills)
    q = torch.randn(T, kvh * group, d, generator=g).to(dtype)
    k = torch.randn(T, kvh, d, generator=g).to(dtype)
    v = torch.randn(T, kvh, d, generator=g).to(dtype)
    scale = d ** -0.5
    outs = {}
    for name, kernel in (("torch", False), ("native", True)):
        kc2, vc2 = kc.clone(), vc.clone()
        meta = A.build_metadata(dec_tables, decode_lens, pf, bs, torch.device("cpu"), kernel=kernel, dtype=dtype)
        outs[name] = A.paged_attention(q, k, v, kc2, vc2, meta, scale).float().view(T, kvh * group, d)
    # dense reference in float64 from the written cache
    rows = []
    for table, n in zip(dec_tables, decode_lens):
        rows.append((table, n - 1, 1))
    for table, s, n in pf:
        rows.append((table, s, n))
    ref = torch.empty(T, kvh * group, d, dtype=torch.float64)
    r = 0
    for table, start, n in rows:
        ctx = start + n
        K = kc2[:, table].reshape(kvh, -1, d)[:, :ctx].double().repeat_interleave(group, 0)
        V = vc2[:, table].reshape(kvh, -1, d)[:, :ctx].double().repeat_interleave(group, 0)
        qq = q[r:r + n].double()
        s_ = torch.einsum("nhd,htd->hnt", qq, K) * scale
        mask = torch.arange(ctx)[None, :] <= (start + torch.arange(n))[:, None]
        s_ = s_.masked_fill(~mask, float("-inf"))
        ref[r:r + n] = torch.einsum("hnt,htd->nhd", s_.softmax(-1), V)
        r += n
    return outs, ref


CASES = [
    ([1], []),
    ([5, 17, 300], []),
    ([8192], []),  # one long sequence: the kernel splits its context across cores
    ([4096] * 3 + [1, 2049], []),
    ([], [(0, 7)]),
    ([], [(0, 130)]),  # long fresh chunk: SDPA on its own K/V
    ([], [(2000, 5)]),  # short chunk after a prefix: native
    ([], [(3000, 200)]),  # long chunk after a prefix: flash on prefix + own, merged
    ([33, 700], [(20, 50), (0, 100), (100, 3), (1000, 64)]),  # mixed step
]


@needs_kernel
@pytest.mark.parametrize("decode_lens,prefills", CASES)
def test_native_matches_torch_path_and_reference_fp32(decode_lens, prefills):
    outs, ref = _case(torch.float32, decode_lens, prefills)
    assert (outs["native"].double() - ref).abs().max() < 2e-5
    assert (outs["torch"].double() - ref).abs().max() < 2e-5


@needs_kernel
@pytest.mark.parametrize("decode_lens,prefills", CASES)
def test_native_matches_reference_bf16(decode_lens, prefills):
    outs, ref = _case(torch.bfloat16, decode_lens, prefills, seed=1)
    # the output is rounded to bfloat16 (8 bits of mantissa): values are O(1)
    assert (outs["native"].double() - ref).abs().max() < 3e-2
    assert (outs["native"] - outs["torch"]).abs().max() < 3e-2


@needs_kernel
@pytest.mark.parametrize("bs,group,d", [(8, 1, 32), (32, 4, 128), (16, 7, 48)])
def test_native_other_shapes(bs, group, d):
    # d=48 is not a multiple of 16: the portable loop serves it
    outs, ref = _case(torch.float32, [1, 40, 333], [(0, 9), (50, 20)], bs=bs, group=group, d=d, kvh=2, seed=3)
    assert (outs["native"].double() - ref).abs().max() < 2e-5


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [1, 4, 5])
def test_head_dim_256(dtype, group):
    # Gemma 3's head dim: the weighted V runs over the dimension in runs of 64, bfloat16 scores take
    # up to 4 query vectors per key row; decode rows (partial blocks, a long partitioned one) and
    # chunks whose rows see different spans of a block
    outs, ref = _case(dtype, [1, 17, 600, 5000], [(0, 9), (50, 20)], bs=16, group=group, d=256, kvh=1,
                      seed=group)
    tol = 3e-2 if dtype is torch.bfloat16 else 2e-5
    assert (outs["native"].double() - ref).abs().max() < tol


@needs_kernel
@pytest.mark.parametrize("bs,group", [(8, 1), (16, 2), (32, 4), (16, 3)])
def test_bf16_decode_rows_every_group_and_block_size(bs, group):
    # bfloat16 decode rows with head dim 64 take the register-resident decode path (any group up to
    # 4, blocks split into panels of 16 tokens or less, partial last blocks, contexts split across
    # cores); a one-row chunk after a prefix takes it too
    rng = random.Random(bs * group)
    lens = [1, 15, 16, 17, 33] + [rng.randint(1, 8192) for _ in range(3)]
    outs, ref = _case(torch.bfloat16, lens, [(2000, 1), (40, 1)], bs=bs, group=group, kvh=2, seed=group)
    assert (outs["native"].double() - ref).abs().max() < 3e-2
    assert (outs["native"] - outs["torch"]).abs().max() < 3e-2
    one, ref1 = _case(torch.bfloat16, [8192], [], bs=bs, group=group, kvh=1, seed=5)  # one long row, partitioned
    assert (one["native"].double() - ref1).abs().max() < 3e-2


@needs_kernel
def test_random_contexts_up_to_8k():
    rng = random.Random(7)
    for seed in range(3):
        lens = [rng.randint(1, 8192) for _ in range(rng.randint(1, 6))]
        chunks = [(rng.randint(0, 4000), rng.randint(1, 90)) for _ in range(rng.randint(0, 2))]
        outs, ref = _case(torch.float32, lens, chunks, seed=seed)
        assert (outs["native"].double() - ref).abs().max() < 2e-5, (lens, chunks)


def test_metadata_has_no_dense_mask_on_native_path():
    if native.paged_attention_kernel() is None:
        pytest.skip("native kernel unavailable")
    table = list(range(1, 1 + 8192 // 16 + 1))
    meta = A.build_metadata([table], [8000], [(table, 6000, 500)], 16, torch.device("cpu"),
                            kernel=True, dtype=torch.bfloat16)
    assert meta.kernel and meta.decode is None
    assert all(sp.mask is None for sp in meta.prefills)


def test_failed_build_falls_back_to_torch_with_a_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("AGENTSERVE_CACHE_DIR", str(tmp_path))
    native.reset_for_tests()
    try:
        with caplog.at_level("WARNING", logger="agentserve.runner"):
            assert native.paged_attention_kernel() is None
        assert "no C compiler" in native.unavailable_reason()
        assert "torch path" in caplog.text
        assert not A.use_native("cpu", torch.bfloat16)
        meta = A.build_metadata([[1, 2]], [20], [], 16, torch.device("cpu"), dtype=torch.bfloat16)
        assert not meta.kernel and meta.decode is not None
    finally:
        monkeypatch.undo()
        native.reset_for_tests()


def test_broken_compiler_output_falls_back(monkeypatch, tmp_path):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'cc (fake) 1.0'\n[ \"$1\" = --version ] && exit 0\necho boom >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("AGENTSERVE_CACHE_DIR", str(tmp_path / "cache"))
    native.reset_for_tests()
    try:
        assert native.paged_attention_kernel() is None
        assert "boom" in native.unavailable_reason()
        assert not list((tmp_path / "cache").rglob("*.so"))  # no torn library left behind
    finally:
        monkeypatch.undo()
        native.reset_for_tests()


def test_env_selects_torch_path(monkeypatch):
    monkeypatch.setenv("AGENTSERVE_ATTENTION", "torch")
    native.reset_for_tests()
    try:
        assert native.paged_attention_kernel() is None
        assert native.unavailable_reason() == "AGENTSERVE_ATTENTION=torch"
    finally:
        monkeypatch.undo()
        native.reset_for_tests()


def test_damaged_cached_library_is_rebuilt(monkeypatch, tmp_path):
    if native.paged_attention_kernel() is None:
        pytest.skip("native kernel unavailable")
    monkeypatch.setenv("AGENTSERVE_CACHE_DIR", str(tmp_path))
    native.reset_for_tests()
    try:
        assert native.paged_attention_kernel() is not None
        (lib,) = list(tmp_path.rglob("*.so"))
        lib.unlink()  # (the loaded one stays mapped; writing into it in place would crash this process)
        lib.write_bytes(b"not a library")
        native.reset_for_tests()
        assert native.paged_attention_kernel() is not None
    finally:
        monkeypatch.undo()
        native.reset_for_tests()


LONG_CHUNKS = [
    # (prefills, bs, group, d): long chunks forced through the native kernel (bf16: big row tiles)
    ([(0, 200)], 16, 3, 64),
    ([(2048, 300)], 16, 3, 64),
    ([(1000, 2000)], 16, 3, 64),  # long chunk after a prefix
    ([(37, 261), (0, 77)], 16, 3, 64),  # tiles straddle the causal diagonal mid-panel
    ([(500, 333)], 8, 4, 128),
    ([(129, 250)], 32, 2, 48),
    ([(300, 200)], 16, 1, 64),
    ([(64, 100)], 16, 7, 32),
]


@needs_kernel
@pytest.mark.parametrize("prefills,bs,group,d", LONG_CHUNKS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_long_chunks_in_native_kernel(monkeypatch, prefills, bs, group, d, dtype):
    monkeypatch.setattr(attention_metadata, "GEMM_CHUNK_ROWS", 10 ** 9)
    outs, ref = _case(dtype, [3, 70], prefills, bs=bs, group=group, d=d, kvh=2, seed=11)
    meta = A.build_metadata([], [], [(list(range(1, 1 + -(-(s + n) // bs))), s, n) for s, n in prefills], bs,
                            torch.device("cpu"), kernel=True, dtype=dtype)
    assert not meta.prefills  # all rows went to the native kernel
    tol = 3e-2 if dtype is torch.bfloat16 else 2e-5
    assert (outs["native"].double() - ref).abs().max() < tol


@needs_kernel
def test_chunk_routing_by_dtype():
    table = list(range(1, 1 + 4096 // 16 + 1))
    pf = [(table, 2048, 2048)]
    bf = A.build_metadata([], [], pf, 16, torch.device("cpu"), kernel=True, dtype=torch.bfloat16)
    fp = A.build_metadata([], [], pf, 16, torch.device("cpu"), kernel=True, dtype=torch.float32)
    assert len(fp.prefills) == 1 and fp.native is None  # float32: torch's flash kernel
    if native.big_tiles():  # bfloat16 with AVX512-BF16: the native kernel at any length
        assert not bf.prefills and bf.native is not None and bf.native.count == 1
    else:
        assert len(bf.prefills) == 1
