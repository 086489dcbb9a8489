"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers
loading the same GGUF: greedy, token for token in float32, and by top-1
agreement in bfloat16; plus the chat API end to end."""

from __future__ import annotations

import pytest
import torch

from agentserve.engine.sampling_params import SamplingParams
from agentserve.llm import LLM
from agentserve.runner.attention import build_metadata

N_NEW = 64
MESSAGES = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]


@pytest.fixture(scope="module")
def llm32():
    return LLM(None, dtype="float32", device="cpu", kv_cache_tokens=8192, block_size=16, policy="continuum")


@pytest.fixture(scope="module")
def chat_ids(llm32):
    return llm32.tokenizer.encode(llm32.chat_template.render(MESSAGES))


def test_float32_greedy_matches_transformers_token_for_token(llm32, chat_ids, smollm_hf):
    params = SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True)
    ours = llm32.generate([chat_ids], params)[0].token_ids
    x = torch.tensor([chat_ids])
    ref = smollm_hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N_NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(chat_ids):].tolist()
    assert ours == ref
    # a second turn of the same program reuses the first turn's prompt and output
    turn2 = chat_ids + ours + llm32.tokenizer.encode("<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n")
    out = llm32.generate([turn2], SamplingParams(max_tokens=8, temperature=0.0), program_ids=["story"])[0]
    assert out.num_cached_tokens >= (len(chat_ids) + N_NEW - 1) // 16 * 16
    llm32.check_integrity()


def test_bfloat16_top1_agrees_with_transformers(chat_ids, smollm_hf):
    llm = LLM(None, dtype="bfloat16", device="cpu", kv_cache_tokens=4096, block_size=16)
    with torch.no_grad():
        x = torch.tensor([chat_ids])
        ids = smollm_hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0].tolist()
        theirs = smollm_hf(torch.tensor([ids])).logits[0].float()
    n = len(ids)
    meta = build_metadata([], [], [(list(range(-(-n // 16))), 0, n)], 16, llm.device)
    ours = llm.model.forward(torch.tensor(ids), torch.arange(n), meta, llm.kv_cache, torch.arange(n))
    top2 = theirs.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.5  # logits of a near tie may flip in bfloat16
    agree = (ours.argmax(-1) == theirs.argmax(-1))[clear].float().mean().item()
    assert agree >= 0.97, agree
    assert (ours - theirs).abs().mean().item() < 0.35


def test_chat_answers_and_stops(llm32):
    out = llm32.chat([{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in out.text
    assert out.output.finish_reason == "stop"
    stopped = llm32.chat([{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
                         SamplingParams(max_tokens=60, temperature=0.0, stop=["5"]))
    assert "5" not in stopped.text and stopped.output.stop_reason == "5"
    llm32.check_integrity()
