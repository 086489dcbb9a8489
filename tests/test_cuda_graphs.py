"""CUDA graphs for decode steps (runner/cuda_graphs.py): the ladder of batch
sizes, and on a GPU, replayed graphs giving the tokens of eager steps at every
batch size of the ladder, padded batches, sliding windows and q/k norms."""

from __future__ import annotations

import pytest
import torch

from agentserve.engine.sampling_params import SamplingParams
from agentserve.llm import LLM
from agentserve.runner.cuda_graphs import LADDER, ladder_for
from tiny_models import hf_gemma3, hf_llama, hf_qwen3, loaded, loaded_as, prompt

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def test_ladder_covers_the_running_limit():
    assert ladder_for(64) == [1, 2, 4, 8, 16, 32, 64]
    assert ladder_for(48) == [1, 2, 4, 8, 16, 32, 48]
    assert ladder_for(1) == [1]
    assert ladder_for(10_000) == list(LADDER)
    assert ladder_for(0) == []


def test_no_graphs_off_cuda():
    llm = LLM(loaded(hf_llama()), device="cpu", dtype="float32", kv_cache_tokens=1024)
    assert llm.model.graphs is None


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def _pair(model, dtype, **kw):
    opts = dict(device="cuda", dtype=dtype, kv_cache_tokens=8192, max_num_seqs=8, speculate=0, block_size=8, **kw)
    return LLM(model, **opts), LLM(model, enforce_eager=True, **opts)


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_gives_the_eager_tokens_at_every_ladder_size(dtype):
    graphed, eager = _pair(loaded(hf_llama()), dtype)
    assert graphed.model.graphs.sizes == [1, 2, 4, 8] and eager.model.graphs is None
    for b in graphed.model.graphs.sizes:
        prompts = [prompt(10 * b + i, 20 + 9 * i) for i in range(b)]
        before = graphed.model.graphs.replays
        got = graphed.generate(prompts, GREEDY)
        assert graphed.model.graphs.replays > before  # the decode steps ran on the graph of b rows
        assert [o.token_ids for o in got] == [o.token_ids for o in eager.generate(prompts, GREEDY)], b
        graphed.check_integrity()


@cuda
def test_padded_batches_write_no_kv_and_match_eager():
    """3, 5 and 7 rows replay the graphs of 4 and 8: the padding rows write nothing
    (a later request reusing the blocks would read it) and change no row."""
    graphed, eager = _pair(loaded(hf_llama()), "float32")
    for b in (3, 5, 7):
        prompts = [prompt(100 + 10 * b + i, 33 + 5 * i) for i in range(b)]
        assert [o.token_ids for o in graphed.generate(prompts, GREEDY)] == \
            [o.token_ids for o in eager.generate(prompts, GREEDY)], b
        graphed.check_integrity()


@cuda
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_graphs_with_qk_norm_and_sliding_windows(arch):
    hf = hf_qwen3() if arch == "qwen3" else hf_gemma3(window=8)
    # the full KV layout: the hybrid one (Gemma's default without tiers) runs eagerly
    kw = {"kv_layout": "full"} if arch == "gemma3" else {}
    graphed, eager = _pair(loaded_as(hf, arch), "bfloat16", **kw)
    assert graphed.model.graphs is not None
    prompts = [prompt(7 + i, 30 + 11 * i) for i in range(4)]  # contexts past the window
    assert [o.token_ids for o in graphed.generate(prompts, GREEDY)] == \
        [o.token_ids for o in eager.generate(prompts, GREEDY)]
