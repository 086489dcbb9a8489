"""Tiny random Llama models, a byte-level tokenizer and teacher-forced logits for runner tests.

Weights are drawn with a large initializer range so the logits are peaked:
greedy decoding of a near-uniform random model would hinge on float32 ties,
which is not what the token-exactness tests are about."""

from __future__ import annotations

import os
import random

import torch

from agentserve.runner.attention import build_metadata
from agentserve.runner.checkpoint import LoadedModel
from agentserve.runner.config import ModelConfig
from agentserve.runner.tokenizer import Tokenizer, byte_level_tokenizer

# The device the runner tests build their LLM on: the CPU in CI;
# AGENTSERVE_TEST_DEVICE=cuda runs the same token-exactness checks on a GPU
# (transformers' reference stays on the CPU in float32).
DEVICE = os.environ.get("AGENTSERVE_TEST_DEVICE", "cpu")

VOCAB = 320
SPECIALS = ["<|im_start|>", "<|im_end|>"]


def hf_llama(tied: bool = False, seed: int = 0, layers: int = 2, kv_heads: int = 2, positions: int = 1024):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=positions,
                      tie_word_embeddings=tied, initializer_range=0.3, rope_theta=10000.0,
                      bos_token_id=None, eos_token_id=257, pad_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def byte_tokenizer() -> Tokenizer:
    """Byte-level BPE with no merges: ids 0..255 are bytes, 256/257 the ChatML specials."""
    return byte_level_tokenizer(SPECIALS, eos="<|im_end|>")


