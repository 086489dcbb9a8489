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
    table = list(range(-(-n // bs)))
    out = []
    for start in range(0, n, chunk):
        k = min(chunk, n - start)
        meta = build_metadata([], [], [(table, start, k)], bs, llm.device, dtype=llm.model.dtype)
        dev = llm.device
        out.append(llm.model.forward(torch.tensor(ids[start:start + k], device=dev),
                                     torch.arange(start, start + k, device=dev), meta, llm.kv_cache,
                                     torch.arange(k, device=dev)).float().cpu())
    return torch.cat(out)
