"""The render/tokenize cache (server/render_cache.py): cached token ids equal a
full tokenization over many random conversations, turn orders, edits and
tools, with the tiny byte tokenizer, a small BPE trained here, and the
default model's own tokenizer and template; its bounds and counters; and end
to end through the server."""

from __future__ import annotations

import glob
import json
import os
import random
from array import array

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from agentserve.runner.tokenizer import Tokenizer
from agentserve.server.app import create_app
from agentserve.server.chat_template import CHATML, ChatTemplate
from agentserve.server.engine_snapshot import EngineSnapshot
from agentserve.server.server_state import ServerConfig
from agentserve.server.render_cache import (RenderCache, RenderCacheStats, common_prefix_length, prefix_keys,
                                            splitting_token_ids)
from agentserve.server.stats_log import stats_line
from server_fixtures import ScriptedExecutor, ServerThread, tiny_llm
from tiny_models import SPECIALS, byte_tokenizer

SRC = os.path.join(os.path.dirname(__file__), "..", "src", "agentserve")
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]

# pieces of text an agent's conversation holds, the awkward ones for BPE among them
FRAGMENTS = ["the", " cat", " sat", "  ", "\n", "\n\n", "\t", "   \n", "x", "2024", " 17", "3.14", "é", "日本語",
             "🙂",
             "def f(a, b):\n    return a + b\n", "{\"path\": \"src/a.py\"}", "<|im_end|>", "<|im_start|>", "<|im_",
             "|>", "'s", " don't", "!!", "...", "  x  ", "\r\n", "über", "NaN", "    ", "_", "--", "==", "`", "ab"]


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(FRAGMENTS) for _ in range(n))


def random_message(rng: random.Random, i: int) -> dict:
    kind = rng.random()
    if kind < 0.25:
        args = json.dumps({"path": random_text(rng, 2)})
        return {"role": "assistant", "content": random_text(rng, rng.randrange(0, 4)),
                "tool_calls": [{"id": f"c{i}", "type": "function", "function": {"name": "read_file",
                                                                                "arguments": args}}]}
    if kind < 0.5:
        return {"role": "tool", "tool_call_id": f"c{i}", "content": random_text(rng, rng.randrange(0, 40))}
    if kind < 0.75:
        return {"role": "assistant", "content": random_text(rng, rng.randrange(0, 12))}
    return {"role": "user", "content": random_text(rng, rng.randrange(0, 12))}


def random_conversation(rng: random.Random, n: int) -> list[dict]:
    msgs = [{"role": "system", "content": random_text(rng, 3)}] if rng.random() < 0.5 else []
    return msgs + [random_message(rng, i) for i in range(n)]


def edited(rng: random.Random, msgs: list[dict]) -> list[dict]:
    """The conversation with one character inserted into one message."""
    msgs = [dict(m) for m in msgs]
    m = rng.choice(msgs)
    pos = rng.randrange(len(m["content"]) + 1)
    m["content"] = m["content"][:pos] + rng.choice(FRAGMENTS) + m["content"][pos:]
    return msgs


def reference(template: ChatTemplate, tok: Tokenizer, msgs: list[dict], tools) -> list[int]:
    return tok.encode(template.render(msgs, tools=tools))


def agent_trials(template: ChatTemplate, tok: Tokenizer, seed: int, conversations: int, capacity: int = 6,
                 max_len: int = 14) -> RenderCacheStats:
    """Agents growing conversations turn by turn (with retries, edits, forks and tools
    switched), each request checked against a full tokenization."""
    rng = random.Random(seed)
    cache = RenderCache(template, tok, capacity=capacity)
    for _ in range(conversations):
        full = random_conversation(rng, rng.randrange(2, max_len))
        tools = TOOLS if rng.random() < 0.5 else None
        k = rng.randrange(1, 3)
        while k <= len(full):
            msgs = full[:k]
            r = rng.random()
            if r < 0.1:
                msgs = edited(rng, msgs)  # the client rewrote its history
            elif r < 0.15:
                tools = None if tools else TOOLS
            assert cache.encode_chat(msgs, tools) == reference(template, tok, msgs, tools), msgs
            if rng.random() < 0.1:  # a retry of the same request
                assert cache.encode_chat(msgs, tools) == reference(template, tok, msgs, tools)
            if rng.random() < 0.1:  # a fork from an earlier point
                j = rng.randrange(1, k + 1)
                fork = full[:j] + [random_message(rng, 99)]
                assert cache.encode_chat(fork, tools) == reference(template, tok, fork, tools)
            k += rng.randrange(1, 4)
    return cache.stats()


@pytest.fixture(scope="module")
def bpe_tokenizer() -> Tokenizer:
    """A byte-level BPE with 1500 merges learned from this package's source, the ChatML markers special."""
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])
    backend.decoder = decoders.ByteLevel()
    files = sorted(glob.glob(os.path.join(SRC, "**", "*.py"), recursive=True))[:40]
    trainer = trainers.BpeTrainer(vocab_size=1800, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train(files, trainer)
    return Tokenizer(backend, eos_token_ids=[backend.token_to_id("<|im_end|>")])


@pytest.fixture(scope="module")
def smollm():
    """The default model's tokenizer and chat template, read from its GGUF metadata only."""
    from agentserve.runner.gguf_loader import open_gguf, read_metadata
    from agentserve.runner.loader import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"default model not installed: {e}")
    meta = read_metadata(open_gguf(path))
    return Tokenizer.from_gguf_metadata(meta), ChatTemplate(meta.get("tokenizer.chat_template"))


