"""Chat formats: a model file without a template gets its family's turn format
(runner/chat_formats.py: Gemma's turns, system folded into the first user
turn), its end-of-turn token stops generation, a family with no known format
keeps ChatML; and a Qwen3-style template's own tool format (Hermes
`<tool_call>` blocks, `<think>` reasoning) renders tools and history, and
the calls a model writes in it are parsed."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from agentserve.engine.sampling_params import SamplingParams
from agentserve.policy.toolcalls import parse_tool_calls
from agentserve.runner.chat_formats import GEMMA_TEMPLATE, apply_chat_format, format_for
from agentserve.runner.checkpoint import LoadedModel
from agentserve.runner.config import ModelConfig
from agentserve.runner.gguf_loader import open_gguf, read_metadata
from agentserve.runner.tokenizer import Tokenizer
from agentserve.server.chat_template import CHATML, ChatTemplate
from agentserve.server.tool_output import ToolCallStreamer, parse_tool_output, tool_choice_for
from gguf_fixtures import write_spm_gguf
from tiny_models import byte_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def gemma_tok(tmp_path_factory) -> Tokenizer:
    """The synthetic Gemma-style SentencePiece tokenizer (tests/gguf_fixtures.py)."""
    path = tmp_path_factory.mktemp("spm") / "gemma.gguf"
    write_spm_gguf(path, arch="gemma3")
    return Tokenizer.from_gguf_metadata(read_metadata(open_gguf(path)))


def _gemma() -> ChatTemplate:
    return ChatTemplate(GEMMA_TEMPLATE, "<bos>", "<eos>")


def _config(vocab: int, eos: list[int]) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1,
                       vocab_size=vocab, eos_token_ids=list(eos))


def _loaded(tok: Tokenizer, template: str | None, eos_in_config: bool = True) -> LoadedModel:
    return LoadedModel(_config(tok.vocab_size, tok.eos_token_ids if eos_in_config else []), {}, tok, template,
                       "test.gguf")


# --- Gemma's turns ------------------------------------------------------------------

def test_gemma_turns_fold_the_system_message_into_the_first_user_turn():
    t = _gemma()
    assert t.render([{"role": "user", "content": "Hi"}]) == \
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    msgs = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": " What is 2+2?\n"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
    assert t.render(msgs) == (
        "<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n4<end_of_turn>\n"
        "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n"
        "<start_of_turn>model\n")
    assert t.render(msgs[:3], add_generation_prompt=False).endswith("<start_of_turn>model\n4<end_of_turn>\n")
    assert t.render([{"role": "system", "content": "Only this."}]) == \
        "<bos><start_of_turn>user\nOnly this.<end_of_turn>\n<start_of_turn>model\n"


def test_gemma_turns_carry_tools_in_the_hermes_fallback():
    """The Gemma format does not take `tools`, so the Hermes fallback writes them
    into the first user turn, past calls into the model's turn and results as
    user turns; a call the model writes back in that form is parsed."""
    t = _gemma()
    msgs = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "18C, clear"}]
    text = t.render(msgs, tools=[WEATHER])
    first = text.split("<end_of_turn>")[0]
    assert first.startswith("<bos><start_of_turn>user\nYou help.\n\nYou may call one or more functions")
    assert json.dumps(WEATHER) in first and first.endswith("Weather in Paris?")
    assert ("<start_of_turn>model\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
            "</tool_call><end_of_turn>\n") in text
    assert text.endswith("<start_of_turn>user\n<tool_response>\n18C, clear\n</tool_response><end_of_turn>\n"
                         "<start_of_turn>model\n")
    reply = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lyon\"}}\n</tool_call>"
    content, calls = parse_tool_output(reply, tool_choice_for(["get_weather"], "auto"))
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Lyon"})]


def test_gemma_markers_are_single_tokens(gemma_tok):
    text = _gemma().render([{"role": "system", "content": "s"}, {"role": "user", "content": "the fox"}])
    ids = gemma_tok.encode(text)
    names = [gemma_tok.id_to_token(i) for i in ids]
    assert names[:2] == ["<bos>", "<start_of_turn>"] and names[-1] == "\n"
    assert names.count("<start_of_turn>") == 2 and names.count("<end_of_turn>") == 1
    last = len(names) - 1 - names[::-1].index("<start_of_turn>")
    assert "".join(names[last + 1:-1]) == "model"
    assert gemma_tok.decode(ids, skip_special_tokens=False) == text


def test_render_cache_with_gemma_turns_equals_full_tokenization(gemma_tok):
    from test_render_cache import agent_trials

    s = agent_trials(_gemma(), gemma_tok, seed=7, conversations=40)
    assert s.hits > 50 and s.reused_tokens > s.tokenized_tokens


# --- choosing the template --------------------------------------------------------------

def test_a_gemma_file_without_template_gets_gemma_turns(gemma_tok, caplog):
    loaded = _loaded(Tokenizer(gemma_tok.backend, bos_token_id=2, eos_token_ids=[1], add_bos_token=True), None)
    eot = loaded.tokenizer.token_to_id("<end_of_turn>")
    with caplog.at_level(logging.INFO, logger="agentserve"):
        apply_chat_format(loaded, "gemma3")
    assert loaded.chat_template == GEMMA_TEMPLATE
    assert loaded.tokenizer.eos_token_ids == [1, eot] and loaded.config.eos_token_ids == [1, eot]
    assert [r.getMessage() for r in caplog.records] == [
        "test.gguf has no chat template: chats are written in the gemma turn format "
        "(<start_of_turn> ... <end_of_turn>)"]


def test_a_gemma_file_with_its_own_template_keeps_it_and_stops_at_end_of_turn(gemma_tok, caplog):
    own = "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}"
    loaded = _loaded(Tokenizer(gemma_tok.backend, bos_token_id=2, eos_token_ids=[1]), own, eos_in_config=False)
    with caplog.at_level(logging.INFO, logger="agentserve"):
        apply_chat_format(loaded, "gemma3")
    assert loaded.chat_template == own and not caplog.records
    # the config had no EOS ids of its own, so the engine reads the tokenizer's
    assert loaded.tokenizer.eos_token_ids == [1, loaded.tokenizer.token_to_id("<end_of_turn>")]
    assert loaded.config.eos_token_ids == []


def test_other_families_keep_chatml(gemma_tok, caplog):
    tok = byte_tokenizer()
    loaded = _loaded(tok, None)
    with caplog.at_level(logging.INFO, logger="agentserve"):
        apply_chat_format(loaded, "llama")
    assert loaded.chat_template is None and ChatTemplate(loaded.chat_template).source == CHATML
    assert loaded.tokenizer.eos_token_ids == tok.eos_token_ids
    assert "no turn format is known for its architecture (llama): chats are written as ChatML" in caplog.text
    # a "gemma3" file whose vocabulary lacks Gemma's markers is not taken for Gemma
    assert format_for("gemma3", tok) is None and format_for("gemma3", gemma_tok) is not None
    assert format_for(None, gemma_tok) is None


def test_end_of_turn_stops_generation(gemma_tok):
    """A tiny random model whose LM head makes <end_of_turn> the first greedy
    token after the Gemma prompt: with the format applied the reply stops there;
    without it (EOS is only <eos>) it runs on to max_tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from agentserve.llm import LLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=gemma_tok.vocab_size, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, tie_word_embeddings=False,
                                      bos_token_id=2, eos_token_id=1, pad_token_id=0)).eval()
    messages = [{"role": "user", "content": "the quick brown fox"}]
    prompt = gemma_tok.encode(_gemma().render(messages))
    eot = gemma_tok.token_to_id("<end_of_turn>")
    with torch.no_grad():
        h = hf.model(torch.tensor([prompt])).last_hidden_state[0, -1]
        hf.lm_head.weight[eot] = 50 * h / h.norm()
        assert hf(torch.tensor([prompt])).logits[0, -1].argmax().item() == eot
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    params = SamplingParams(max_tokens=4, temperature=0.0)

    def reply(apply: bool):
        tok = Tokenizer(gemma_tok.backend, bos_token_id=2, eos_token_ids=[1], add_bos_token=True)
        loaded = LoadedModel(ModelConfig.from_hf(hf.config.to_dict(), name="tiny-gemma-turns"), dict(weights),
                             tok, None, "tiny")
        if apply:
            apply_chat_format(loaded, "gemma3")
        llm = LLM(loaded, dtype="float32", device="cpu", kv_cache_tokens=1024, speculate=0)
        out = llm.chat(messages, params)
        assert out.prompt == _gemma().render(messages) if apply else out.prompt.startswith("<|im_start|>")
        return out.output

    stopped = reply(True)
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1:] == [eot] and len(stopped.token_ids) == 1
    ran_on = reply(False)
    assert ran_on.finish_reason == "length" and len(ran_on.token_ids) == 4


