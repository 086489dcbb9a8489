"""GGUF Q4_0/Q4_1 (and Q8_0) weights kept as their codes: the block reader against gguf's own
dequantization, the int4 Linear against F.linear with the dequantized weight
(decode-sized inputs on each int4 kernel, agentserve's and torch's, larger ones
on the bf16 copy), a tiny
Q4 GGUF run natively against the same file dequantized, and the `weights`
option's fallbacks (one log line, no crash)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from gguf_fixtures import write_tiny_gguf
from tiny_models import hf_llama, loaded, teacher_forced_logits

from agentserve.llm import LLM
from agentserve.runner import device as devices
from agentserve.runner import gguf_linear, linear, native
from agentserve.runner.gguf_loader import load_gguf, unpermute_qk
from agentserve.runner.linear import Q4Linear, Q8Linear
from agentserve.runner.quant import Q4Weight, Q8Weight, from_blocks

needs_int4 = pytest.mark.skipif(linear.int4_unavailable(torch.device("cpu")) is not None,
                                reason=f"no int4 kernel: {linear.int4_unavailable(torch.device('cpu'))}")

# native in bfloat16 here: these compare it with the dequantized bf16 weights, number for number
DT = {"native": "bfloat16", "bf16": "auto", "fp32": "auto"}


def q4_weight(qtype: Q, n: int, k: int, seed: int = 0) -> tuple[Q4Weight, torch.Tensor]:
    """Random weights quantized by gguf: (our reading of the blocks, gguf's dequantization)."""
    values = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = quantize(values, qtype)
    back = torch.from_numpy(dequantize(raw, qtype).astype(np.float32).reshape(n, k))
    return from_blocks(raw, qtype.name, (n, k)), back


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_blocks_dequantize_exactly_like_gguf(qtype):
    w, back = q4_weight(qtype, 48, 96)
    assert w.codes.dtype == torch.uint8 and int(w.codes.max()) <= 15
    assert torch.equal(w.dequantize(), back)
    # row operations apply to codes and scales alike
    assert torch.equal(w.map_rows(lambda t: unpermute_qk(t, 4)).dequantize(), unpermute_qk(back, 4))
    other, other_back = q4_weight(Q.Q4_0 if qtype == Q.Q4_1 else Q.Q4_1, 16, 96, seed=1)
    both = Q4Weight.cat([w, other])
    assert both.qtype == "Q4_0+Q4_1" and torch.equal(both.dequantize(), torch.cat([back, other_back]))


KERNELS = [pytest.param("auto", marks=pytest.mark.skipif(native.gguf_kernel() is None,
                                                         reason=f"{native.gguf_unavailable_reason()}")),
           pytest.param("torch", marks=pytest.mark.skipif(linear._check_int4() is not None,
                                                          reason="torch has no CPU int4 kernel"))]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
@pytest.mark.parametrize("rows", [0, 1, 3, "max", "max+1", 40])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_linear_matches_dequantized_weight(kernel, qtype, rows, bias):
    w, back = q4_weight(qtype, 96, 160, seed=7)
    lin0 = Q4Linear(w, kernel=kernel)
    assert lin0.kernel == ("agentserve" if kernel == "auto" else "torch")
    rows = {"max": lin0.max_rows, "max+1": lin0.max_rows + 1}.get(rows, rows)
    g = torch.Generator().manual_seed(rows)
    b = torch.randn(96, generator=g).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, 160, generator=g).to(torch.bfloat16)
    lin = Q4Linear(w, b, kernel=kernel)
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 96)
    ref = F.linear(x.double(), back.double(), None if b is None else b.double())
    dense = F.linear(x, back.to(torch.bfloat16), b)  # what the bf16 weight format computes
    if rows > lin.max_rows:
        assert torch.equal(y, dense)  # the bf16 copy: bit for bit the bf16 path
    elif rows:  # (no rows: a step whose chunk needs no logits)
        err = (y.double() - ref).abs()
        dense_err = (dense.double() - ref).abs()
        if kernel == "torch":  # its bf16 scales and output rounding, about what the dense bf16 product makes
            assert err.max() <= 2 * dense_err.max() + 1e-3
            assert err.pow(2).mean().sqrt() <= 2 * dense_err.pow(2).mean().sqrt()
        else:  # exact scales, two-level activation codes: the output's own rounding, like the dense product
            assert err.max() <= dense_err.max() + 1e-3
            assert err.pow(2).mean().sqrt() <= 1.2 * dense_err.pow(2).mean().sqrt()
    blocks = 160 // 32 * 96
    bias_bytes = 96 * 2 if bias else 0
    # the packed codes plus fp16 (d, m) per block, or torch's codes plus bf16 (scale, zero) pairs
    assert lin.nbytes == 96 * 160 // 2 + blocks * 4 + bias_bytes