# --- equal to a full tokenization ----------------------------------------------------


def test_byte_tokenizer_random_conversations():
    s = agent_trials(ChatTemplate(CHATML), byte_tokenizer(), seed=1, conversations=60)
    assert s.hits > 100 and s.reused_tokens > s.tokenized_tokens


def test_trained_bpe_random_conversations(bpe_tokenizer):
    assert len(bpe_tokenizer.backend.get_vocab()) > 1000  # real merges: splits inside words are not safe
    s = agent_trials(ChatTemplate(CHATML), bpe_tokenizer, seed=2, conversations=60)
    assert s.hits > 100 and s.reused_tokens > s.tokenized_tokens


def test_default_model_tokenizer_random_conversations(smollm):
    tok, template = smollm
    s = agent_trials(template, tok, seed=3, conversations=50)
    assert s.hits > 80 and s.reused_tokens > s.tokenized_tokens


def test_default_model_agent_reading_files(smollm):
    """A coding agent's conversation as it grows to ~20k tokens: each turn tokenizes only its delta."""
    tok, template = smollm
    cache = RenderCache(template, tok)
    files = sorted(glob.glob(os.path.join(SRC, "**", "*.py"), recursive=True))
    msgs = [{"role": "user", "content": "Find the bug."}]
    for i, f in enumerate(files[:40]):
        args = json.dumps({"path": f})
        msgs.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "read_file", "arguments": args}}]})
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": open(f).read()[:2500]})
        before = cache.stats()
        assert cache.encode_chat(msgs, TOOLS) == reference(template, tok, msgs, TOOLS)
        after = cache.stats()
        if i:
            assert after.hits == before.hits + 1
            assert after.tokenized_tokens - before.tokenized_tokens < 1200  # ~one file's tokens, not the whole
    assert after.reused_tokens > 10 * after.tokenized_tokens / 2


def test_generation_prompt_that_is_not_a_prefix_of_the_reply():
    """The cached prompt ends in a generation prompt the next turn renders differently:
    the split falls back to an earlier cut point and the ids are still exact."""
    src = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant (thinking)\n{% endif %}")
    template, tok = ChatTemplate(src), byte_tokenizer()
    cache = RenderCache(template, tok)
    msgs = [{"role": "user", "content": "hi"}]
    cache.encode_chat(msgs)
    msgs += [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    assert cache.encode_chat(msgs) == reference(template, tok, msgs, None)
    s = cache.stats()
    assert (s.misses, s.hits, s.fallbacks) == (1, 1, 0) and s.reused_tokens > 0


def test_a_cut_the_window_contradicts_falls_back_to_a_full_tokenization():
    template, tok = ChatTemplate(CHATML), byte_tokenizer()
    cache = RenderCache(template, tok)
    msgs = [{"role": "user", "content": "hi there"}]
    cache.encode_chat(msgs)
    (key, entry), = cache._entries.items()
    bad = array("i", entry.ids)
    j = entry.split_tokens[-2]  # the "\n" between the last two cuts: no longer what the text says
    assert bad[j] == ord("\n")
    bad[j] = ord("x")
    cache._entries[key] = type(entry)(entry.text, bad, entry.split_tokens, entry.split_chars)
    msgs = msgs + [{"role": "assistant", "content": "yes"}]
    assert cache.encode_chat(msgs) == reference(template, tok, msgs, None)
    assert cache.stats().fallbacks == 1


def test_retry_reuses_everything_and_tools_key_the_entry():
    template, tok = ChatTemplate(CHATML), byte_tokenizer()
    cache = RenderCache(template, tok)
    msgs = [{"role": "user", "content": "hi"}]
    ids = cache.encode_chat(msgs, TOOLS)
    assert cache.encode_chat(msgs, TOOLS) == ids
    s = cache.stats()
    assert (s.misses, s.hits, s.reused_tokens, s.tokenized_tokens) == (1, 1, len(ids), len(ids))
    cache.encode_chat(msgs, None)  # other tools: another prompt, looked up under another key
    assert cache.stats().misses == 2


# --- pieces, bounds, off ---------------------------------------------------------------


def test_common_prefix_length():
    rng = random.Random(0)
    assert common_prefix_length("", "") == 0 and common_prefix_length("abc", "abc") == 3
    assert common_prefix_length("abc", "abcd") == 3 and common_prefix_length("abcd", "abc") == 3
    for _ in range(500):
        a = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 30)))
        b = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 30)))
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert common_prefix_length(a, b) == n


