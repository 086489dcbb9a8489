"""What a loader hands the runner: `LoadedModel` (config, Hugging Face-named
weights, tokenizer, chat template), and `check_weights`, which both loaders
(`gguf_loader.py`, `safetensors_loader.py`) run so that a checkpoint the
runner cannot run as its architecture (a missing projection, a norm or bias
that architecture does not have, a wrong shape) fails at load with a one-line
error, not later as a KeyError or garbage text."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentserve.runner.config import ModelConfig
from agentserve.runner.quant import QuantWeight
from agentserve.runner.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    config: ModelConfig
    # Hugging Face Llama names, e.g. model.layers.0.self_attn.q_proj.weight; float32
    # tensors, or quant.Q4Weight/Q8Weight for Q4_0/Q4_1/Q8_0 tensors of a GGUF loaded with keep_quantized
    weights: dict[str, "torch.Tensor | QuantWeight"]
    tokenizer: Tokenizer
    chat_template: str | None
    source: str  # the file or folder it came from
    tensor_types: tuple[str, ...] = ()  # a GGUF's tensor types (F32, Q4_1, ...); empty for safetensors



def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the runner reads for the config's architecture, with its [out, in] shape."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv, d = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        if cfg.gemma:
            shapes.update({p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)})
    return shapes


def _optional_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """q/k/v biases (Qwen2's attention, which always has them); the runner uses
    them when present. No other architecture has them: there they are refused."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out: dict[str, tuple[int, ...]] = {}
    if cfg.arch != "qwen2":
        return out
    for n in range(cfg.num_layers):
        a = f"model.layers.{n}.self_attn."
        out.update({a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)})
    return out


def check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], source: str) -> None:
    """Raise ValueError naming the first problem: a missing, unknown or misshapen weight."""
    required, optional = expected_shapes(cfg), _optional_shapes(cfg)
    missing = [n for n in required if n not in weights]
    if missing:
        raise ValueError(f"{source}: missing {len(missing)} weight(s), first {missing[0]}")
    unknown = [n for n in weights if n not in required and n not in optional]
    if unknown:
        raise ValueError(f"{source}: unexpected weight {unknown[0]} "
                         f"({len(unknown)} in all; not the {cfg.arch} layout this runner knows)")
    for name, tensor in weights.items():
        want = required.get(name) or optional[name]
        if tuple(tensor.shape) != want:
            raise ValueError(f"{source}: {name} has shape {tuple(tensor.shape)}, config implies {want}")
    # The runner fuses q/k/v biases, so a layer has all three or none.
    for n in range(cfg.num_layers):
        have = [f"model.layers.{n}.self_attn.{x}_proj.bias" in weights for x in "qkv"]
        if any(have) and not all(have):
            raise ValueError(f"{source}: layer {n} has some but not all of the q/k/v biases")
