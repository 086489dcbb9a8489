"""RoPE scaling (linear, llama3, yarn, dynamic) against transformers: the
rotary tables bit for bit (yarn's attention factor included), and greedy
output token for token in float32 on tiny Llamas whose original context is 32
positions, generating up to position 125. Dynamic scaling is exact below
max_position_embeddings, where the runner caps it."""

from __future__ import annotations

import pytest
import torch

from agentserve.engine.sampling_params import SamplingParams
from agentserve.llm import LLM
from agentserve.runner.config import ModelConfig, UnsupportedModel
from agentserve.runner.loader import load_model
from agentserve.runner.rope import RotaryTable
from tiny_models import (DEVICE, hf_gemma3, hf_greedy, hf_llama_rope, hf_qwen3, loaded_as, prompt,
                         write_gguf_from_hf)

POSITIONS = 128
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 0.7,
                    "mscale_all_dim": 1.3, "beta_fast": 16, "beta_slow": 2, "truncate": False,
                    "rope_theta": 10000.0},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                              "attention_factor": 0.8, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
}


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_rotary_table_equals_transformers(kind):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = hf_llama_rope(SCALINGS[kind], POSITIONS)
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    ours = RotaryTable(cfg, POSITIONS, torch.float32, torch.device("cpu"))
    pos = torch.arange(POSITIONS)[None]
    cos, sin = LlamaRotaryEmbedding(hf.config)(torch.zeros(1, dtype=torch.float32), pos)
    assert torch.equal(ours.cos, cos[0]) and torch.equal(ours.sin, sin[0])
    if kind.startswith("yarn"):  # the attention factor is in the table
        assert not torch.allclose(ours.cos[0], torch.ones_like(ours.cos[0]))


def test_gemma3_tables_per_layer_kind_equal_transformers():
    hf = hf_gemma3()
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    rotary = hf.model.rotary_emb
    pos = torch.arange(300)[None]
    for kind, local in (("full_attention", False), ("sliding_attention", True)):
        ours = RotaryTable(cfg, 300, torch.float32, torch.device("cpu"), local=local)
        cos, sin = rotary(torch.zeros(1), pos, kind)
        assert torch.equal(ours.cos, cos[0]) and torch.equal(ours.sin, sin[0]), kind


@pytest.mark.parametrize("kind", ["linear", "llama3", "yarn", "dynamic"])
def test_greedy_past_the_original_context(kind):
    hf = hf_llama_rope(SCALINGS[kind], POSITIONS, seed=2)
    llm = LLM(loaded_as(hf, kind), dtype="float32", device=DEVICE, kv_cache_tokens=1024, block_size=4,
              policy="vllm-fcfs", max_num_batched_tokens=16)
    assert llm.max_model_len == POSITIONS
    prompts = [prompt(50, 20), prompt(51, 61)]  # 61 + 64 = 125 positions: ~4x the original 32
    outs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 64) for p in prompts]


def test_dynamic_past_max_position_embeddings_is_refused():
    hf = hf_llama_rope(SCALINGS["dynamic"], POSITIONS)
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    with pytest.raises(UnsupportedModel, match="dynamic RoPE scaling .* cannot be served exactly"):
        RotaryTable(cfg, POSITIONS + 1, torch.float32, torch.device("cpu"))


def test_yarn_from_gguf_metadata(tmp_path):
    """llama.cpp's rope.scaling.* keys come back as the same yarn scaling."""
    hf = hf_qwen3(seed=5, positions=POSITIONS, rope_parameters=dict(SCALINGS["yarn"]))
    write_gguf_from_hf(hf, tmp_path / "yarn.gguf", "qwen3")
    model = load_model(str(tmp_path / "yarn.gguf"))
    assert model.config.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    llm = LLM(model, dtype="float32", device=DEVICE, kv_cache_tokens=1024, block_size=4, policy="vllm-fcfs")
    p = prompt(52, 61)
    out = llm.generate([p], SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, p, 64)