@pytest.mark.skipif(native.gguf_kernel() is None, reason=f"{native.gguf_unavailable_reason()}")
@pytest.mark.parametrize("rows", [1, 5, 8, 13])
def test_native_q4_float32_activations(rows):
    """float32 in and out through the same kernel: two-level codes keep it near exact."""
    w, back = q4_weight(Q.Q4_1, 64, 256, seed=rows)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)) * 3
    y = Q4Linear(w, max_rows=16)(x)
    ref = F.linear(x.double(), back.double())
    assert y.dtype == torch.float32
    assert ((y.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()) < 1e-4


@pytest.mark.skipif(native.gguf_kernel() is None, reason=f"{native.gguf_unavailable_reason()}")
def test_native_q4_edge_activations():
    """A block of zeros, one huge outlier, and values at the int8 limits."""
    w, back = q4_weight(Q.Q4_0, 32, 128, seed=3)
    x = torch.zeros(3, 128)
    x[1, 5] = 1e4
    x[1, 40:72] = torch.linspace(-1, 1, 32)
    x[2] = torch.randn(128, generator=torch.Generator().manual_seed(0)).sign() * 127.0
    y = Q4Linear(w)(x.to(torch.bfloat16)).double()
    ref = F.linear(x.to(torch.bfloat16).double(), back.double())
    assert torch.equal(y[0], torch.zeros(32, dtype=torch.float64))
    assert ((y - ref).abs() <= 1e-2 * ref.abs() + 1e-2).all()


def test_int4_shape_rules():
    assert linear.int4_shape_ok((32, 64)) and not linear.int4_shape_ok((24, 64))
    assert not linear.int4_shape_ok((32, 48))
    w, _ = q4_weight(Q.Q4_0, 24, 64)
    with pytest.raises(ValueError, match="multiples of 16"):
        Q4Linear(w)


# --- a whole tiny model -------------------------------------------------------

Q4_LAYOUT = {"q_proj": Q.Q4_0, "k_proj": Q.Q4_1, "v_proj": Q.Q4_1, "o_proj": Q.Q4_0,
             "gate_proj": Q.Q4_1, "up_proj": Q.Q4_0, "down_proj": Q.Q4_1}


def _qtypes(n_layers: int, untied_head: Q | None = None) -> dict[str, Q]:
    out = {f"model.layers.{i}.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}.weight": t
           for i in range(n_layers) for p, t in Q4_LAYOUT.items()}
    out["model.embed_tokens.weight"] = Q.Q8_0
    if untied_head is not None:
        out["lm_head.weight"] = untied_head
    return out


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    """Every projection Q4_0 or Q4_1 (q/k rows permuted like llama.cpp), embedding Q8_0,
    an untied Q4_0 head whose 266 rows the int4 kernel cannot pack (it stays bf16)."""
    path = tmp_path_factory.mktemp("q4") / "tiny-q4.gguf"
    return write_tiny_gguf(path, n_layers=2, tied=False, qtypes=_qtypes(2, Q.Q4_0))


def test_loader_keeps_q4_and_q8_tensors(tiny_q4):
    m = load_gguf(tiny_q4.path, keep_quantized=True)
    assert set(m.tensor_types) == {"F32", "Q4_0", "Q4_1", "Q8_0"}
    for name, qtype in tiny_q4.qtypes.items():
        w = m.weights[name]
        if qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
            kind = Q8Weight if qtype == Q.Q8_0 else Q4Weight
            assert isinstance(w, kind) and w.qtype == qtype.name, name
            w = w.dequantize()  # q/k: un-permuted like the dequantizing loader does
        np.testing.assert_array_equal(w.numpy(), tiny_q4.expected[name], err_msg=name)


@needs_int4
def test_tiny_q4_model_native_against_bf16(tiny_q4):
    m = load_gguf(tiny_q4.path, keep_quantized=True)
    opts = dict(device="cpu", kv_cache_tokens=256, max_model_len=256, block_size=16)
    q4, bf16, fp32 = (LLM(m, weights=w, dtype=DT[w], **opts) for w in ("native", "bf16", "fp32"))
    assert q4.model.weight_format == "native" and bf16.model.weight_format == "bf16"
    assert q4.dtype == torch.bfloat16 and fp32.model.weight_format == "fp32"
    # 8 projections int4; the head (266 rows) is not a multiple of 16, which the int4
    # kernels need: the block kernel takes it where built, else it stays bf16
    assert (q4.model.int4_linears, q4.model.num_linears) == (8, 9)
    head = gguf_linear.BlockLinear if gguf_linear.block_available(torch.device("cpu")) else linear.Linear
    assert isinstance(q4.model.lm_head, head)
    assert q4.model.weight_bytes < bf16.model.weight_bytes
    ids = list(np.random.default_rng(0).integers(0, tiny_q4.vocab, 48))
    exact = teacher_forced_logits(fp32, ids, 48)
    dense = teacher_forced_logits(bf16, ids, 48)
    assert torch.equal(teacher_forced_logits(q4, ids, 48), dense)  # 48 rows a forward: the bf16 copies
    rel = lambda x: ((x - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()  # noqa: E731
    # the int4 kernel (8 rows a forward): as close to float32 as the bf16 weights are
    assert rel(teacher_forced_logits(q4, ids, q4.model.int4_max_rows)) < 1.5 * rel(dense)
    # computing in float32 (auto's choice without native bf16): prefill-sized forwards equal
    # the float32 model; the int4 kernel's rows are far closer to it than bf16 weights: torch's
    # takes float32 activations, the tiled AVX512-VNNI one int8 codes (one scale per 32 values)
    q4f = LLM(m, weights="native", dtype="float32", kv_dtype="float32", **opts)
    assert q4f.dtype == torch.float32 and q4f.model.int4_linears == 8
    assert torch.equal(teacher_forced_logits(q4f, ids, 48), exact)
    codes = {"torch": 0.05, "agentserve": 0.25}[q4f.model.int4_kernel]
    assert rel(teacher_forced_logits(q4f, ids, q4f.model.int4_max_rows)) < codes * rel(dense)


# --- the weights option: choices, conflicts, fallbacks ---------------------------


def test_weights_plan_and_conflicts():
    cpu = torch.device("cpu")
    assert devices.plan_weights("fp32", "auto", cpu) == (False, torch.float32)
    assert devices.plan_weights("bf16", "bfloat16", cpu) == (False, torch.bfloat16)
    assert devices.plan_weights("auto", "float32", cpu) == (False, torch.float32)  # the exact path stays exact
    kernel = linear.int4_unavailable(cpu) is None
    auto = devices.resolve_dtype("auto", cpu)  # bf16 where the CPU has it natively, else float32
    assert devices.plan_weights("auto", "auto", cpu) == (kernel, auto)
    assert devices.plan_weights("native", "auto", cpu) == (kernel, auto)
    assert devices.plan_weights("native", "float32", cpu) == (kernel, torch.float32)
    assert devices.plan_weights("native", "bfloat16", cpu) == (kernel, torch.bfloat16)
    with pytest.raises(ValueError, match="float16 is not supported on the CPU"):
        devices.plan_weights("native", "float16", cpu)
    with pytest.raises(ValueError, match="dtype bfloat16"):
        devices.plan_weights("fp32", "bfloat16", cpu)
    with pytest.raises(ValueError, match="not one of"):
        devices.plan_weights("int4", "auto", cpu)
    assert "cuda" in linear.int4_unavailable(torch.device("cuda"))


def test_native_without_the_kernel_falls_back_with_one_line(monkeypatch, caplog):
    monkeypatch.setattr(linear, "_INT4_REASON", "this torch build (x) lacks aten._weight_int4pack_mm_for_cpu")
    monkeypatch.setattr(native, "gguf_kernel", lambda: None)
    monkeypatch.setattr(native, "block_kernel", lambda: None)
    auto = devices.resolve_dtype("auto", torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="agentserve"):
        assert devices.plan_weights("native", "auto", torch.device("cpu")) == (False, auto)
        assert devices.plan_weights("auto", "bfloat16", torch.device("cpu")) == (False, torch.bfloat16)
    assert [r.getMessage() for r in caplog.records] == [
        "weights native: this torch build (x) lacks aten._weight_int4pack_mm_for_cpu; "
        f"using dequantized {devices.dtype_name(auto)} weights"]


@needs_int4
def test_native_on_models_without_codes_falls_back_with_one_line(tmp_path, caplog):
    f16 = write_tiny_gguf(tmp_path / "f16.gguf", n_layers=1, qtypes={n: Q.F16 for n in _qtypes(1)})
    with caplog.at_level(logging.WARNING, logger="agentserve"):
        opts = dict(device="cpu", kv_cache_tokens=64, max_model_len=64)
        llm = LLM(str(f16.path), weights="native", dtype="bfloat16", **opts)
        assert llm.model.weight_format == "bf16" and llm.dtype == torch.bfloat16
        tiny = LLM(loaded(hf_llama(layers=1)), weights="native", **opts)
        assert tiny.model.weight_format == {torch.float32: "fp32", torch.bfloat16: "bf16"}[tiny.dtype]
        auto = LLM(str(f16.path), weights="auto", dtype="bfloat16", **opts)
        assert auto.model.weight_format == "bf16"  # auto falls back silently
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights native")]
    assert len(warnings) == 2, warnings
    assert "GGUF tensor types (F16, F32) have no native kernel" in warnings[0]
    assert "tiny-llama is not a GGUF file" in warnings[1]


def q8_weight(n: int, k: int, seed: int = 0) -> tuple[Q8Weight, torch.Tensor]:
    values = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = quantize(values, Q.Q8_0)
    back = torch.from_numpy(dequantize(raw, Q.Q8_0).astype(np.float32).reshape(n, k))
    return from_blocks(raw, "Q8_0", (n, k)), back  # type: ignore[return-value]


def test_q8_blocks_dequantize_exactly_like_gguf():
    w, back = q8_weight(32, 96)
    assert isinstance(w, Q8Weight) and w.codes.dtype == torch.int8
    assert torch.equal(w.dequantize(), back)
    assert torch.equal(w.map_rows(lambda t: unpermute_qk(t, 4)).dequantize(), unpermute_qk(back, 4))
    assert torch.equal(Q8Weight.cat([w, w]).dequantize(), torch.cat([back, back]))
    assert w.nbytes == 32 * 3 * 34


@pytest.mark.skipif(native.gguf_kernel() is None, reason=f"{native.gguf_unavailable_reason()}")
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_q8_linear_matches_dequantized_weight(rows, bias):
    w, back = q8_weight(80, 192, seed=rows)
    g = torch.Generator().manual_seed(rows)
    b = torch.randn(80, generator=g).to(torch.bfloat16) if bias else None
    x = (torch.randn(rows, 192, generator=g) * 4).to(torch.bfloat16)
    lin = Q8Linear(w, b)
    y = lin(x)
    ref = F.linear(x.double(), back.double(), None if b is None else b.double())
    dense = F.linear(x, back.to(torch.bfloat16), b)
    assert y.shape == (rows, 80)
    if rows > lin.max_rows:
        assert torch.equal(y, dense)
    elif rows:
        err, dense_err = (y.double() - ref).abs(), (dense.double() - ref).abs()
        assert err.max() <= dense_err.max() + 1e-3
        assert err.pow(2).mean().sqrt() <= 1.2 * dense_err.pow(2).mean().sqrt()
        y32 = lin(x.float())  # float32 activations: near exact
        assert ((y32.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()) < 1e-4
    assert lin.nbytes == 80 * 192 // 32 * 36 + (80 * 2 if bias else 0)  # codes, fp16 scale, int16 code sum


@pytest.mark.skipif(native.gguf_kernel() is None, reason=f"{native.gguf_unavailable_reason()}")
def test_q8_model_runs_natively_where_the_kernel_is_built(tmp_path, monkeypatch, caplog):
    """Every projection Q8_0: on the Q8_0 kernel; without the native kernels (the tiled
    one and the block one, which also takes Q8_0), dequantized with one log line (there
    is no torch kernel for Q8_0)."""
    q8 = write_tiny_gguf(tmp_path / "q8.gguf", n_layers=1,
                         qtypes={n: Q.Q8_0 for n in _qtypes(1)} | {"model.embed_tokens.weight": Q.F16})
    opts = dict(device="cpu", kv_cache_tokens=64, max_model_len=64)
    llm = LLM(str(q8.path), weights="native", **opts)
    assert llm.model.weight_format == "native"
    assert (llm.model.q8_linears, llm.model.int4_linears, llm.model.num_linears) == (4, 0, 5)
    bf16 = LLM(str(q8.path), weights="bf16", **opts)
    ids = list(np.random.default_rng(0).integers(0, q8.vocab, 24))
    exact = teacher_forced_logits(LLM(str(q8.path), weights="fp32", **opts), ids, 24)
    rel = lambda x: ((x - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()  # noqa: E731
    assert rel(teacher_forced_logits(llm, ids, 4)) < 1.5 * rel(teacher_forced_logits(bf16, ids, 24))
    monkeypatch.setattr(native, "gguf_kernel", lambda: None)
    monkeypatch.setattr(native, "block_kernel", lambda: None)
    monkeypatch.setattr(linear, "_INT4_REASON", None)
    with caplog.at_level(logging.WARNING, logger="agentserve"):
        assert LLM(str(q8.path), weights="native", **opts).model.weight_format == "bf16"
    assert "have no native kernel here (only Q4_0, Q4_1 do)" in caplog.text
