"""Qwen3, Mistral (sliding window) and Gemma 3 (sliding and global layers, two
RoPE tables, its norms and GeGLU) against transformers: same weights, greedy,
token for token in float32, through every engine path (batching, chunked
prefill, prefix hits, preemption with recompute and with swap, the host tier,
speculation), loaded from Hugging Face folders and GGUF files. The windowed
models use a window of 8 and prompts of up to 61 tokens plus 64 generated, so
most of every sequence lies outside the window."""

from __future__ import annotations

import pytest
import torch

from agentserve.engine.sampling_params import SamplingParams
from agentserve.llm import LLM
from agentserve.runner.config import ModelConfig
from agentserve.runner.loader import load_model
from tiny_models import (DEVICE, hf_gemma3, hf_greedy, hf_mistral, hf_qwen3, loaded_as, prompt, save_hf_folder,
                         teacher_forced_logits, write_gguf_from_hf)

N_NEW = 64
GREEDY = SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True)
BUILDERS = {"qwen3": hf_qwen3, "mistral": hf_mistral, "gemma3": hf_gemma3}


def make_llm(model, **kw) -> LLM:
    opts = dict(dtype="float32", device=DEVICE, kv_cache_tokens=4096, block_size=4, max_num_batched_tokens=256,
                policy="vllm-fcfs", speculate=0)
    opts.update(kw)
    return LLM(model, **opts)


@pytest.fixture(scope="module", params=list(BUILDERS))
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def hf(arch):
    return BUILDERS[arch]()


@pytest.fixture(scope="module")
def references(hf):
    """Greedy continuations of 6 prompts of different lengths (up to ~8 windows), from transformers."""
    prompts = [prompt(i, n) for i, n in enumerate([5, 9, 17, 31, 40, 61])]
    return prompts, [hf_greedy(hf, p, N_NEW) for p in prompts]


def test_batch_of_different_lengths(arch, hf, references):
    prompts, refs = references
    llm = make_llm(loaded_as(hf, arch))
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == refs
    llm.check_integrity()


def test_chunked_prefill_in_chunks_of_7(arch, hf, references):
    prompts, refs = references
    llm = make_llm(loaded_as(hf, arch), max_num_batched_tokens=7)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == refs


def test_prefix_hit_covering_all_but_3_tokens(arch, hf):
    llm = make_llm(loaded_as(hf, arch))
    first = llm.generate([prompt(7, 30)], SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True),
                         program_ids=["P"])[0]
    second_prompt = (prompt(7, 30) + first.token_ids)[:40] + prompt(8, 3)
    out = llm.generate([second_prompt], GREEDY, program_ids=["P"])[0]
    assert out.num_cached_tokens == 40
    assert out.token_ids == hf_greedy(hf, second_prompt, N_NEW)
    llm.check_integrity()


def test_preemption_with_recompute_and_with_swap(arch, hf, references):
    prompts, refs = references
    for policy, host in (("vllm-fcfs", 0), ("infercept", 4096)):
        llm = make_llm(loaded_as(hf, arch), kv_cache_tokens=192, host_kv_tokens=host, policy=policy)
        outs = llm.generate(prompts, GREEDY)
        assert llm.scheduler.stats.preemptions > 0, policy
        assert [o.token_ids for o in outs] == refs, policy
        llm.check_integrity()


def test_reload_from_host_tier(arch, hf):
    llm = make_llm(loaded_as(hf, arch), kv_cache_tokens=160, host_kv_tokens=1024)
    p1 = prompt(11, 37)
    first = llm.generate([p1], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True), program_ids=["A"])[0]
    llm.generate([prompt(100 + i, 60) for i in range(4)], SamplingParams(max_tokens=8, temperature=0.0,
                                                                          ignore_eos=True))
    turn2 = p1 + first.token_ids + prompt(12, 5)
    stats = llm.scheduler.stats
    hits, loaded = stats.hit_tokens, stats.loaded_tokens
    out = llm.generate([turn2], GREEDY, program_ids=["A"])[0]
    # the whole prefix from the cache, part of it reloaded from the host tier (Gemma 3's hybrid cache keeps
    # more of it on the device, in smaller blocks, and reloads the evicted window parts from their copies)
    assert stats.hit_tokens - hits >= 40 and stats.loaded_tokens - loaded > 0, (stats.hit_tokens - hits,
                                                                               stats.loaded_tokens - loaded)
    assert out.token_ids == hf_greedy(hf, turn2, N_NEW)
    llm.check_integrity()


def test_speculation(arch, hf):
    """Prompt-lookup drafts verified as multi-row chunks: the same tokens as
    transformers. The last prompt ends with a 16-token stretch that occurred
    before, followed there by the model's own continuation: with a window of 8
    over 2 layers (Mistral) nothing older reaches the next token, so the drafts
    taken from the earlier occurrence are accepted."""
    start = prompt(21, 30)
    ps = [[(7 * i) % 50 + 60 for i in range(30)] * 2, [97, 98, 99, 100] * 12,
          start + hf_greedy(hf, start, 24) + start[-16:]]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    llm = make_llm(loaded_as(hf, arch), speculate=8)
    got = [o.token_ids for o in llm.generate(ps, params)]
    assert got == [hf_greedy(hf, p, 48) for p in ps]
    stats = llm.scheduler.speculator.stats
    assert stats.draft_tokens > 0 and stats.accepted_tokens > 0
    llm.check_integrity()


def test_from_a_hugging_face_folder(arch, hf, references, tmp_path):
    save_hf_folder(hf, tmp_path)
    model = load_model(str(tmp_path))
    assert model.config.arch == arch
    prompts, refs = references
    outs = make_llm(model).generate(prompts[-2:], GREEDY)
    assert [o.token_ids for o in outs] == refs[-2:]


