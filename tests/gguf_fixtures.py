"""Build small GGUF files for loader tests, the way llama.cpp's converter would:
random Hugging Face-layout weights, q/k rows permuted for interleaved rope,
each tensor quantized to a chosen type, a byte-level BPE tokenizer in the
metadata. The returned `TinyGGUF` holds both the original weights and what a
correct loader must produce (the quantize -> dequantize round trip, un-permuted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from tokenizers import pre_tokenizers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "o Ġ", "Ġ w", "2 0", "Ġ 1"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): specials first (control, type 3), then the
    256 byte symbols and the merge results (normal, type 1)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merged = [m.replace(" ", "") for m in MERGES]
    tokens = SPECIAL_TOKENS + alphabet + merged
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(alphabet) + len(merged))
    return tokens, types, list(MERGES)


def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's HF->GGUF converter does to q/k rows: inside each head,
    the two rotate-half halves [2, head_dim/2] are transposed to [head_dim/2, 2]
    so that paired dimensions sit next to each other."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_freq_factors(head_dim: int, theta: float, factor: float, low: float, high: float,
                        original: int) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp writes for Llama 3.1-style rope scaling."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    out = np.where(wavelen < original / high, 1.0,
                   np.where(wavelen > original / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)


@dataclass
class TinyGGUF:
    path: Path
    arch: str
    n_layers: int
    hidden: int
    heads: int
    kv_heads: int
    inter: int
    vocab: int
    tied: bool
    original: dict[str, np.ndarray] = field(default_factory=dict)  # HF names and layout, float32
    expected: dict[str, np.ndarray] = field(default_factory=dict)   # what survives quantization
    qtypes: dict[str, Q] = field(default_factory=dict)               # HF name -> stored type


def default_qtype(hf_name: str, layer: int | None) -> Q:
    """A spread of storage types: norms F32 (as llama.cpp keeps them), the rest
    cycling through F16/BF16/Q8_0/Q4_0/Q4_1 so each layer mixes several."""
    if hf_name.endswith("norm.weight") or hf_name.endswith(".bias"):
        return Q.F32
    if layer is None:
        return Q.Q8_0
    cycle = [Q.F16, Q.Q8_0, Q.Q4_0, Q.BF16, Q.Q4_1]
    order = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    kind = next(i for i, o in enumerate(order) if o in hf_name)
    return cycle[(kind + layer) % len(cycle)]


def _hf_shapes(t: TinyGGUF, bias: bool) -> dict[str, tuple[tuple[int, ...], str, int | None]]:
    """HF name -> (shape, ggml name, layer)."""
    hd = t.hidden // t.heads
    q, kv = t.heads * hd, t.kv_heads * hd
    out = {"model.embed_tokens.weight": ((t.vocab, t.hidden), "token_embd.weight", None),
           "model.norm.weight": ((t.hidden,), "output_norm.weight", None)}
    if not t.tied:
        out["lm_head.weight"] = ((t.vocab, t.hidden), "output.weight", None)
    for i in range(t.n_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        parts = {
            "input_layernorm.weight": ((t.hidden,), "attn_norm.weight"),
            "post_attention_layernorm.weight": ((t.hidden,), "ffn_norm.weight"),
            "self_attn.q_proj.weight": ((q, t.hidden), "attn_q.weight"),
            "self_attn.k_proj.weight": ((kv, t.hidden), "attn_k.weight"),
            "self_attn.v_proj.weight": ((kv, t.hidden), "attn_v.weight"),
            "self_attn.o_proj.weight": ((t.hidden, q), "attn_output.weight"),
            "mlp.gate_proj.weight": ((t.inter, t.hidden), "ffn_gate.weight"),
            "mlp.up_proj.weight": ((t.inter, t.hidden), "ffn_up.weight"),
            "mlp.down_proj.weight": ((t.hidden, t.inter), "ffn_down.weight"),
        }
        if bias:
            parts.update({"self_attn.q_proj.bias": ((q,), "attn_q.bias"),
                          "self_attn.k_proj.bias": ((kv,), "attn_k.bias"),
                          "self_attn.v_proj.bias": ((kv,), "attn_v.bias")})
        out.update({p + k: (shape, b + g, i) for k, (shape, g) in parts.items()})
    return out


def _heads_for(hf_name: str, t: TinyGGUF) -> int | None:
    """How many heads a tensor's rows are permuted over (None: not permuted)."""
    if t.arch != "llama":
        return None
    if ".q_proj." in hf_name:
        return t.heads
    if ".k_proj." in hf_name:
        return t.kv_heads
    return None