# --- Qwen3's own template and tool format ------------------------------------------------

# A Qwen3-style template, written for this test from Qwen3's documented chat
# format: ChatML turns; with tools, a system turn listing them as JSON in
# <tools></tools> and asking for <tool_call>{"name", "arguments"}</tool_call>;
# an assistant's calls written that way after its text; tool results gathered
# into one user turn of <tool_response> blocks; reasoning before the last user
# turn dropped from history, and an empty <think></think> when thinking is off.
QWEN3_STYLE = """\
{%- if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}{{ '\n' }}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}
{%- set content = message.content %}
{%- if '</think>' in content %}{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}
<|im_start|>assistant
{{ content }}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function else call %}
{%- if loop.first and content %}{{ '\\n' }}{% elif not loop.first %}{{ '\\n' }}{% endif %}
<tool_call>
{"name": "{{ fn.name }}", "arguments": {{ fn.arguments if fn.arguments is string else fn.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}

<tool_response>
{{ message.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}
{%- endif %}"""


def test_qwen3_template_renders_tools_calls_and_results_itself():
    t = ChatTemplate(QWEN3_STYLE, "", "<|im_end|>")
    assert t.supports_tools  # the model's own tool format, not the Hermes fallback
    msgs = [{"role": "system", "content": "You are a helpful agent."},
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": "<think>\nTwo cities.\n</think>\n\nLet me check.", "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
            {"role": "tool", "tool_call_id": "a", "content": "18C"},
            {"role": "tool", "tool_call_id": "b", "content": "24C"}]
    text = t.render(msgs, tools=[WEATHER])
    assert text.startswith("<|im_start|>system\nYou are a helpful agent.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text
    assert text.count("<|im_start|>system") == 1
    assert ("<|im_start|>assistant\nLet me check.\n<tool_call>\n"
            "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n"
            "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call><|im_end|>\n") in text
    assert "Two cities" not in text  # reasoning is not carried in the history
    assert ("<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n24C\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    assert text.endswith("<|im_start|>assistant\n")


QWEN3_REPLY = ("<think>\nThe user wants the weather in two cities; one call each.\n</think>\n\n"
               "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
               "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>")


def test_qwen3_tool_calls_are_parsed_whole_and_streamed():
    choice = tool_choice_for(["get_weather"], "auto")
    content, calls = parse_tool_output(QWEN3_REPLY, choice)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert content == "<think>\nThe user wants the weather in two cities; one call each.\n</think>"
    # token-sized pieces add up to the same calls and content
    s = ToolCallStreamer(choice)
    deltas = [s.feed(QWEN3_REPLY[i:i + 3]) for i in range(0, len(QWEN3_REPLY), 3)] + [s.finish()]
    assert "".join(d.content for d in deltas) == content
    assert [(c.name, json.loads(c.arguments)) for c in s.calls] == [(c.name, json.loads(c.arguments)) for c in calls]
    # the policy's tool-name detection (TTL statistics) reads the same format
    assert [(c.name, c.format) for c in parse_tool_calls(QWEN3_REPLY)] == [("get_weather", "hermes")] * 2


def test_qwen3_thinking_off_writes_an_empty_think_block():
    t = ChatTemplate(QWEN3_STYLE)
    out = t._template.render(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True,
                             enable_thinking=False)
    assert out.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
