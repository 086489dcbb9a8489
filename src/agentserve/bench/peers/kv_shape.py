"""The model a comparison serves, as the peers must be sized for it: its KV
shape read from the GGUF header (`ModelShape`, `model_shape`), its KV bytes a
token, the KV capacity each server is given in its own units (vLLM's bytes,
llama-server's cells with its window caches), and the token counts every
server holds exactly (`check_kv_tokens`). bench/peers/specs.py builds the
servers' command lines from them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GiB = 2**30


class PeerServerError(RuntimeError):
    """A server could not be set up, started, or did not answer in time."""


MODEL_NAME = "smollm2-135m-instruct"  # what every server is told to answer to (the default model)
# --model: agentserve's short names (runner/model_names.py); each server answers to its served name,
# vLLM serves the folder converted from the same GGUF (install_vllm.sh --model NAME writes it)
MODELS = ("smollm2", "gemma3-270m")
DEFAULT_MODEL = "smollm2"
SERVED_NAMES = {"smollm2": MODEL_NAME, "gemma3-270m": "gemma-3-270m"}
HF_DIRS = {"smollm2": "smollm2-hf", "gemma3-270m": "gemma3-270m-hf"}
# llama-server's chat format where the GGUF has no template (the Gemma 3 base file): its built-in
# template of the family (with --no-jinja: to its jinja engine the name would be a literal template
# that renders "gemma"), as agentserve falls back to the family's turn format
LLAMASERVER_CHAT_TEMPLATE = {"gemma3-270m": "gemma"}
LLAMASERVER_SLOTS = 8  # --parallel
LLAMASERVER_UBATCH = 512  # --ubatch-size (its default, passed so the window cache's size is fixed)
MiB = 2**20

# SmolLM2-135M-Instruct (from the GGUF's metadata; model_shape reads any model's).
NUM_LAYERS = 30
NUM_KV_HEADS = 3
HEAD_DIM = 64
MODEL_MAX_LEN = 8192
KV_DTYPE_BYTES = 2  # bf16 (agentserve, vLLM) / f16 (llama.cpp)

AGENTSERVE_BLOCK_TOKENS = 16
VLLM_BLOCK_TOKENS = 128  # vLLM's CPU default, passed explicitly
VLLM_BLOCK_CHOICES = (16, 32, 64, 128)  # block sizes vLLM-CPU takes (below 32 it warns); all divide KV_TOKENS_MULTIPLE
LLAMACPP_CTX_PAD = 256
KV_TOKENS_MULTIPLE = 256  # a multiple of all three


def kv_bytes_per_token(num_layers: int = NUM_LAYERS, num_kv_heads: int = NUM_KV_HEADS, head_dim: int = HEAD_DIM,
                       dtype_bytes: int = KV_DTYPE_BYTES) -> int:
    """K and V, every layer: 2 * 30 * 3 * 64 * 2 = 23,040 bytes for SmolLM2-135M in 16 bits."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def vllm_kv_cache_bytes(kv_tokens: int, per_token: int | None = None, block: int = VLLM_BLOCK_TOKENS) -> int:
    """The bytes vLLM is given so that kv_tokens are usable: one block (of
    `block` tokens) more, for the null block its block pool never hands out
    (per_token: the model's KV bytes a token, default SmolLM2's)."""
    return (kv_tokens + block) * (per_token or kv_bytes_per_token())