def test_prefix_keys_are_chained():
    m = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    k2 = prefix_keys(m, None)
    assert len(k2) == 2 and prefix_keys(m[:1], None) == k2[:1]
    assert prefix_keys(m, TOOLS)[0] != k2[0]
    assert prefix_keys([m[1], m[0]], None)[1] != k2[1]


def test_splitting_tokens_exclude_stripping_and_nested_added_tokens():
    tok = byte_tokenizer()
    assert splitting_token_ids(tok) == {256, 257}
    from tokenizers import AddedToken
    tok.backend.add_special_tokens([AddedToken("<s>", rstrip=True), AddedToken("<|im_end|>x", normalized=False)])
    ids = splitting_token_ids(tok)
    assert tok.token_to_id("<s>") not in ids and 257 not in ids and 256 in ids


def test_no_added_tokens_means_no_reuse_but_exact_ids():
    backend = byte_tokenizer().backend
    plain = HFTokenizer(models.BPE(vocab=backend.get_vocab(with_added_tokens=False), merges=[]))
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok = Tokenizer(plain)
    cache = RenderCache(ChatTemplate(CHATML), tok)
    assert not cache.enabled
    msgs = [{"role": "user", "content": "hi"}]
    assert cache.encode_chat(msgs) == reference(ChatTemplate(CHATML), tok, msgs, None)
    assert cache.stats() == RenderCacheStats()


def test_lru_bounds_by_entries_and_tokens():
    template, tok = ChatTemplate(CHATML), byte_tokenizer()
    cache = RenderCache(template, tok, capacity=3)
    for i in range(5):
        cache.encode_chat([{"role": "user", "content": f"conversation {i}"}])
    s = cache.stats()
    assert s.entries == 3 and s.tokens == sum(len(e.ids) for e in cache._entries.values())
    small = RenderCache(template, tok, capacity=100, max_tokens=120)  # 53 tokens a prompt
    for i in range(5):
        small.encode_chat([{"role": "user", "content": f"conversation {i}" + "x" * 20}])
    assert small.stats().tokens <= 120 and small.stats().entries == 2
    small.encode_chat([{"role": "user", "content": "y" * 200}])  # larger than the whole budget: not kept
    assert small.stats().entries == 2


def test_stats_line_and_snapshot_fields():
    base = dict(num_running=0, num_waiting=0, num_blocks=100, num_free_blocks=100, num_pinned_blocks=0,
                num_pinned_programs=0, block_size=16, steps=0, preemptions=0, admitted_prompt_tokens=0,
                hit_tokens=0, loaded_tokens=0, pins_created=0, pins_hit=0, pins_expired=0, pins_reclaimed=0,
                pins_released_early=0, pins_released_at_end=0, executed_steps=1)
    a = EngineSnapshot.of(**base, render_cache=RenderCacheStats(hits=1, misses=1, reused_tokens=10,
                                                             tokenized_tokens=10))
    b = EngineSnapshot.of(**dict(base, executed_steps=5), render_cache=RenderCacheStats(
        hits=10, misses=2, fallbacks=1, reused_tokens=910, tokenized_tokens=110))
    assert "render cache 9 hits 1 misses 1 fallbacks, 90% of chat prompt tokens reused" in stats_line(a, b, 10.0)
    assert "render cache" not in stats_line(a, EngineSnapshot.of(**dict(base, executed_steps=5),
                                                              render_cache=a.render_cache), 10.0)


# --- end to end ----------------------------------------------------------------------------


def _metric(text: str, name: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    raise KeyError(name)


@pytest.mark.parametrize("entries", [256, 0])
def test_server_multi_turn_counts_and_ids(entries):
    llm = tiny_llm()
    scripted = ScriptedExecutor(llm.engine.executor)
    llm.engine.executor = scripted
    srv = ServerThread(create_app(llm, ServerConfig(["tiny"], render_cache=entries))).start()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30)
        scripted.script("rc", "Done.")
        msgs = [{"role": "user", "content": "Read the file."}]
        for turn in range(4):
            r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=8,
                                               extra_headers={"X-Program-Id": "rc"})
            assert r.usage.prompt_tokens == len(reference(llm.chat_template, llm.tokenizer, msgs, TOOLS))
            msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": f"Turn {turn}: go on."}]
        import httpx
        text = httpx.get(srv.url + "/metrics").text
        if entries:
            assert _metric(text, "agentserve:render_cache_hits_total") == 3
            assert _metric(text, "agentserve:render_cache_misses_total") == 1
            assert _metric(text, "agentserve:render_cache_reused_tokens_total") > 0
            assert _metric(text, "agentserve:render_cache_entries") == 4
        else:
            assert "render_cache" not in text
    finally:
        srv.stop()


def test_render_cost_benchmark_runs(tmp_path):
    from benchmarks.render_cost import measure

    r = measure(byte_tokenizer(), ChatTemplate(CHATML), 12000, repeats=2)  # a byte a token
    assert r["prompt_tokens"] >= 12000 and 0 < r["tokenized_on_next_turn"] < r["prompt_tokens"] / 2
    assert set(r["median_cpu_ms"]) == {"parse", "off", "on", "retry", "render"}
    json.dumps(r)
