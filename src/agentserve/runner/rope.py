"""Rotary position embeddings, rotate-half form (the Hugging Face Llama layout),
with the model's scaling (default, linear, llama3).

The cos/sin table is computed once for every position up to the model's
length, in float32 the same way transformers computes it, so that the float32
path reproduces transformers' logits bit for bit where the kernels allow."""

from __future__ import annotations

import math

import torch

from agentserve.runner.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind in (None, "default"):
        return inv
    if kind == "linear":
        return inv / float(sc["factor"])
    if kind == "llama3":
        return _llama3(inv, sc)
    raise ValueError(f"rope scaling {kind!r} is not supported (default, linear, llama3 are)")


def _llama3(inv: torch.Tensor, sc: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths are divided by
    `factor`, short ones kept, the band between interpolated smoothly."""
    factor = float(sc["factor"])
    low = float(sc.get("low_freq_factor", 1.0))
    high = float(sc.get("high_freq_factor", 4.0))
    old_len = float(sc.get("original_max_position_embeddings", 8192))
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


class RotaryTable:
    """cos/sin for positions [0, max_positions), in the compute dtype."""

    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        inv = inv_frequencies(cfg)
        pos = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = pos[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = emb.sin().to(dtype=dtype, device=device)
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> cos, sin of shape [T, 1, head_dim] (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
