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

The config comes from `{general.architecture}.*` metadata and the tokenizer
from `tokenizer.ggml.*` (see tokenizer.py). Gemma 3 files do not carry what
llama.cpp hard-codes for the architecture: every sixth layer global, the
others sliding-window with RoPE base 10000, the attention scale from head_dim
(hidden / heads for the 27B model); the loader uses the same values.
"""

from __future__ import annotations

import math
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from agentserve.runner.config import FULL, SLIDING, SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModel
from agentserve.runner.checkpoint import LoadedModel, check_weights
from agentserve.runner.gguf_file import GGUFFile, GGUFTensor
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


def open_gguf(path: Path) -> GGUFFile:
    """The file's header parsed (metadata and tensor index; the weights stay in the memory map)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return GGUFFile(path)
    except (ValueError, OSError, struct.error) as e:  # GGUFFormatError is a ValueError
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None


def read_metadata(reader: GGUFFile) -> dict[str, Any]:
    """Every key/value as plain Python (str, int, float, bool, lists)."""
    meta = {}
    for key, value in reader.fields.items():
        if key.startswith("GGUF."):  # gguf-py's reader hid such keys behind its own header fields
            continue
        if reader.field_types[key] == GGUFValueType.FLOAT32:
            value = _shortest_float32(value)
        meta[key] = value
    return meta


def _shortest_float32(x: float) -> float:
    """GGUF stores 1e-5 as float32 (9.99999975e-06); read it back as the decimal it
    was written from, which is what config.json would say."""
    return float(str(np.float32(x)))


def config_from_metadata(meta: dict[str, Any], tensors: dict[str, GGUFTensor],
                         tokenizer: Tokenizer) -> ModelConfig:
    arch = meta.get("general.architecture", "llama")

    def get(key: str, default: Any = ...) -> Any:
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if default is ...:
            raise ValueError(f"GGUF metadata is missing {full}")
        return default

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    rot_dim = int(get("rope.dimension_count", head_dim))
    if rot_dim != head_dim:
        raise UnsupportedModel(f"partial rotary embeddings ({rot_dim} of {head_dim} dims) are not supported")
    value_dim = int(get("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise UnsupportedModel(f"value heads of {value_dim} dims beside key heads of {head_dim} are not supported")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if get(key, None):
            raise UnsupportedModel(f"{arch}.{key} = {get(key)} is not supported (the runner would ignore it)")
    layers = int(get("block_count"))
    extra: dict[str, Any] = {}
    if arch == "gemma3":
        extra = _gemma3_metadata(get, layers, hidden, heads, head_dim)
    elif get("attention.sliding_window", None) is not None:
        # llama.cpp itself ignores a window on these architectures; which layers it would bind is unknown
        raise UnsupportedModel(f"{arch}.attention.sliding_window is not supported for {arch} files")
    return ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        vocab_size=_vocab_size(get("vocab_size", None), meta, tensors),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(get),
        tie_word_embeddings="output.weight" not in tensors,
        max_position_embeddings=int(get("context_length", 4096)),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=list(tokenizer.eos_token_ids),
        name=meta.get("general.name") or arch,
        arch=arch,
        **extra,
    )


def _gemma3_metadata(get, layers: int, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    """What llama.cpp's Gemma 3 loader takes from the file or hard-codes: the
    window, which layers slide (a stored pattern, else every sixth layer global),
    the sliding layers' RoPE base (10000 unless stored) and the attention scale."""
    pattern = get("attention.sliding_window_pattern", None)
    if isinstance(pattern, list):  # per layer: true where the layer slides
        if len(pattern) != layers:
            raise UnsupportedModel(f"gemma3.attention.sliding_window_pattern has {len(pattern)} entries "
                                   f"for {layers} layers")
        types = [SLIDING if p else FULL for p in pattern]
    else:
        n = int(pattern or 6)
        types = [SLIDING if (i + 1) % n else FULL for i in range(layers)]
    # Gemma 3 27B (62 layers) scales by hidden/heads, the others by head_dim (as llama.cpp does)
    scalar = hidden // heads if layers == 62 else head_dim
    return dict(sliding_window=int(get("attention.sliding_window")), layer_types=types,
                local_rope_theta=float(get("rope.freq_base_swa", 10000.0)), local_rope_scaling=None,
                query_pre_attn_scalar=float(scalar))


def _vocab_size(declared: int | None, meta: dict[str, Any], tensors: dict[str, GGUFTensor]) -> int:
    """The embedding's row count is what the model really has (some files pad it
    past the token list); otherwise the declared size, otherwise the token count."""
    embed = tensors.get("token_embd.weight")
    if embed is not None:
        return int(embed.shape[1])  # ne = [hidden, vocab]
    if declared is not None:
        return int(declared)
    return len(meta["tokenizer.ggml.tokens"])


# llama.cpp's optional yarn keys -> transformers' names
_YARN_KEYS = {"rope.scaling.attn_factor": "attention_factor", "rope.scaling.yarn_beta_fast": "beta_fast",
              "rope.scaling.yarn_beta_slow": "beta_slow"}


def _rope_scaling(get) -> dict[str, Any] | None:
    """llama.cpp's `rope.scaling.*` keys as an HF rope_scaling dict (linear, yarn)."""
    kind = get("rope.scaling.type", None)
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise UnsupportedModel(f"rope scaling type {kind!r} is not supported in GGUF files (linear, yarn are)")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(get("rope.scaling.factor", 1.0))}
    original = get("rope.scaling.original_context_length", None)
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    if kind == "yarn":
        for key, name in _YARN_KEYS.items():
            if get(key, None) is not None:
                scaling[name] = float(get(key))
        for key in ("rope.scaling.yarn_ext_factor", "rope.scaling.yarn_log_multiplier"):
            if get(key, None):
                raise UnsupportedModel(f"{key} is not supported (transformers' yarn has no such parameter)")
    return scaling


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