def vllm_kvcache_space_gib(kv_tokens: int, per_token: int | None = None, block: int = VLLM_BLOCK_TOKENS) -> int:
    """The whole-GiB VLLM_CPU_KVCACHE_SPACE that holds kv_tokens (rounded up,
    so it holds more: the reason the registry passes bytes instead)."""
    return -(-vllm_kv_cache_bytes(kv_tokens, per_token, block) // GiB)


@dataclass(frozen=True)
class ModelShape:
    """What the comparison needs of a model, read from its GGUF's header."""
    name: str                   # agentserve's short name (`serve --model NAME`)
    gguf: Path                  # the one file every server serves
    arch: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    context: int                # the model's own context (tokens)
    vocab_size: int
    sliding_window: int | None  # tokens a window layer attends to; None: no window layers
    window_layers: int          # layers with that window (the others are global)
    end_token_ids: tuple[int, ...]  # end of text / turn: kept from being sampled where a server has no ignore_eos

    @property
    def served_name(self) -> str:
        return SERVED_NAMES.get(self.name, self.name)

    def kv_bytes_per_token(self, dtype_bytes: int = KV_DTYPE_BYTES) -> int:
        """Every layer's K and V of one token."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, dtype_bytes)


def shape_from_gguf(name: str, path: Path) -> ModelShape:
    """A model's KV shape from its GGUF header, read as the runner reads it (a model the runner
    refuses is refused here too)."""
    from agentserve.runner.gguf_config import config_from_metadata, open_gguf, read_metadata

    try:
        f = open_gguf(path)
        meta = read_metadata(f)
        cfg = config_from_metadata(meta, {t.name: t for t in f.tensors})
    except (OSError, ValueError) as e:  # UnsupportedModel is a ValueError
        raise PeerServerError(f"{path}: {e}") from None
    ends = {meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                  "tokenizer.ggml.padding_token_id")} - {None}
    tokens = meta.get("tokenizer.ggml.tokens") or []
    ends |= {i for i, t in enumerate(tokens[:1024]) if t in ("<end_of_turn>", "<|endoftext|>", "<|im_end|>", "<|im_start|>")}
    window_layers = sum(1 for i in range(cfg.num_layers) if cfg.is_sliding(i))
    return ModelShape(name=name, gguf=Path(path), arch=cfg.arch, num_layers=cfg.num_layers,
                      num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, context=cfg.max_position_embeddings,
                      vocab_size=cfg.vocab_size, sliding_window=cfg.sliding_window if window_layers else None,
                      window_layers=window_layers, end_token_ids=tuple(sorted(int(i) for i in ends)))


def model_shape(name: str = DEFAULT_MODEL) -> ModelShape:
    """The shape of short name `name` (one of MODELS), from its installed GGUF (read once a process)."""
    from agentserve.runner import model_names

    entry = model_names.find(name)
    if entry is None or entry.name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    if entry.name not in _SHAPES:
        try:
            path = entry.path()
        except FileNotFoundError as e:  # ModelNotInstalled: the pip line that fixes it
            raise PeerServerError(str(e)) from None
        _SHAPES[entry.name] = shape_from_gguf(entry.name, path)
    return _SHAPES[entry.name]


_SHAPES: dict[str, ModelShape] = {}


def _pad256(n: int) -> int:
    return -(-n // LLAMACPP_CTX_PAD) * LLAMACPP_CTX_PAD


def llamaserver_cells(kv_tokens: int, shape: ModelShape, slots: int = LLAMASERVER_SLOTS,
                      ubatch: int = LLAMASERVER_UBATCH, unified: bool = True) -> tuple[int, int, bool]:
    """(--ctx-size, window layers' cells, swa_full) that give llama-server the bytes of kv_tokens
    tokens in every layer, as the docs' benchmarks page tells (swa_full: every layer keeps
    kv_tokens cells, where the window caches alone would not fit). unified: one buffer that every
    slot shares; else a buffer per slot (--no-kv-unified), each of --ctx-size / slots cells with
    its own window cache (the window cells returned are all slots' together)."""
    streams = 1 if unified else slots
    step = streams * LLAMACPP_CTX_PAD  # llama.cpp pads each stream's cells to LLAMACPP_CTX_PAD
    pad_down = lambda n: n // step * step  # noqa: E731
    if not shape.sliding_window or not shape.window_layers:
        return pad_down(kv_tokens), 0, False
    glob = shape.num_layers - shape.window_layers
    swa = _pad256(shape.sliding_window * (slots if unified else 1) + ubatch) * streams
    if glob == 0 or swa >= kv_tokens:
        return pad_down(kv_tokens), kv_tokens, True
    ctx = (kv_tokens * shape.num_layers - shape.window_layers * swa) // glob
    return pad_down(ctx), swa, False


def window_sequence_tokens(kv_tokens: int, shape: ModelShape, block: int = AGENTSERVE_BLOCK_TOKENS) -> int:
    """The longest sequence a hybrid cache holds in the bytes of kv_tokens tokens of every layer: on
    a model with sliding-window layers it keeps the global layers' KV of every token and the window
    layers' of the last window (and a block) only. agentserve's cache does, and vLLM's hybrid
    allocator (with its own block size), which checks at start that one sequence of its
    --max-model-len fits."""
    glob = shape.num_layers - shape.window_layers
    if not shape.sliding_window or not shape.window_layers or glob < 1:
        return kv_tokens
    return (kv_tokens * shape.num_layers - (shape.sliding_window + 2 * block) * shape.window_layers) // glob


def check_kv_tokens(kv_tokens: int) -> int:
    if isinstance(kv_tokens, bool) or not isinstance(kv_tokens, int) or kv_tokens <= 0:
        raise ValueError(f"kv_tokens must be a positive integer, got {kv_tokens!r}")
    if kv_tokens % KV_TOKENS_MULTIPLE:
        lo = kv_tokens // KV_TOKENS_MULTIPLE * KV_TOKENS_MULTIPLE
        raise ValueError(f"kv_tokens must be a multiple of {KV_TOKENS_MULTIPLE} so that every server holds exactly "
                         f"that many tokens (vLLM blocks of {VLLM_BLOCK_TOKENS}, llama.cpp pads n_ctx to "
                         f"{LLAMACPP_CTX_PAD}); got {kv_tokens}, try {lo or KV_TOKENS_MULTIPLE} or "
                         f"{lo + KV_TOKENS_MULTIPLE}")
    return kv_tokens
