"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers
loading the same GGUF: greedy, token for token in float32, and by top-1
agreement in bfloat16; its Q4_1 weights run natively (int4 kernel) against the
same weights dequantized to bfloat16; plus the chat API end to end."""

from __future__ import annotations

import pytest
import torch

from tiny_models import teacher_forced_logits

from agentserve.engine.sampling_params import SamplingParams
from agentserve.llm import LLM
from agentserve.runner.attention import build_metadata
from agentserve.runner.linear import int4_unavailable
from agentserve.runner.loader import load_model

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
    llm = LLM(None, weights="bf16", device="cpu", kv_cache_tokens=4096, block_size=16)
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


# Teacher-forced text for the native-weights check: plain prose the model did not write.
STORY = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his father had "
    "taught him. There were one hundred and twelve of them, worn smooth in the middle by a century of boots. At the "
    "top he trimmed the wick, polished the great lens with a soft cloth, and lit the lamp. Then he sat by the window "
    "with a mug of tea and watched the beam sweep across the water. Ships passed far out on the horizon, their lights "
    "small and steady. Some nights a fishing boat came close enough that he could hear the engine and the voices of "
    "the crew. In winter the storms were fierce; waves broke against the rocks below and salt spray reached the "
    "glass. He kept a logbook of every vessel he saw, the weather, the temperature, and the hour the lamp was lit "
    "and put out. When the harbour authority installed an automatic light, they offered him a pension and a cottage "
    "in the village. He accepted the cottage but kept climbing the stairs each evening, out of habit, to watch the "
    "beam that no longer needed him. His daughter visited on Sundays and asked him why he still went up.")


@pytest.mark.skipif(int4_unavailable(torch.device("cpu")) is not None, reason="no int4 kernel in this torch")
def test_native_q4_weights_agree_with_dequantized_bfloat16():
    loaded = load_model(None, keep_quantized=True)
    opts = dict(device="cpu", kv_cache_tokens=1024, max_model_len=1024, block_size=16)
    native = LLM(loaded, weights="native", dtype="bfloat16", **opts)
    bf16 = LLM(loaded, weights="bf16", **opts)
    m = native.model
    # every projection of the 30 layers is Q4_1; the LM head is the tied Q8_0 embedding
    # (on the Q8_0 kernel where the native kernels are built, else in bf16)
    assert (m.weight_format, m.int4_linears, m.num_linears) == ("native", 120, 121)
    assert m.q8_linears == (1 if m.int4_kernel == "agentserve" else 0)
    assert m.weight_bytes < 0.5 * bf16.model.weight_bytes
    ids = native.tokenizer.encode(native.chat_template.render(
        [{"role": "user", "content": "Summarize this story in one sentence.\n\n" + STORY}]))
    assert len(ids) > 250
    dense = teacher_forced_logits(bf16, ids, len(ids))
    # prefill-sized forwards use the bf16 copies: bit for bit the bf16 weight format
    assert torch.equal(teacher_forced_logits(native, ids, len(ids)), dense)
    q4 = teacher_forced_logits(native, ids, native.model.int4_max_rows)  # decode-sized forwards: the int4 kernel
    top2 = dense.topk(2, dim=-1).values
    # logits here are 16-32, where one bf16 step is 0.125: a margin of one step is a tie
    clear = (top2[:, 0] - top2[:, 1]) > 0.2
    assert clear.sum() > 200
    agree = (q4.argmax(-1) == dense.argmax(-1))[clear].float().mean().item()
    assert agree >= 0.99, agree
    diff = q4 - dense
    assert diff.abs().mean().item() < 0.25
    assert (diff.pow(2).mean().sqrt() / dense.pow(2).mean().sqrt()).item() < 0.05
