"""Hardware/model profiles: the numbers the cost model needs for one
(model, machine) pair.

A profile is a small JSON file. Bundled ones live in `profiles/` next to this
module and are derived from the roofline (see each file's "derivation" field);
the real model runner writes files with the same schema from measurements
(the CacheTTL paper's offline profile: a quadratic fit of prefill time against
context length, and the measured GPU<->host copy bandwidth).

Schema (all times in seconds, sizes in bytes or tokens):

    name, description, derivation           strings
    gpu, num_gpus                           optional: "" and 1
    model {name, num_layers, num_kv_heads, head_dim, hidden, params, dtype_bytes,
           num_global_layers, sliding_window}
                                            the last two optional: a model with sliding-window
                                            layers (Gemma 3) has num_global_layers < num_layers
                                            layers of full attention and the others attend to
                                            their last sliding_window positions; without them
                                            every layer is global (sliding_window 0)
    kv_bytes_per_token                      must equal 2*layers*kv_heads*head_dim*dtype_bytes
                                            (every layer's KV of a token: the full cache's)
    kv_capacity_tokens                      device KV pool, whole instance
    host_kv_capacity_tokens                 host DRAM KV pool (0: no host tier)
    host_copy_bandwidth_bytes_s             effective device<->host copy bandwidth
    host_copy_latency_s                     optional (0): fixed cost of one batch of copies
    disk_kv_capacity_bytes                  optional (2e12): the disk tier's byte budget (sim --disk-tier)
    disk_read_bandwidth_bytes_s             optional (3e9): SSD read bandwidth of the disk tier
    disk_write_bandwidth_bytes_s            optional (3e9): SSD write bandwidth of the disk tier
    max_num_batched_tokens, max_num_seqs    scheduler defaults
    step_overhead_s                         c of t(L) = a*L^2 + b*L + c: fixed cost of a step
    per_seq_overhead_s                      optional (0): extra cost per sequence beyond the first
    prefill_a_s_per_token2                  a: attention (quadratic) term, as if every layer were
                                            global (the cost model prices the window layers'
                                            share at their window)
    prefill_b_s_per_token                   b: linear-layer (per token) term
    decode_weight_read_s                    time to stream the weights once (memory floor of a step)
    kv_read_s_per_token                     time to read one token's KV (every layer's) from device
                                            memory (a window layer reads at most its window)
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["ModelSpec", "Profile", "ProfileError", "load_profile", "list_profiles", "profile_from_dict"]

_PROFILES_PACKAGE = "agentserve.cost"
_PROFILES_DIR = "profiles"


class ProfileError(ValueError):
    """A profile file is missing, unreadable or invalid."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    params: float
    dtype_bytes: int
    # layer kinds: layers of full attention (None: every layer), and the others' sliding window (0: none)
    num_global_layers: int | None = None
    sliding_window: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def global_layers(self) -> int:
        return self.num_layers if self.num_global_layers is None else self.num_global_layers

    @property
    def window_layers(self) -> int:
        """Layers that attend to their last `sliding_window` positions only."""
        return self.num_layers - self.global_layers

    @property
    def global_share(self) -> float:
        return self.global_layers / self.num_layers

    @property
    def has_hybrid_layout(self) -> bool:
        """Both kinds of layer: the hybrid KV cache applies (kv/window_parts.py)."""
        return self.window_layers > 0 and self.global_layers > 0

    @property
    def window_pages(self) -> int:
        """Blocks a block's window part takes in the hybrid cache, whose blocks
        hold the global layers' count of layers (as runner/kv_cache.py lays it out)."""
        if not self.has_hybrid_layout:
            raise ValueError(f"model {self.name} has no hybrid KV layout: it needs both global and window layers")
        return -(-self.window_layers // self.global_layers)

    def hybrid_num_blocks(self, kv_tokens: int, block_size: int) -> int:
        """Blocks of the hybrid cache in the bytes of `kv_tokens` tokens of the
        full cache: a block holds `global_layers` layers, so there are
        num_layers / global_layers times more."""
        if not self.has_hybrid_layout:
            raise ValueError(f"model {self.name} has no hybrid KV layout: it needs both global and window layers")
        return kv_tokens * self.num_layers // (self.global_layers * _check_block_size(block_size))

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    derivation: str
    model: ModelSpec
    kv_bytes_per_token: int
    kv_capacity_tokens: int
    host_kv_capacity_tokens: int
    host_copy_bandwidth_bytes_s: float
    max_num_batched_tokens: int
    max_num_seqs: int
    step_overhead_s: float
    prefill_a_s_per_token2: float
    prefill_b_s_per_token: float
    decode_weight_read_s: float
    kv_read_s_per_token: float
    # optional
    per_seq_overhead_s: float = 0.0
    host_copy_latency_s: float = 0.0
    # the disk tier below the host tier (an NVMe SSD): used with `agentserve sim --disk-tier`
    disk_kv_capacity_bytes: float = 2e12
    disk_read_bandwidth_bytes_s: float = 3e9
    disk_write_bandwidth_bytes_s: float = 3e9
    gpu: str = ""
    num_gpus: int = 1

    def num_blocks(self, block_size: int) -> int:
        """Device KV capacity in whole blocks of `block_size` tokens."""
        return self.kv_capacity_tokens // _check_block_size(block_size)

    def host_num_blocks(self, block_size: int) -> int:
        """Host KV capacity in whole blocks of `block_size` tokens."""
        return self.host_kv_capacity_tokens // _check_block_size(block_size)

    def disk_num_blocks(self, block_size: int) -> int:
        """Disk-tier capacity in whole blocks of `block_size` tokens."""
        return int(self.disk_kv_capacity_bytes // self.block_bytes(block_size))

    def block_bytes(self, block_size: int) -> int:
        return self.kv_bytes_per_token * _check_block_size(block_size)

    def to_dict(self) -> dict[str, Any]:
        """The JSON schema form (what `load_profile` reads); a model of global
        layers only is written without the layer-kind fields, as before them."""
        data = asdict(self)
        if self.model.num_global_layers is None:
            del data["model"]["num_global_layers"]
        if not self.model.sliding_window:
            del data["model"]["sliding_window"]
        return data

    def dump(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def _check_block_size(block_size: int) -> int:
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    return block_size


# kinds: "str", "int" (>= 0), "pos_int" (> 0), "num" (>= 0), "pos_num" (> 0), "model"
_MODEL_FIELDS: dict[str, str] = {
    "name": "str", "num_layers": "pos_int", "num_kv_heads": "pos_int", "head_dim": "pos_int",
    "hidden": "pos_int", "params": "pos_num", "dtype_bytes": "pos_int",
}
_MODEL_OPTIONAL: dict[str, str] = {"num_global_layers": "int", "sliding_window": "int"}
_PROFILE_FIELDS: dict[str, tuple[str, bool]] = {
    "name": ("str", True),
    "description": ("str", True),
    "derivation": ("str", True),
    "model": ("model", True),
    "kv_bytes_per_token": ("pos_int", True),
    "kv_capacity_tokens": ("pos_int", True),
    "host_kv_capacity_tokens": ("int", True),
    "host_copy_bandwidth_bytes_s": ("pos_num", True),
    "max_num_batched_tokens": ("pos_int", True),
    "max_num_seqs": ("pos_int", True),
    "step_overhead_s": ("num", True),
    "prefill_a_s_per_token2": ("num", True),
    "prefill_b_s_per_token": ("pos_num", True),
    "decode_weight_read_s": ("num", True),
    "kv_read_s_per_token": ("num", True),
    "per_seq_overhead_s": ("num", False),
    "host_copy_latency_s": ("num", False),
    "disk_kv_capacity_bytes": ("num", False),
    "disk_read_bandwidth_bytes_s": ("pos_num", False),
    "disk_write_bandwidth_bytes_s": ("pos_num", False),
    "gpu": ("str", False),
    "num_gpus": ("pos_int", False),
}
assert set(_PROFILE_FIELDS) == {f.name for f in fields(Profile)}


def _coerce(src: str, key: str, value: Any, kind: str) -> Any:
    if kind == "str":
        if not isinstance(value, str):
            raise ProfileError(f"profile {src}: field {key!r} must be a string, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"profile {src}: field {key!r} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ProfileError(f"profile {src}: field {key!r} must be finite, got {value!r}")
    if kind in ("int", "pos_int"):
        if float(value) != int(value):
            raise ProfileError(f"profile {src}: field {key!r} must be an integer, got {value!r}")
        value = int(value)
    else:
        value = float(value)
    if kind.startswith("pos") and value <= 0:
        raise ProfileError(f"profile {src}: field {key!r} must be > 0, got {value!r}")
    if value < 0:
        raise ProfileError(f"profile {src}: field {key!r} must be >= 0, got {value!r}")
    return value


def profile_from_dict(data: dict[str, Any], source: str = "<dict>") -> Profile:
    """Validate a parsed profile and build a `Profile`. Errors name the field."""
    if not isinstance(data, dict):
        raise ProfileError(f"profile {source}: expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_PROFILE_FIELDS))
    if unknown:
        raise ProfileError(f"profile {source}: unknown field(s) {', '.join(map(repr, unknown))}")
    missing = [k for k, (_, req) in _PROFILE_FIELDS.items() if req and k not in data]
    if missing:
        raise ProfileError(f"profile {source}: missing field(s) {', '.join(map(repr, missing))}")

    kwargs: dict[str, Any] = {}
    for key, (kind, _) in _PROFILE_FIELDS.items():
        if key not in data:
            continue
        if kind == "model":
            kwargs[key] = _model_from_dict(data[key], source)
        else:
            kwargs[key] = _coerce(source, key, data[key], kind)
    profile = Profile(**kwargs)

    expected = profile.model.kv_bytes_per_token
    if profile.kv_bytes_per_token != expected:
        raise ProfileError(
            f"profile {source}: field 'kv_bytes_per_token' is {profile.kv_bytes_per_token}, but the model "
            f"gives 2*num_layers*num_kv_heads*head_dim*dtype_bytes = {expected}")
    return profile


def _model_from_dict(data: Any, source: str) -> ModelSpec:
    if not isinstance(data, dict):
        raise ProfileError(f"profile {source}: field 'model' must be an object, got {data!r}")
    unknown = sorted(set(data) - set(_MODEL_FIELDS) - set(_MODEL_OPTIONAL))
    if unknown:
        raise ProfileError(f"profile {source}: unknown field(s) {', '.join('model.' + k for k in unknown)}")
    missing = [k for k in _MODEL_FIELDS if k not in data]
    if missing:
        raise ProfileError(f"profile {source}: missing field(s) {', '.join(repr('model.' + k) for k in missing)}")
    kinds = {**_MODEL_FIELDS, **_MODEL_OPTIONAL}
    spec = ModelSpec(**{k: _coerce(source, "model." + k, data[k], kind) for k, kind in kinds.items() if k in data})
    if spec.global_layers > spec.num_layers:
        raise ProfileError(f"profile {source}: field 'model.num_global_layers' is {spec.global_layers}, more than "
                           f"the model's {spec.num_layers} layers")
    if (spec.window_layers > 0) != (spec.sliding_window > 0):
        raise ProfileError(f"profile {source}: 'model.sliding_window' ({spec.sliding_window}) must be given, > 0, "
                           f"exactly when some layers are not global ({spec.window_layers} of {spec.num_layers})")
    return spec


def _bundled_dir():
    return resources.files(_PROFILES_PACKAGE).joinpath(_PROFILES_DIR)


def list_profiles() -> list[str]:
    """Names of the bundled profiles (usable with `load_profile`)."""
    return sorted(p.name[:-5] for p in _bundled_dir().iterdir() if p.name.endswith(".json"))


def load_profile(name_or_path: "str | os.PathLike[str] | Profile") -> Profile:
    """Load a bundled profile by name (e.g. "llama3.1-8b-h100") or a JSON file by path."""
    if isinstance(name_or_path, Profile):
        return name_or_path
    text_id = os.fspath(name_or_path)
    looks_like_path = (isinstance(name_or_path, os.PathLike) or os.sep in text_id
                       or (os.altsep is not None and os.altsep in text_id) or os.path.exists(text_id))
    if looks_like_path:
        path = Path(text_id)
        if not path.is_file():
            raise ProfileError(f"profile file not found: {text_id}")
        try:
            raw = path.read_text()
        except OSError as exc:
            raise ProfileError(f"profile {text_id}: cannot read: {exc}") from exc
        source = text_id
    else:
        name = text_id[:-5] if text_id.endswith(".json") else text_id
        entry = _bundled_dir().joinpath(name + ".json")
        if not entry.is_file():
            raise ProfileError(f"unknown profile {text_id!r}; bundled profiles: {', '.join(list_profiles())}")
        raw = entry.read_text()
        source = name
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"profile {source}: invalid JSON: {exc}") from exc
    return profile_from_dict(data, source)
