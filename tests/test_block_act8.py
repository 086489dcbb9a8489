"""The block kernel's int8-activation path (csrc/block_matmul.c's
agentserve_block_matmul8, which BlockLinear takes for steps of up to
ACT8_MAX_ROWS rows): each value x quantized to int8 on one scale per 4 values
(max|x| of the 4 over 127), so each product is within the bound that rounding
allows; the coarsening against the int16 path; odd shapes, extreme codes,
non-finite activations, the routing by row count, a build without AVX2."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_runner_kquant import ALL_TYPES, HALVES, LAYOUT, _gemma_path, needs_block, weight

from agentserve.runner import linear
from agentserve.runner.gguf_linear import ACT8_MAX_ROWS, ACT8_TYPES, BLOCK_KERNEL_TYPES, BlockLinear
from agentserve.runner.quant import from_blocks

EVERY = frozenset(BLOCK_KERNEL_TYPES)  # the kernel's int8 path for every type, whatever the default takes
CSRC = Path(__file__).resolve().parents[1] / "src" / "agentserve" / "runner" / "csrc"


def act8_bound(x: torch.Tensor, w64: torch.Tensor, y_ref: torch.Tensor) -> torch.Tensor:
    """|y - x W^T| allowed: each x within half a step (its 4's max / 127 / 2) of its
    code, times |w|; float32 accumulation on top (1e-5 of sum |w x|)."""
    rows, k = x.shape
    half_step = (x.double().abs().view(rows, k // 4, 4).amax(-1) / 127 / 2).repeat_interleave(4, dim=1)
    return half_step @ w64.abs().T + 1e-5 * (x.double().abs() @ w64.abs().T) + 1e-6 * y_ref.abs() + 1e-30


def _shape(qtype: str, odd: bool) -> tuple[int, int]:
    """(n, k): odd n (pairs of rows and a last one), an odd number of 32- or 256-blocks."""
    k = (3 * 256 if LAYOUT[qtype][0] == 256 else 9 * 32) if odd else (256 if LAYOUT[qtype][0] == 256 else 64)
    return (33 if odd else 1), k


@needs_block
@pytest.mark.parametrize("qtype", ALL_TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, ACT8_MAX_ROWS])
@pytest.mark.parametrize("odd", [True, False])
def test_act8_within_its_rounding_bound(qtype, rows, odd):
    n, k = _shape(qtype, odd)
    w = weight(qtype, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2
    x[:, 7] = 40.0  # an outlier: only its own 4 values share its step
    lin = BlockLinear([w], act8_types=EVERY)
    assert rows <= lin.act8_rows
    y = lin.blocks(x).double()
    w64 = w.dequantize().double()
    ref = x.double() @ w64.T
    err = (y - ref).abs()
    assert (err <= act8_bound(x, w64, ref)).all(), (err.max(), qtype, rows)


@needs_block
@pytest.mark.parametrize("qtype", ["Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_act8_bfloat16_with_bias(qtype):
    """bf16 in and out (rounded once more at the store) with a bias."""
    n, k = 48, 512
    w, b = weight(qtype, n, k, seed=4), torch.randn(n).to(torch.bfloat16)
    lin = BlockLinear([w], b, act8_types=EVERY)
    for rows in (1, 3):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        y = lin(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
        w64 = w.dequantize().double()
        ref = x.double() @ w64.T + b.double()
        assert ((y.double() - ref).abs() <= act8_bound(x, w64, ref) + 2 ** -8 * ref.abs()).all()


@needs_block
@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_act8_coarser_than_int16_and_routed_by_rows(qtype):
    """On normal activations the int8 codes' relative error is about 3e-3 (int16:
    under 1e-4); steps past act8_rows take the int16 codes, number for number."""
    w = weight(qtype, 64, 768, seed=2)
    x = torch.randn(6, 768, generator=torch.Generator().manual_seed(2))
    ref = x.double() @ w.dequantize().double().T
    rel = lambda y: ((y.double() - ref).norm() / ref.norm()).item()  # noqa: E731
    int8 = BlockLinear([w], act8_rows=6, act8_types=EVERY).blocks(x)
    int16 = BlockLinear([w], act8_rows=0).blocks(x)
    assert 5e-4 < rel(int8) < 6e-3 and rel(int16) < 1e-4
    assert torch.equal(BlockLinear([w], act8_rows=5, act8_types=EVERY).blocks(x), int16)  # 6 rows: past its 5
    assert torch.equal(BlockLinear([w], act8_rows=6, act8_types=EVERY).blocks(x[:3]), int8[:3])  # rows alone
    # by default only ACT8_TYPES take them
    assert torch.equal(BlockLinear([w], act8_rows=6).blocks(x), int8 if qtype in ACT8_TYPES else int16)


@needs_block
@pytest.mark.parametrize("qtype", ALL_TYPES)
@pytest.mark.parametrize("rows", [1, 2])
def test_act8_extreme_codes_do_not_overflow(qtype, rows):
    """Every code and sub-block scale at its largest magnitude (Q8_0's -128, whose
    magnitude does not fit a signed byte), every activation code at +-127."""
    size, nbytes = LAYOUT[qtype]
    n, k = 8, 512
    raw = np.full((n, k // size, nbytes), 0xFF, np.uint8)
    if qtype == "Q6_K":  # codes 0 (q - 32 = -32), scales -128
        raw[..., :192] = 0
        raw[..., 192:208] = 0x80
    if qtype == "Q8_0":  # codes -128
        raw[..., 2:] = 0x80
    for at in HALVES[qtype]:
        raw[..., at:at + 2] = np.float16(1e-3).reshape(1).view(np.uint8)
    w = from_blocks(raw.reshape(n, -1), qtype, (n, k))
    x = torch.full((rows, k), -7.0)
    x[0] = 7.0
    y = BlockLinear([w], act8_types=EVERY).blocks(x).double()
    ref = F.linear(x.double(), w.dequantize().double())
    assert ((y - ref).abs() <= 1e-5 * ref.abs() + 1e-4).all(), (y, ref)


@needs_block
@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_act8_non_finite_activations_stay_non_finite(qtype):
    """A NaN or an infinity has no int8 code; the exact block sums carry it into
    every output of its row, on the one-row path (pairs of weight rows) too."""
    n, k = _shape(qtype, True)
    lin = BlockLinear([weight(qtype, n, k)], act8_types=EVERY)
    for bad, check in ((float("nan"), torch.isnan), (float("inf"), lambda y: ~torch.isfinite(y))):
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(1))
        x[0, 3] = bad
        assert check(lin.blocks(x)).all()
        x3 = torch.randn(3, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        x3[1, k - 1] = bad
        y = lin.blocks(x3)
        assert check(y[1].float()).all() and y[0].float().isfinite().all() and y[2].float().isfinite().all()


def test_without_avx2_the_entry_refuses():
    """Built for a CPU without AVX2 the kernel reports itself absent and both
    entries return -1 (callers then dequantize: test_codes_linear_routes_by_kernel)."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    out = Path(__import__("tempfile").mkdtemp()) / "plain.so"
    r = subprocess.run([cc, "-O2", "-march=x86-64", "-mno-avx2", "-fPIC", "-shared", "-std=c11", "-o", str(out),
                        str(CSRC / "block_matmul.c"), "-lm"], capture_output=True, text=True, timeout=120)
    if r.returncode != 0 and "march" in r.stderr:
        pytest.skip(f"this compiler does not target x86-64: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stderr
    lib = ctypes.CDLL(str(out))
    assert lib.agentserve_block_fast() == 0
    for name in ("agentserve_block_matmul", "agentserve_block_matmul8"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        i, p, L = ctypes.c_int, ctypes.c_void_p, ctypes.c_long
        fn.argtypes = [i, i, p, L, L, p, L, p, p, L, i]
        assert fn(0, 0, None, 1, 32, None, 1, None, None, 1, 1) == -1


@needs_block
def test_every_tensor_of_the_gemma_q4_k_m_file_int8():
    """Each quantized tensor of the real file on 4 random float32 rows through the
    int8 path: within the rounding bound everywhere, and its relative error
    against the float64 product at most 3x the bf16 weights' rounding alone
    (measured: 1.9-2.2x on average per type, 2.6x at most; the int16 path stays
    within 1.1x the dense bf16 product's, test_runner_kquant.py)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFReader

    from agentserve.runner.gguf_loader import quant_tensor

    reader = GGUFReader(_gemma_path())
    seen: dict[str, list[float]] = {}
    g = torch.Generator().manual_seed(0)
    for t in reader.tensors:
        qtype = Q(t.tensor_type).name
        if qtype not in LAYOUT or len(t.shape) != 2:
            continue
        w = quant_tensor(t)
        if w.shape[0] > 8192:  # the 262144-row embedding: a slice of its rows
            w = w.map_rows(lambda r: r[:8192].contiguous())
        x = torch.randn(4, w.shape[1], generator=g)  # float32 rows, what decode computes on AVX2 CPUs
        back = w.dequantize()
        lin = BlockLinear([w], dense=linear.Linear(back.to(torch.bfloat16)), act8_types=EVERY)
        y = lin.blocks(x).double()
        ref = x.double() @ back.double().T
        assert ((y - ref).abs() <= act8_bound(x, back.double(), ref)).all(), t.name
        dense = x.double() @ back.to(torch.bfloat16).double().T  # the bf16 weights' rounding alone
        rel, dense_rel = ((y - ref).norm() / ref.norm()).item(), ((dense - ref).norm() / ref.norm()).item()
        assert rel <= 3 * dense_rel, (t.name, qtype, rel, dense_rel)
        seen.setdefault(qtype, []).append(rel / dense_rel)
    assert {k: len(v) for k, v in seen.items()} == {"Q5_0": 81, "Q4_K": 27, "Q6_K": 9, "Q8_0": 10}
    print({k: f"int8 error / bf16 weights' error: max {max(v):.2f}, mean {sum(v) / len(v):.2f}"
           for k, v in seen.items()})
