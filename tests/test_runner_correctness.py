"""The runner against transformers: same weights, greedy, token for token (float32),
through the real scheduler and KV manager: batching, chunked prefill, prefix
hits, preemption with recompute, swap out and reload from the host tier."""

from __future__ import annotations

import pytest
import torch

from agentserve.engine.sampling_params import SamplingParams
from agentserve.llm import LLM
from tiny_models import DEVICE, hf_greedy, hf_llama, loaded, prompt

N_NEW = 64
GREEDY = SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True)


def make_llm(hf, **kw) -> LLM:
    opts = dict(dtype="float32", device=DEVICE, kv_cache_tokens=4096, block_size=4, max_num_batched_tokens=256,
                policy="vllm-fcfs")
    opts.update(kw)
    return LLM(loaded(hf), **opts)


@pytest.fixture(scope="module", params=["untied", "tied"])
def hf(request):
    return hf_llama(tied=request.param == "tied")


@pytest.fixture(scope="module")
def references(hf):
    """Greedy continuations of 8 prompts of different lengths, from transformers."""
    prompts = [prompt(i, n) for i, n in enumerate([5, 9, 13, 17, 23, 31, 40, 61])]
    return prompts, [hf_greedy(hf, p, N_NEW) for p in prompts]


def test_batch_of_8_different_lengths(hf, references):
    prompts, refs = references
    llm = make_llm(hf)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == refs
    assert max(o.num_prompt_tokens for o in outs) == 61
    llm.check_integrity()


def test_chunked_prefill_in_chunks_of_7(hf, references):
    prompts, refs = references
    llm = make_llm(hf, max_num_batched_tokens=7)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == refs
    assert llm.scheduler.stats.steps > 64  # really chunked: 8 x 64 decode tokens, 7 a step


def test_prefix_hit_covering_all_but_3_tokens(hf):
    llm = make_llm(hf)
    first = llm.generate([prompt(7, 30)], SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True),
                         program_ids=["P"])[0]
    # 41 tokens, 40 of them with KV (the last sampled token was never fed back): 10 full blocks
    context = (prompt(7, 30) + first.token_ids)[:40]
    second_prompt = context + prompt(8, 3)
    out = llm.generate([second_prompt], GREEDY, program_ids=["P"])[0]
    assert out.num_cached_tokens == 40 == len(second_prompt) - 3
    assert out.token_ids == hf_greedy(hf, second_prompt, N_NEW)
    llm.check_integrity()


def test_preemption_and_recompute(hf, references):
    prompts, refs = references
    # 8 requests need up to 32 blocks each at the end; 64 blocks force preemptions
    llm = make_llm(hf, kv_cache_tokens=256)
    outs = llm.generate(prompts, GREEDY)
    assert llm.scheduler.stats.preemptions > 0
    assert [o.token_ids for o in outs] == refs
    llm.check_integrity()
    assert llm.kv.num_free_blocks == llm.kv.num_blocks


def test_swap_out_and_reload_from_host_tier(hf):
    """A finished program's prefix is evicted to the host tier by other work and
    loaded back (not recomputed) for its next turn."""
    llm = make_llm(hf, kv_cache_tokens=160, host_kv_tokens=1024)
    p1 = prompt(11, 37)
    first = llm.generate([p1], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True), program_ids=["A"])[0]
    filler = [prompt(100 + i, 60) for i in range(4)]
    llm.generate(filler, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    turn2 = p1 + first.token_ids + prompt(12, 5)
    before = llm.scheduler.stats.loaded_tokens
    out = llm.generate([turn2], GREEDY, program_ids=["A"])[0]
    assert llm.scheduler.stats.loaded_tokens - before >= 32, "the prefix was not reloaded from the host tier"
    assert out.token_ids == hf_greedy(hf, turn2, N_NEW)
    llm.check_integrity()


def test_a_failed_reload_is_recomputed_never_read(hf):
    """Every reload fails and leaves garbage in its device block: the executor
    computes nothing of the request that wanted it, the scheduler cuts it back,
    it recomputes, and its output is still transformers'."""
    llm = make_llm(hf, kv_cache_tokens=160, host_kv_tokens=1024)
    p1 = prompt(11, 37)
    first = llm.generate([p1], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True), program_ids=["A"])[0]
    filler = [prompt(100 + i, 60) for i in range(4)]
    llm.generate(filler, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    cache = llm.kv_cache

    def failing_load(pairs):
        dev = torch.tensor([d for _, d in pairs])
        cache.device_kv[:, :, :, dev] = float("nan")  # a torn copy
        return list(range(len(pairs)))

    cache.load = failing_load
    turn2 = p1 + first.token_ids + prompt(12, 5)
    out = llm.generate([turn2], GREEDY, program_ids=["A"])[0]
    assert llm.scheduler.stats.reload_failed_blocks >= 8
    assert out.token_ids == hf_greedy(hf, turn2, N_NEW)
    llm.check_integrity()


def test_swap_on_preemption_restores_exact_kv(hf, references):
    """InferCept swaps a preempted request's KV to the host and back."""
    prompts, refs = references
    llm = make_llm(hf, kv_cache_tokens=256, host_kv_tokens=4096, policy="infercept")
    outs = llm.generate(prompts, GREEDY)
    assert llm.scheduler.stats.preemptions > 0
    assert [o.token_ids for o in outs] == refs
    llm.check_integrity()


def test_bfloat16_agrees_with_float32_reference(hf, references):
    """bfloat16 is checked by teacher-forced top-1 agreement on positions
    without a near tie, and by logit closeness."""
    prompts, refs = references
    llm = make_llm(hf, dtype="bfloat16")
    ids = prompts[6] + refs[6]
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids  # runs end to end in bf16
    from agentserve.runner.attention import build_metadata

    n = len(ids)
    meta = build_metadata([], [], [(list(range(-(-n // 4))), 0, n)], 4, llm.device)
    dev = llm.device
    ours = llm.model.forward(torch.tensor(ids, device=dev), torch.arange(n, device=dev), meta, llm.kv_cache,
                             torch.arange(n, device=dev)).float().cpu()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].float()
    top2 = theirs.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1 * theirs.std()
    agree = (ours.argmax(-1) == theirs.argmax(-1))[clear].float().mean().item()
    assert agree >= 0.95, agree
    assert torch.allclose(ours, theirs, atol=0.15 * theirs.abs().max().item())


@pytest.mark.xfail(DEVICE != "cpu", strict=False,
                   reason="seen on an H200: CUDA kernels chosen by the batch's shape round the logits differently, "
                          "and a near tie flipped after 8 tokens (the noise itself is per request)")
def test_seeded_sampling_is_independent_of_the_batch(hf):
    p = prompt(3, 12)
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = make_llm(hf).generate([p], seeded)[0].token_ids
    others = [prompt(20 + i, 7 + i) for i in range(5)]
    mixed = make_llm(hf).generate(others + [p], [SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)]
                                  * 5 + [seeded])[-1].token_ids
    assert alone == mixed
    other_seed = make_llm(hf).generate([p], SamplingParams(max_tokens=20, temperature=1.0, seed=99,
                                                           ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_top_k_1_is_greedy_and_temperature_0_is_greedy(hf, references):
    prompts, refs = references
    llm = make_llm(hf)
    out = llm.generate([prompts[2]], SamplingParams(max_tokens=N_NEW, temperature=0.8, top_k=1, ignore_eos=True))
    assert out[0].token_ids == refs[2]