def test_bfloat16_fused_decode_path_agrees(arch, hf, references):
    """bfloat16 one token a forward (the fused native path on the CPU): top-1
    agreement with transformers' float32 logits on positions without a near tie."""
    prompts, refs = references
    ids = prompts[3] + refs[3]
    llm = make_llm(loaded_as(hf, arch), dtype="bfloat16")
    ours = teacher_forced_logits(llm, ids, 1)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].float()
    top2 = theirs.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1 * theirs.std()
    agree = (ours.argmax(-1) == theirs.argmax(-1))[clear].float().mean().item()
    assert agree >= 0.95, agree


# --- GGUF files written the way llama.cpp's converter writes these architectures ---

@pytest.mark.parametrize("gguf_arch", ["qwen3", "gemma3"])
def test_from_gguf(gguf_arch, tmp_path):
    if gguf_arch == "qwen3":
        hf = hf_qwen3(seed=4)
    else:  # what a Gemma 3 GGUF leaves to the architecture: every sixth layer global, local base 10000,
        # scale from head_dim; the global layers' linear scaling is not in this file
        hf = hf_gemma3(seed=4, layer_types=["sliding_attention"] * 5 + ["full_attention"], query_pre_attn_scalar=32,
                       rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
        with torch.no_grad():  # weights whose 1 + w round trip is exact, as a Gemma file's are
            for name, p in hf.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_((p + 1.0) - 1.0)
    path = tmp_path / f"{gguf_arch}.gguf"
    write_gguf_from_hf(hf, path, gguf_arch)
    model = load_model(str(path))
    c = model.config
    assert c.arch == gguf_arch and c.head_dim == hf.config.head_dim
    expected = {k: v for k, v in hf.state_dict().items() if not (c.tie_word_embeddings and k == "lm_head.weight")}
    assert set(model.weights) == set(expected)
    for name, t in expected.items():
        assert torch.equal(model.weights[name], t), name
    if gguf_arch == "gemma3":
        assert c.layer_types == hf.config.layer_types and c.sliding_window == 8
        assert c.local_rope_theta == 10_000.0 and c.attention_scale == 32 ** -0.5
    prompts = [prompt(30 + i, n) for i, n in enumerate([12, 45])]
    outs = make_llm(model).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, N_NEW) for p in prompts]


# --- what the runner cannot serve exactly is refused, with one line ---

def _config(arch: str) -> dict:
    return BUILDERS[arch](layers=1).config.to_dict() if arch != "gemma3" else hf_gemma3().config.to_dict()


@pytest.mark.parametrize("arch,change,message", [
    ("qwen3", {"model_type": "phi3"}, r"model_type 'phi3' is not supported \(supported: gemma3, llama, mistral, "
                                      r"qwen2, qwen3\)"),
    ("gemma3", {"model_type": "gemma3"}, "multimodal"),
    ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma3", {"hidden_activation": "gelu"}, "activation 'gelu'"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "longrope", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "RoPE type 'longrope'"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window"),
    ("qwen3", {"attention_bias": True}, "attention_bias"),
    ("qwen3", {"layer_types": ["sliding_attention"]}, "sliding_attention"),
    ("mistral", {"hidden_act": "gelu"}, "activation"),
    ("mistral", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("mistral", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                                     "rope_theta": 1e4, "extrapolation": 1}}, "key 'extrapolation'"),
    ("mistral", {"rope_parameters": {"rope_type": "su", "rope_theta": 1e4}}, "RoPE type 'su'"),
])
def test_configs_the_runner_cannot_honour_are_refused(arch, change, message):
    from agentserve.runner.config import UnsupportedModel

    cfg = dict(_config(arch), **change)
    with pytest.raises(UnsupportedModel, match=message) as e:
        ModelConfig.from_hf(cfg)
    assert "\n" not in str(e.value)


def test_llama_biases_and_qwen2_windows_are_refused():
    from transformers import LlamaConfig, Qwen2Config

    from agentserve.runner.config import UnsupportedModel

    llama = LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, intermediate_size=64).to_dict()
    for change in ({"attention_bias": True}, {"mlp_bias": True}, {"pretraining_tp": 2}):
        with pytest.raises(UnsupportedModel):
            ModelConfig.from_hf(dict(llama, **change))
    qwen2 = Qwen2Config(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, intermediate_size=64,
                        use_sliding_window=True, sliding_window=16, max_window_layers=0).to_dict()
    with pytest.raises(UnsupportedModel, match="use_sliding_window"):
        ModelConfig.from_hf(qwen2)


def test_a_refused_folder_names_itself_and_the_field(tmp_path):
    import json

    hf = hf_gemma3()
    save_hf_folder(hf, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["attn_logit_softcapping"] = 50.0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"^{tmp_path}: gemma3 config: attn_logit_softcapping = 50.0 is not "
                                         "supported"):
        load_model(str(tmp_path))


def test_an_unknown_gguf_architecture_names_the_supported_ones(tmp_path):
    from gguf_fixtures import write_tiny_gguf

    path = tmp_path / "phi.gguf"
    write_tiny_gguf(path, arch="phi3")
    with pytest.raises(ValueError, match=r"GGUF architecture 'phi3' is not supported \(supported: gemma3, llama, "
                                         r"mistral, qwen2, qwen3"):
        load_model(str(path))


def test_a_gguf_with_a_soft_cap_is_refused(tmp_path):
    path = tmp_path / "g.gguf"
    write_gguf_from_hf(hf_gemma3(layer_types=["sliding_attention"] * 5 + ["full_attention"]), path, "gemma3",
                       extra={"gemma3.final_logit_softcapping": 30.0})
    with pytest.raises(ValueError, match="gemma3.final_logit_softcapping = 30.0 is not supported"):
        load_model(str(path))
