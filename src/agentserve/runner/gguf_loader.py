"""Load a llama.cpp GGUF file into the runner's Hugging Face-shaped form.

Three translations happen here, each undoing a choice llama.cpp made:

* Quantized blocks -> float32 (`gguf.quants.dequantize`), except that with
  `keep_quantized` Q4_0, Q4_1 and Q8_0 tensors stay as their codes (`quant.Q4Weight`, `quant.Q8Weight`)
  (codes and block scales read straight from the file's bytes) for the
  int4 kernel of `linear.Q4Linear`.
* ggml names (`blk.3.attn_q.weight`) -> Hugging Face Llama names
  (`model.layers.3.self_attn.q_proj.weight`); ggml lists dimensions fastest
  first (ne), so a tensor's numpy shape is ne reversed, which is already
  [out, in] like torch's Linear.
* llama.cpp's converter reorders the rows of q and k inside every head so its
  interleaved ("GPT-J") rope can rotate adjacent pairs; the runner uses the
  rotate-half layout, so `unpermute_qk` puts the rows back. Only `llama`
  files are permuted: Qwen2, Qwen3 and Gemma 3 are converted for llama.cpp's
  NEOX (rotate-half) rope and keep their rows.
* Gemma 3's converter stores every norm weight as 1 + w (llama.cpp multiplies
  by the stored value); the loader subtracts the 1 again, as transformers'
  GGUF reader does, so the weights are the Hugging Face ones.

The header (metadata and tensor index) is parsed by `gguf_file.GGUFFile`, not
gguf-py's GGUFReader, which takes tens of seconds over a 262k-token vocabulary;
the weights are views of the memory-mapped file either way.

The config comes from `{general.architecture}.*` metadata (gguf_config.py) and
the tokenizer from `tokenizer.ggml.*` (see tokenizer.py).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from agentserve.runner.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModel
from agentserve.runner.checkpoint import LoadedModel, check_weights
from agentserve.runner.gguf_config import config_from_metadata, open_gguf, read_metadata
from agentserve.runner.gguf_file import GGUFTensor
from agentserve.runner.quant import KEPT_TYPES, QuantWeight, from_blocks
from agentserve.runner.tokenizer import Tokenizer

# Architecture -> whether its converter permuted q/k rows for interleaved rope.
# The others are converted for llama.cpp's NEOX rope (rotate-half), so they are not.
# (Mistral models are converted as `llama`.)
_ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False, "gemma3": False}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma 3 names its four norms by place: ffn_norm is the one before the MLP
_GEMMA3_NAMES = {**_LAYER_NAMES, **_QK_NORM_NAMES,
                 "post_attention_norm": "post_attention_layernorm",
                 "ffn_norm": "pre_feedforward_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"}
_NAMES_BY_ARCH = {"llama": _LAYER_NAMES, "qwen2": _LAYER_NAMES, "qwen3": {**_LAYER_NAMES, **_QK_NORM_NAMES},
                  "gemma3": _GEMMA3_NAMES}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Llama 3.1's rope scaling, stored by llama.cpp as per-frequency divisors; folded into the config.
_ROPE_FREQS = "rope_freqs.weight"


def load_gguf(path: str | Path, keep_quantized: bool = False) -> LoadedModel:
    """Read a GGUF model: config, float32 weights in HF names and layout, tokenizer.
    `keep_quantized`: Q4_0/Q4_1/Q8_0 tensors come as `Q4Weight`/`Q8Weight` instead of float32."""
    path = Path(path)
    reader = open_gguf(path)
    meta = read_metadata(reader)
    arch = meta.get("general.architecture", "llama")
    if arch not in _ARCHITECTURES:
        raise UnsupportedModel(f"{path}: GGUF architecture {arch!r} is not supported "
                               f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)}; Mistral files are `llama`)")
    if reader.byte_order != "<":
        # gguf's dequantize reads block scales and float tensors as little-endian: weights would be wrong
        raise UnsupportedModel(f"{path}: big-endian GGUF files are not supported (convert it little-endian)")
    tensors = {t.name: t for t in reader.tensors}
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    try:
        config = config_from_metadata(meta, tensors, tokenizer)
    except UnsupportedModel as e:
        raise UnsupportedModel(f"{path}: {e}") from None
    if _ROPE_FREQS in tensors:
        config.rope_scaling = llama3_scaling_from_freq_factors(
            dequantize_tensor(tensors[_ROPE_FREQS]).numpy(), config, str(path))
    weights = load_weights(tensors, config, permuted=_ARCHITECTURES[arch], source=str(path),
                           keep_quantized=keep_quantized)
    if config.gemma:
        for name, w in weights.items():
            if name.endswith("norm.weight"):
                weights[name] = w - 1.0
    check_weights(config, weights, str(path))
    types = tuple(sorted({GGMLQuantizationType(t.tensor_type).name for t in tensors.values()}))
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer,
                       chat_template=meta.get("tokenizer.chat_template"), source=str(path), tensor_types=types)


def load_weights(tensors: dict[str, GGUFTensor], config: ModelConfig, permuted: bool,
                 source: str, keep_quantized: bool = False) -> dict[str, torch.Tensor | QuantWeight]:
    """Every tensor dequantized (or with `keep_quantized`, Q4_0/Q4_1/Q8_0 kept as
    their codes), renamed, and (if `permuted`) q/k rows restored."""
    heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
    weights: dict[str, torch.Tensor | QuantWeight] = {}
    for name, t in tensors.items():
        if name == _ROPE_FREQS:
            continue
        hf = hf_name(name, source, config.arch)
        qtype = GGMLQuantizationType(t.tensor_type).name
        w: torch.Tensor | QuantWeight
        if keep_quantized and qtype in KEPT_TYPES and len(t.shape) == 2:
            w = quant_tensor(t)
        else:
            w = dequantize_tensor(t)
        proj = hf.split(".")[-2]
        if permuted and proj in heads:
            n = heads[proj]
            w = unpermute_qk(w, n) if isinstance(w, torch.Tensor) else w.map_rows(lambda x: unpermute_qk(x, n))
        weights[hf] = w
    return weights


def hf_name(gguf_name: str, source: str = "GGUF", arch: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _NAMES_BY_ARCH[arch]
    m = _LAYER_TENSOR.fullmatch(gguf_name)
    if m and m.group(2) in names:
        layer, part, kind = m.groups()
        return f"model.layers.{layer}.{names[part]}.{kind}"
    raise ValueError(f"{source}: tensor {gguf_name!r} has no counterpart in the {arch} layout")


def dequantize_tensor(t: GGUFTensor) -> torch.Tensor:
    """A GGUF reader tensor as float32 torch, shape [out, in] (ne reversed)."""
    qtype = GGMLQuantizationType(t.tensor_type)
    try:
        values = dequantize(t.data, qtype)
    except NotImplementedError:
        raise ValueError(f"tensor {t.name}: GGUF type {qtype.name} cannot be dequantized") from None
    shape = tuple(int(d) for d in reversed(t.shape))
    # F32 comes back as a read-only view of the memory-mapped file: copy it out.
    if not values.flags.writeable:
        values = values.copy()
    values = values.astype(np.float32, copy=False)
    return torch.from_numpy(values.reshape(shape))


def quant_tensor(t: GGUFTensor) -> QuantWeight:
    """A Q4_0/Q4_1/Q8_0 reader tensor as codes and block scales, shape [out, in]."""
    shape = tuple(int(d) for d in reversed(t.shape))
    return from_blocks(t.data, GGMLQuantizationType(t.tensor_type).name, shape)  # type: ignore[arg-type]


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    Its converter views each head's rows as [2, head_dim/2] (the two rotate-half
    halves) and transposes to [head_dim/2, 2], so row i of the first half and
    row i of the second half become neighbours 2i and 2i+1 - the pairs that
    interleaved rope rotates together. Viewing as [head_dim/2, 2] and
    transposing back restores the halves. Works for weights and biases (rows
    are dim 0)."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"cannot un-permute {rows} rows over {n_heads} heads")
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def llama3_scaling_from_freq_factors(factors: np.ndarray, cfg: ModelConfig, source: str) -> dict[str, Any] | None:
    """Recover Llama 3.1's rope_scaling dict from llama.cpp's `rope_freqs` tensor.

    The tensor holds, per frequency, the divisor llama3 scaling applies: 1 for
    short wavelengths, `factor` for long ones and, in between,
    1 / ((1 - s)/factor + s) with s linear in 1/wavelength. `factor` is the
    largest divisor and a line through the in-between points gives the band;
    (original_len, low, high) are only defined up to a common scale, so
    original_len is fixed at Llama 3's 8192 and low/high follow from the line.
    The result is checked by recomputing every divisor.
    """
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if np.allclose(factors, 1.0):
        return None
    d = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    if factors.shape != inv.shape:
        raise ValueError(f"{source}: rope_freqs has {factors.size} values, expected {inv.size}")
    wavelen = 2 * math.pi / inv
    factor = float(factors.max())
    mid = (factors > 1 + 1e-6) & (factors < factor - 1e-6)
    if mid.sum() < 2:
        raise ValueError(f"{source}: rope_freqs does not look like llama3 rope scaling")
    s = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)  # smooth factor per in-between frequency
    slope, intercept = np.polyfit(1 / wavelen[mid], s, 1)   # s = original/(high-low)/wavelen - low/(high-low)
    original = 8192
    width = original / slope
    low = -intercept * width
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
               "high_freq_factor": low + width, "original_max_position_embeddings": original}
    if not np.allclose(_llama3_divisors(inv, scaling), factors, rtol=1e-3):
        raise ValueError(f"{source}: rope_freqs does not match llama3 rope scaling")
    return scaling


def _llama3_divisors(inv: np.ndarray, sc: dict[str, Any]) -> np.ndarray:
    """What llama3 scaling divides each frequency by (to check a recovered dict)."""
    factor, low, high, old = (sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"],
                              sc["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    smooth = np.clip((old / wavelen - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1 - smooth) / factor + smooth)
