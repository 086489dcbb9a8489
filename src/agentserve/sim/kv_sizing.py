"""What a simulated engine's KV is sized as: the layout a run's `SimConfig`
asks for on its profile (hybrid or full, as `serve --kv-layout` chooses), the
device blocks of each replica in it, and the model's attention shape for the
step-time model."""

from __future__ import annotations

from agentserve.cost.profile import load_profile
from agentserve.engine.attention_shape import FULL, AttentionShape

KV_LAYOUTS = ("auto", "hybrid", "full")


def kv_layout(cfg) -> str:
    """The layout `cfg.kv_layout` asks for on its profile: hybrid or full
    (auto: hybrid where the model has both kinds of layer and no disk tier is used, as `serve`).
    ValueError, in one line, where hybrid cannot apply."""
    if cfg.kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv layout must be one of {', '.join(KV_LAYOUTS)}, not {cfg.kv_layout!r}")
    if cfg.kv_layout == "full":
        return "full"
    model = load_profile(cfg.profile).model
    if cfg.kv_layout == "auto":
        return "hybrid" if model.has_hybrid_layout and not cfg.disk_tier else "full"
    if not model.has_hybrid_layout:
        raise ValueError(f"kv layout hybrid needs a model with both global and sliding-window layers; profile "
                         f"{cfg.profile}'s {model.name} has {model.global_layers} global of {model.num_layers}")
    if cfg.disk_tier:
        raise ValueError("kv layout hybrid has no disk KV tier (a host tier it has): drop the disk tier or use "
                         "the full layout")
    return "hybrid"



def attention_shape(model) -> AttentionShape:
    """The model's layers by attention, as the server gives its step-time model."""
    if not model.window_layers:
        return FULL
    return AttentionShape(model.global_share, model.sliding_window)


def replica_blocks(cfg, replicas: int) -> int:
    """Device KV blocks of each replica: `kv_tokens` is the total, split evenly
    (so runs with different replica counts compare at the same total KV);
    without it every replica has the profile's (one more GPU each). Tokens
    are the full cache's: the hybrid layout has the same bytes in more,
    smaller blocks."""
    profile = load_profile(cfg.profile)
    tokens = cfg.kv_tokens // replicas if cfg.kv_tokens else profile.kv_capacity_tokens
    if kv_layout(cfg) == "hybrid":
        return profile.model.hybrid_num_blocks(tokens, cfg.block_size)
    return tokens // cfg.block_size
