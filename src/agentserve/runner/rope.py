"""Rotary position embeddings, rotate-half form (the Hugging Face Llama layout),
with the model's scaling: default, linear, llama3, yarn and dynamic.

The cos/sin table is computed once for every position up to the model's
length, in float32 the same way transformers computes it (yarn's attention
factor multiplied into cos and sin before the cast), so that the float32 path
reproduces transformers' rotations bit for bit.

`dynamic` (NTK) scaling changes the frequencies once a sequence grows past
`max_position_embeddings`, and transformers then keeps the keys already cached
under the old ones: what a position gets depends on the history of the batch,
which no fixed table can reproduce. Below that length it is exactly the default
table, so a dynamic model is served with positions capped there (a longer
table is refused)."""

from __future__ import annotations

import math
from typing import Any

import torch

from agentserve.runner.config import ModelConfig, UnsupportedModel


def rope_parameters(theta: float, scaling: dict[str, Any] | None, head_dim: int,
                    max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim/2] float32, attention factor for cos/sin)."""
    sc = scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default")) or "default"
    d = head_dim
    if kind == "dynamic":
        # transformers' NTK base at the initial length (max_position_embeddings): equal to
        # theta up to the rounding of this very expression, which is kept
        factor, length = float(sc["factor"]), max_position_embeddings
        theta = theta * ((factor * length / max_position_embeddings) - (factor - 1)) ** (d / (d - 2))
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if kind in ("default", "dynamic"):
        return inv, 1.0
    if kind == "linear":
        return inv / float(sc["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv, sc, max_position_embeddings), 1.0
    if kind == "yarn":
        return _yarn(theta, sc, d, max_position_embeddings)
    raise UnsupportedModel(f"rope scaling {kind!r} is not supported (default, linear, llama3, yarn, dynamic are)")


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """The full-attention layers' inverse frequencies."""
    return rope_parameters(cfg.rope_theta, cfg.rope_scaling, cfg.head_dim, cfg.max_position_embeddings)[0]


def _llama3(inv: torch.Tensor, sc: dict, max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths are divided by
    `factor`, short ones kept, the band between interpolated smoothly."""
    factor = float(sc["factor"])
    low = float(sc.get("low_freq_factor", 1.0))
    high = float(sc.get("high_freq_factor", 4.0))
    old_len = float(sc.get("original_max_position_embeddings") or max_position_embeddings)
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


def _yarn(theta: float, sc: dict, d: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """YaRN: per dimension, interpolated (divided by `factor`) where a frequency
    turns fewer than `beta_slow` times over the original context, extrapolated
    (kept) above `beta_fast` turns, a linear ramp between; cos and sin are then
    scaled by the attention factor (0.1 ln(factor) + 1 unless given)."""
    original = sc.get("original_max_position_embeddings") or max_position_embeddings
    factor = sc.get("factor")
    if factor is None:
        factor = max_position_embeddings / original
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = sc.get("attention_factor")
    if attention is None:
        m, m_all = sc.get("mscale"), sc.get("mscale_all_dim")
        attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast = sc.get("beta_fast") or 32
    beta_slow = sc.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (d * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # the ramp would divide by zero
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, d, 2).to(dtype=torch.float) / d)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


class RotaryTable:
    """cos/sin for positions [0, max_positions), in the compute dtype. `local`:
    the table of sliding-window layers where their RoPE differs (Gemma 3)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device,
                 local: bool = False) -> None:
        theta, scaling = (cfg.local_rope_theta, cfg.local_rope_scaling) if local else (cfg.rope_theta,
                                                                                       cfg.rope_scaling)
        kind = (scaling or {}).get("rope_type")
        if kind == "dynamic" and max_positions > cfg.max_position_embeddings:
            raise UnsupportedModel(
                f"dynamic RoPE scaling changes with the sequence length past {cfg.max_position_embeddings} "
                f"positions and cannot be served exactly there (asked for {max_positions}); "
                f"serve at most {cfg.max_position_embeddings} tokens")
        inv, attention = rope_parameters(theta, scaling, cfg.head_dim, cfg.max_position_embeddings)
        pos = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = pos[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * attention).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * attention).to(dtype=dtype, device=device)
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> cos, sin of shape [T, 1, head_dim] (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
