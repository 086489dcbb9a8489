"""The shape of a decoder the runner serves (Llama, Mistral, Qwen2, Qwen3,
Gemma 3): what the loaders produce and the model reads.

`ModelConfig.from_hf` reads a Hugging Face `config.json` the way transformers'
config classes do (their defaults where a field is absent) and refuses, with
one line, any field whose value the runner would otherwise ignore (a logit
soft-cap, a partial rotary, a bias it does not load, an unknown RoPE type, ...):
such a model is never served wrong."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("gemma3", "llama", "mistral", "qwen2", "qwen3")
FULL, SLIDING = "full_attention", "sliding_attention"

# Keys each RoPE type may carry (transformers' validation lists); any other key
# would be ignored, so a config naming one is refused.
_ROPE_KEYS: dict[str, set[str]] = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "llama3": {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "truncate"},
}
_ROPE_COMMON = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}

# transformers' config-class defaults for fields a config.json may leave out
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048, tie=False, act="silu"),
    "mistral": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096 * 32, tie=False,
                    act="silu"),
    "qwen2": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768, tie=False, act="silu"),
    "qwen3": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768, tie=False, act="silu",
                  head_dim=128),
    "gemma3": dict(rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=131072, tie=True,
                   act="gelu_pytorch_tanh", head_dim=256),
}


class UnsupportedModel(ValueError):
    """A checkpoint or config the runner cannot serve exactly."""


@dataclass
class ModelConfig:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope_scaling dict ({"rope_type": "llama3", "factor": ..., ...}) or None
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = "llama"
    arch: str = "llama"  # one of SUPPORTED_ARCHITECTURES
    # attention window W of sliding layers: a query at p sees keys p-W < j <= p; None: no window
    sliding_window: int | None = None
    # FULL or SLIDING per layer; None: every layer sliding when sliding_window is set (Mistral), else full
    layer_types: list[str] | None = None
    # RoPE base and scaling of sliding layers where they differ from full layers' (Gemma 3's local base)
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    # the attention scale is query_pre_attn_scalar ** -0.5 (Gemma); None: head_dim ** -0.5
    query_pre_attn_scalar: float | None = None

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(f"architecture {self.arch!r} is not supported "
                                   f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise UnsupportedModel(f"layer_types names {len(self.layer_types)} layers, the model has "
                                       f"{self.num_layers}")
            bad = sorted(set(self.layer_types) - {FULL, SLIDING})
            if bad:
                raise UnsupportedModel(f"layer type {bad[0]!r} is not supported ({FULL}, {SLIDING} are)")
            if SLIDING in self.layer_types and self.sliding_window is None:
                raise UnsupportedModel("sliding_attention layers need a sliding_window")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise UnsupportedModel(f"sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    # Gemma 3's layer: RMSNorm as x * (1 + w), the attention and MLP outputs
    # normed before their residual adds, GeGLU (tanh GELU), embeddings scaled by sqrt(hidden)
    @property
    def gemma(self) -> bool:
        return self.arch == "gemma3"

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)."""
        return self.arch in ("qwen3", "gemma3")

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_sliding(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == SLIDING

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.is_sliding(layer) else None

    def layer_rope(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """(RoPE base, scaling) of a layer."""
        if self.local_rope_theta is not None and self.is_sliding(layer):
            return self.local_rope_theta, self.local_rope_scaling
        return self.rope_theta, self.rope_scaling

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        norms = (4 if self.gemma else 2) * h + (2 * self.head_dim if self.qk_norm else 0)
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + norms
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str = "llama") -> "ModelConfig":
        """From a Hugging Face `config.json` dict. A config without model_type is
        read as Llama's; an architecture or field the runner cannot honour raises
        UnsupportedModel with one line."""
        arch = cfg.get("model_type") or "llama"
        if arch == "gemma3":
            raise UnsupportedModel(
                "Gemma 3 multimodal checkpoints (model_type gemma3, Gemma3ForConditionalGeneration) are not "
                "supported: use a text-only gemma3_text checkpoint (e.g. gemma-3-1b, gemma-3-270m) or a GGUF")
        if arch == "gemma3_text":
            arch = "gemma3"
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(f"model_type {arch!r} is not supported "
                                   f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        d = _DEFAULTS[arch]
        _refuse_ignored_fields(cfg, arch, d["act"])
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        max_pos = cfg.get("max_position_embeddings") or d["max_position_embeddings"]
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        extra: dict[str, Any] = {}
        theta, scaling = _rope(cfg, arch, d["rope_theta"])
        if arch == "mistral":
            extra["sliding_window"] = cfg.get("sliding_window", 4096)  # MistralConfig's default when absent
        elif arch == "gemma3":
            extra.update(_gemma3_fields(cfg))
            theta, scaling, extra["local_rope_theta"], extra["local_rope_scaling"] = _gemma3_rope(cfg)
        return cls(
            num_layers=cfg["num_hidden_layers"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            vocab_size=cfg["vocab_size"],
            # Qwen3's and Gemma 3's head_dim is a declared field (128, 256 by default), never hidden/heads
            head_dim=cfg.get("head_dim") or d.get("head_dim", 0),
            rms_norm_eps=cfg.get("rms_norm_eps", d["rms_norm_eps"]),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", d["tie"])),
            max_position_embeddings=max_pos,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
            arch=arch,
            **extra,
        )


def _refuse_ignored_fields(cfg: dict[str, Any], arch: str, act: str) -> None:
    """One line for the first field whose value the runner would not honour."""
    def refuse(what: str) -> None:
        raise UnsupportedModel(f"{arch} config: {what} is not supported (the runner would ignore it)")

    got_act = cfg.get("hidden_activation" if arch == "gemma3" else "hidden_act") or act
    if got_act != act:
        refuse(f"activation {got_act!r} (expected {act!r})")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            refuse(f"{key} = {cfg[key]}")
    # Qwen2 always has q/k/v biases (and loads them); the others have none unless attention_bias says so
    if arch != "qwen2" and cfg.get("attention_bias"):
        refuse("attention_bias true")
    if cfg.get("mlp_bias"):
        refuse("mlp_bias true")
    if cfg.get("use_bidirectional_attention"):
        refuse("use_bidirectional_attention true")
    partial = cfg.get("partial_rotary_factor")
    if partial not in (None, 1, 1.0):
        refuse(f"partial_rotary_factor {partial}")
    if arch in ("qwen2", "qwen3"):
        if cfg.get("use_sliding_window"):
            refuse("use_sliding_window true")
        if SLIDING in (cfg.get("layer_types") or []):
            refuse("a sliding_attention layer type")
    if arch in ("llama", "mistral") and cfg.get("pretraining_tp", 1) not in (None, 1):
        refuse(f"pretraining_tp {cfg['pretraining_tp']}")


def _rope_dict(raw: Any, where: str) -> dict[str, Any]:
    """A rope_scaling / rope_parameters dict checked for keys its type does not use."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UnsupportedModel(f"{where} must be an object, got {raw!r}")
    rope = dict(raw)
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    if kind not in _ROPE_KEYS:
        raise UnsupportedModel(f"RoPE type {kind!r} is not supported ({', '.join(_ROPE_KEYS)} are)")
    partial = rope.get("partial_rotary_factor")
    if partial not in (None, 1, 1.0):
        raise UnsupportedModel(f"partial_rotary_factor {partial} is not supported (the runner rotates whole heads)")
    unknown = sorted(set(rope) - _ROPE_COMMON - _ROPE_KEYS[kind])
    if unknown:
        raise UnsupportedModel(f"{where}: key {unknown[0]!r} is not supported for RoPE type {kind!r}")
    if kind != "default" and rope.get("factor") is None and kind != "yarn":
        raise UnsupportedModel(f"{where}: RoPE type {kind!r} needs a factor")
    rope["rope_type"] = kind
    rope.pop("type", None)
    return rope


def _rope(cfg: dict[str, Any], arch: str, default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """(base, scaling or None) from transformers 4's rope_theta + rope_scaling or
    transformers 5's rope_parameters (which holds both)."""
    if arch == "gemma3":
        return default_theta, None  # per layer type: _gemma3_rope
    rope = _rope_dict(cfg.get("rope_scaling") or cfg.get("rope_parameters"), "rope_scaling")
    theta = rope.pop("rope_theta", None) or cfg.get("rope_theta") or default_theta
    return float(theta), _scaling(rope, cfg)


def _scaling(rope: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any] | None:
    rope = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if rope.get("rope_type", "default") == "default":
        return None
    # transformers fills the pretraining length from the config where a scaling type needs it
    if rope["rope_type"] in ("llama3", "yarn") and rope.get("original_max_position_embeddings") is None:
        rope["original_max_position_embeddings"] = cfg.get("original_max_position_embeddings") or \
            cfg.get("max_position_embeddings")
    return rope


def _gemma3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's window, per-layer kinds (`layer_types`, or older configs'
    `sliding_window_pattern`: every n-th layer full, default 6) and attention scale."""
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern") or 6
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    window = cfg.get("sliding_window")
    if window is None and SLIDING in types:
        window = 4096  # Gemma3TextConfig's default
    return dict(layer_types=list(types), sliding_window=window,
                query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256))


def _gemma3_rope(cfg: dict[str, Any]) -> tuple[float, dict | None, float, dict | None]:
    """(full theta, full scaling, sliding theta, sliding scaling): transformers 5
    nests rope_parameters by layer type; older configs give rope_theta,
    rope_local_base_freq and a rope_scaling that applies to full layers only."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        full = _rope_dict(params.get(FULL), f"rope_parameters.{FULL}")
        local = _rope_dict(params.get(SLIDING), f"rope_parameters.{SLIDING}")
    else:
        full = _rope_dict(cfg.get("rope_scaling") or params, "rope_scaling")
        local = {}
    full_theta = full.pop("rope_theta", None) or cfg.get("rope_theta") or 1_000_000.0
    local_theta = local.pop("rope_theta", None) or cfg.get("rope_local_base_freq") or 10_000.0
    return float(full_theta), _scaling(full, cfg), float(local_theta), _scaling(local, cfg)