def _store(values: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray]:
    """(bytes/array to write, what dequantizing it gives back)."""
    if qtype == Q.I8:  # an integer type no loader should accept as a weight
        stored = np.round(values).astype(np.int8)
        return stored, stored.astype(np.float32)
    if qtype in K_QUANT_SCALES:
        stored = _random_k_blocks(values.shape, qtype)
    else:
        stored = gguf.quants.quantize(values, qtype)
    return stored, gguf.quants.dequantize(stored, qtype).astype(np.float32).reshape(values.shape)


# gguf-py can read K-quants but not write them, so their blocks are random bytes
# with the float16 scale fields (byte offsets) set to sane values.
K_QUANT_SCALES = {Q.Q4_K: ((0, 0.01), (2, 0.005)), Q.Q6_K: ((208, 0.01),)}


def _random_k_blocks(shape: tuple[int, ...], qtype: Q) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    raw = np.random.default_rng(cols).integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset, scale in K_QUANT_SCALES[qtype]:
        raw[..., offset:offset + 2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    return raw.reshape(*shape[:-1], cols // block * size)


def write_tiny_gguf(path: Path, *, arch: str = "llama", n_layers: int = 2, hidden: int = 64, heads: int = 4,
                    kv_heads: int = 2, inter: int = 96, tied: bool = True, bias: bool = False,
                    qtypes: dict[str, Q] | None = None, pre: str = "smollm", rope_freqs: np.ndarray | None = None,
                    seed: int = 0, extra_metadata: dict | None = None) -> TinyGGUF:
    """Write a random tiny model to `path`; `qtypes` overrides the storage type per HF name."""
    tokens, types, merges = byte_level_vocab()
    t = TinyGGUF(Path(path), arch, n_layers, hidden, heads, kv_heads, inter, len(tokens), tied)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    _add_metadata(w, t, tokens, types, merges, pre)
    for key, value in (extra_metadata or {}).items():
        _add_value(w, key, value)
    for hf, (shape, ggml_name, layer) in _hf_shapes(t, bias).items():
        qtype = (qtypes or {}).get(hf, default_qtype(hf, layer))  # (F32 is 0: no `or` here)
        values = rng.standard_normal(shape).astype(np.float32)
        if hf.endswith("norm.weight"):
            values = 1.0 + 0.1 * values
        heads_n = _heads_for(hf, t)
        on_disk = llamacpp_permute(values, heads_n) if heads_n else values
        stored, back = _store(on_disk, qtype)
        t.expected[hf] = _unpermute_np(back, heads_n) if heads_n else back
        # random K-quant blocks have no float original: the dequantized values are it
        t.original[hf] = t.expected[hf] if qtype in K_QUANT_SCALES else values
        t.qtypes[hf] = qtype
        w.add_tensor(ggml_name, stored, raw_dtype=qtype if stored.dtype == np.uint8 else None)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return t


def _unpermute_np(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of `llamacpp_permute`, found by permuting the row indices (kept
    independent of the loader's own reshape-based version)."""
    index = llamacpp_permute(np.arange(w.shape[0]), n_heads)
    out = np.empty_like(w)
    out[index] = w
    return out


def _add_metadata(w: gguf.GGUFWriter, t: TinyGGUF, tokens: list[str], types: list[int],
                  merges: list[str], pre: str) -> None:
    a = t.arch
    w.add_string("general.name", "tiny test model")
    w.add_uint32(f"{a}.block_count", t.n_layers)
    w.add_uint32(f"{a}.context_length", 2048)
    w.add_uint32(f"{a}.embedding_length", t.hidden)
    w.add_uint32(f"{a}.feed_forward_length", t.inter)
    w.add_uint32(f"{a}.attention.head_count", t.heads)
    w.add_uint32(f"{a}.attention.head_count_kv", t.kv_heads)
    w.add_float32(f"{a}.rope.freq_base", 500000.0)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_uint32(f"{a}.rope.dimension_count", t.hidden // t.heads)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", pre)
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", SPECIAL_TOKENS.index("<|im_start|>"))
    w.add_uint32("tokenizer.ggml.eos_token_id", SPECIAL_TOKENS.index("<|im_end|>"))
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_string("tokenizer.chat_template", CHAT_TEMPLATE)


def _add_value(w: gguf.GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, value)


# --- SentencePiece vocabularies (tokenizer.ggml.model "llama") ------------------------

SPM_CORPUS = (
    "the quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs on and on. "
    "def main(args):\n    return [x * 2 for x in args if x is not None]\n"
    "Hello world, hello again: tokens, tokenizers and tokenization in the wild. "
    "Streaming text with spaces  and   runs of    spaces, tabs\tand newlines\n\nare common. "
    "Café, naïve, déjà vu. 日本語 中文 日本 文本 "
)
SPM_CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
SPM_USER = ["\n", "\n\n", "  ", "   ", "<think>", "</think>"]
_SPACE = "\u2581"


@dataclass
class SpmVocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]


def _train_pieces(corpus: str, n_merges: int) -> list[str]:
    """A tiny BPE trainer (most frequent adjacent pair first) over SentencePiece-
    style words (each word keeps the "▁" of the space before it): the merged
    pieces in the order they were learned."""
    text = corpus.replace(" ", _SPACE)
    words: dict[tuple[str, ...], int] = {}
    start = 0
    for i in range(1, len(text) + 1):
        if i == len(text) or text[i] == _SPACE:
            w = tuple(text[start:i])
            words[w] = words.get(w, 0) + 1
            start = i
    learned = []
    for _ in range(n_merges):
        pairs: dict[tuple[str, str], int] = {}
        for w, n in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + n
        if not pairs:
            break
        (a, b), _count = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        if (a + b).strip(_SPACE):  # runs of spaces are the user-defined tokens' business
            learned.append(a + b)
        merged = {}
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + n
        words = merged
    return learned


def spm_vocab(order: str = "scores", n_merges: int = 160, seed: int = 0) -> SpmVocab:
    """A SentencePiece vocabulary as llama.cpp writes one: control tokens, user-
    defined tokens (newline and space runs, `<think>`), the 256 byte pieces, the
    single characters of a corpus (most non-ASCII characters are left to byte
    fallback) and learned pieces. `order` says where the learned order lives:
    "scores" (Llama 2 style: pieces shuffled in the file, scores rank them, some
    tied) or "positions" (Gemma style: file order ranks them, scores disagree)."""
    rng = np.random.default_rng(seed)
    learned = _train_pieces(SPM_CORPUS, n_merges)
    chars = sorted({c for c in SPM_CORPUS.replace(" ", _SPACE) if ord(c) < 0x2600 or c in "日本" + _SPACE}
                   - {"\n", "\t"})
    tokens = SPM_CONTROL + SPM_USER + [f"<0x{b:02X}>" for b in range(256)] + chars
    types = [3] * len(SPM_CONTROL) + [4] * len(SPM_USER) + [6] * 256 + [1] * len(chars)
    scores = [0.0] * (len(SPM_CONTROL) + len(SPM_USER) + 256) + [-1000.0 - i for i in range(len(chars))]
    rank = np.arange(len(learned), dtype=np.float64)
    if order == "scores":
        perm = rng.permutation(len(learned))
        score_of = -rank
        score_of[5:15] = score_of[5]  # ties: broken by the longer left part, then file position
        tokens += [learned[i] for i in perm]
        scores += [float(score_of[i]) for i in perm]
    elif order == "positions":
        tokens += learned
        scores += [float(s) for s in rng.permutation(len(learned))]  # no relation to the order
    else:
        raise ValueError(order)
    types += [1] * len(learned)
    return SpmVocab(tokens, scores, types)


def write_spm_gguf(path: Path, *, arch: str = "gemma3", add_space_prefix: bool | None = None,
                   add_bos: bool | None = True, chat_template: str | None = None) -> SpmVocab:
    """A GGUF holding only a SentencePiece tokenizer (no tensors): enough for
    `Tokenizer.from_gguf_metadata` and for transformers' GGUF tokenizer converter.
    A Gemma architecture gets the vocabulary ranked by position, others by score."""
    vocab = spm_vocab("positions" if arch.startswith("gemma") else "scores")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.name", f"tiny {arch} tokenizer")
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", vocab.tokens)
    w.add_array("tokenizer.ggml.scores", vocab.scores)
    w.add_array("tokenizer.ggml.token_type", vocab.types)
    for key, name in (("bos", "<bos>"), ("eos", "<eos>"), ("unknown", "<unk>"), ("padding", "<pad>")):
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", SPM_CONTROL.index(name))
    if add_bos is not None:
        w.add_bool("tokenizer.ggml.add_bos_token", add_bos)
    if add_space_prefix is not None:
        w.add_bool("tokenizer.ggml.add_space_prefix", add_space_prefix)
    if chat_template is not None:
        w.add_string("tokenizer.chat_template", chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return vocab