def loaded(hf_model, tokenizer: Tokenizer | None = None) -> LoadedModel:
    cfg = ModelConfig.from_hf(hf_model.config.to_dict(), name="tiny-llama")
    weights = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    return LoadedModel(cfg, weights, tokenizer or byte_tokenizer(), None, "tiny-llama")


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    # an explicit mask: otherwise generate() masks out prompt tokens equal to the pad id
    out = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def teacher_forced_logits(llm, ids: list[int], chunk: int) -> torch.Tensor:
    """float32 logits of every position of `ids`, fed `chunk` tokens a forward
    through the paged cache (blocks 0.. in order)."""
    n, bs = len(ids), llm.kv_cache.block_size
    nb = -(-n // bs)
    layout = llm.kv_cache.layout  # the hybrid cache: each layer group its own blocks
    tables = [list(range(g * nb, (g + 1) * nb)) for g in range(1 if layout is None else 1 + layout.pages)]
    out = []
    for start in range(0, n, chunk):
        k = min(chunk, n - start)
        metas = [build_metadata([], [], [(t, start, k)], bs, llm.device, dtype=llm.model.dtype) for t in tables]
        meta = metas[0]
        if layout is not None:
            meta.groups = metas
        dev = llm.device
        out.append(llm.model.forward(torch.tensor(ids[start:start + k], device=dev),
                                     torch.arange(start, start + k, device=dev), meta, llm.kv_cache,
                                     torch.arange(k, device=dev)).float().cpu())
    return torch.cat(out)


# --- the other architectures: Qwen3, Mistral, Gemma 3 (float32, peaked logits like hf_llama) ---

def _randomize_norms(model, center: float, seed: int, centers: dict[str, float] | None = None) -> None:
    """Norm weights drawn around `center` (1 for x*w norms, 0 for Gemma's x*(1+w)),
    or around centers[part] for names containing part: freshly initialized ones
    are all equal and would hide a norm applied in the wrong place."""
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                c = next((v for k, v in (centers or {}).items() if k in name), center)
                p.copy_(c + 0.2 * torch.randn(p.shape, generator=g))


def hf_qwen3(seed: int = 0, layers: int = 2, positions: int = 1024, tied: bool = False, **kw):
    """head_dim 24, not hidden/heads (16), as in the real Qwen3 models."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=positions,
                      tie_word_embeddings=tied, initializer_range=0.3, rope_theta=10000.0,
                      bos_token_id=None, eos_token_id=257, pad_token_id=None, **kw)
    model = Qwen3ForCausalLM(cfg).eval()
    _randomize_norms(model, 1.0, seed)
    return model


def hf_mistral(seed: int = 0, layers: int = 2, window: int | None = 8, positions: int = 1024, **kw):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                        sliding_window=window, initializer_range=0.3, rope_theta=10000.0,
                        bos_token_id=None, eos_token_id=257, pad_token_id=None, **kw)
    model = MistralForCausalLM(cfg).eval()
    _randomize_norms(model, 1.0, seed)
    return model


GEMMA3_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def hf_gemma3(seed: int = 0, window: int = 8, positions: int = 1024, layer_types=None, rope_parameters=None,
              query_pre_attn_scalar: int = 24, **kw):
    """Sliding and full layers (window 8), head_dim 32 (not hidden/heads), query_pre_attn_scalar
    24 (not head_dim), a local RoPE base apart from the global one, and linear RoPE scaling on
    the full layers only, so that each of Gemma 3's switches changes the output."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    types = list(layer_types or GEMMA3_LAYER_TYPES)
    rope = rope_parameters or {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=len(types),
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           query_pre_attn_scalar=query_pre_attn_scalar,
                           max_position_embeddings=positions, sliding_window=window, layer_types=types,
                           rope_parameters=rope, initializer_range=0.3, tie_word_embeddings=True,
                           bos_token_id=None, eos_token_id=257, pad_token_id=None, **kw)
    model = Gemma3ForCausalLM(cfg).eval()
    # the attention output scaled up (4x) and its scores sharpened (2x): otherwise the scaled
    # embedding dominates the residual stream and the window, RoPE tables and q/k norms hardly
    # change a greedy token (measured: the window changed 0 of 6 outputs, now 6 of 6)
    _randomize_norms(model, 0.0, seed, {"post_attention_layernorm": 3.0, "q_norm": 1.0, "k_norm": 1.0})
    return model


def loaded_as(hf_model, name: str, tokenizer: Tokenizer | None = None) -> LoadedModel:
    """Like `loaded`, under another name (the log names the architecture)."""
    cfg = ModelConfig.from_hf(hf_model.config.to_dict(), name=name)
    weights = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return LoadedModel(cfg, weights, tokenizer or byte_tokenizer(), None, name)


def write_gguf_from_hf(hf_model, path, arch: str, extra: dict[str, float] | None = None) -> None:
    """Write an HF model as llama.cpp's converter would for `arch` (qwen3, gemma3),
    every tensor float32 so that the loaded model is the HF one exactly: ggml
    names, no q/k permutation (both use NEOX rope), Gemma's norms stored as 1 + w,
    Gemma's window in the metadata and its other settings left to the
    architecture's defaults (every sixth layer global, local base 10000, scale
    from head_dim) - so the model must have been built with those."""
    import gguf
    import numpy as np

    from gguf_fixtures import SPECIAL_TOKENS, byte_level_vocab

    c = hf_model.config
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    if arch == "gemma3":
        names.update({"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                      "post_feedforward_layernorm": "post_ffw_norm"})
    else:
        names["post_attention_layernorm"] = "ffn_norm"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.name", f"tiny {arch}")
    w.add_uint32(f"{arch}.block_count", c.num_hidden_layers)
    w.add_uint32(f"{arch}.context_length", c.max_position_embeddings)
    w.add_uint32(f"{arch}.embedding_length", c.hidden_size)
    w.add_uint32(f"{arch}.feed_forward_length", c.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", c.num_attention_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", c.num_key_value_heads)
    w.add_uint32(f"{arch}.attention.key_length", c.head_dim)
    w.add_uint32(f"{arch}.attention.value_length", c.head_dim)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_float32(f"{arch}.rope.freq_base", rope["rope_theta"])
    if arch == "gemma3":
        w.add_uint32(f"{arch}.attention.sliding_window", c.sliding_window)
    if rope["rope_type"] in ("linear", "yarn"):  # llama.cpp's keys for these (llama3's is a tensor)
        w.add_string(f"{arch}.rope.scaling.type", rope["rope_type"])
        w.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
        if "original_max_position_embeddings" in rope:
            w.add_uint32(f"{arch}.rope.scaling.original_context_length", rope["original_max_position_embeddings"])
    for key, value in (extra or {}).items():
        w.add_float32(key, value)
    tokens, types, merges = byte_level_vocab()
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "smollm")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.eos_token_id", SPECIAL_TOKENS.index("<|im_end|>"))
    for name, t in hf_model.state_dict().items():
        values = t.detach().float().numpy().copy()
        if name == "model.embed_tokens.weight":
            ggml = "token_embd.weight"
        elif name == "model.norm.weight":
            ggml = "output_norm.weight"
        elif name == "lm_head.weight":
            if c.tie_word_embeddings:
                continue
            ggml = "output.weight"
        else:
            parts = name.split(".")  # model.layers.N.<module...>.weight
            ggml = f"blk.{parts[2]}.{names['.'.join(parts[3:-1])]}.{parts[-1]}"
        if arch == "gemma3" and name.endswith("norm.weight"):
            values = values + np.float32(1.0)
        w.add_tensor(ggml, values.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def save_hf_folder(hf_model, folder) -> None:
    """The model as a Hugging Face folder (config.json, safetensors, a byte-level tokenizer.json)."""
    from transformers import PreTrainedTokenizerFast

    from gguf_fixtures import byte_level_vocab

    hf_model.save_pretrained(folder)
    tokens, types, merges = byte_level_vocab()
    tok = Tokenizer.from_gguf_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2})
    PreTrainedTokenizerFast(tokenizer_object=tok.backend, bos_token="<|im_start|>",
                            eos_token="<|im_end|>").save_pretrained(folder)


def hf_llama_rope(rope_parameters: dict, positions: int, seed: int = 0):
    """A tiny Llama with a RoPE scaling (yarn, dynamic, linear, llama3)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                      initializer_range=0.3, rope_parameters=dict(rope_parameters),
                      bos_token_id=None, eos_token_id=257, pad_token_id=None)
    return LlamaForCausalLM(cfg).eval()
