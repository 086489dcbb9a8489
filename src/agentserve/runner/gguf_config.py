"""A GGUF file's model config, read from its header alone (no torch: the comparison's
peer sizing reads it too): llama.cpp's `{general.architecture}.*` keys as a `ModelConfig`,
with what llama.cpp hard-codes for Gemma 3 (every sixth layer global, the others
sliding-window with RoPE base 10000, the attention scale from head_dim, or hidden /
heads for the 27B model)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType

from agentserve.runner.config import FULL, SLIDING, ModelConfig, UnsupportedModel
from agentserve.runner.gguf_file import GGUFFile, GGUFTensor


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
                         tokenizer=None) -> ModelConfig:
    """The config of a file's metadata and tensor index; `tokenizer` (its bos/eos ids) when loading."""
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
        bos_token_id=tokenizer.bos_token_id if tokenizer is not None else None,
        eos_token_ids=list(tokenizer.eos_token_ids) if tokenizer is not None else [],
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
