"""The prompt-deterministic response cache (server/response_cache.py): keys,
the collision guard, what is stored, and end to end through the server with
the tiny random model: a hit never reaches the engine, a streamed hit replays
the original's chunks, other sampling parameters miss, and the prompt-derived
seed makes unseeded temperature>0 outputs repeat after an eviction."""

from __future__ import annotations

import asyncio
import json
from array import array
from dataclasses import replace

import httpx
import openai
import pytest

from agentserve.engine.llm_engine import RequestOutput
from agentserve.engine.sampling_params import SamplingParams
from agentserve.server.app import create_app
from agentserve.server.engine_snapshot import EngineSnapshot
from agentserve.server.server_state import ServerConfig
from agentserve.server.response_cache import (CachedResponse, RecordingStream, ResponseCache, ResponseCacheStats,
                                              bypassed, prompt_seed, signature)
from agentserve.server.stats_log import stats_line
from server_fixtures import ScriptedExecutor, ServerThread, tiny_llm

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}]
CALL_TEXT = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


# --- pieces --------------------------------------------------------------------------------


def test_signature_covers_sampling_tenant_model_and_constraint():
    p = SamplingParams(max_tokens=8, temperature=0.7)
    base = signature(p, "Bearer a", "m")
    assert base == signature(SamplingParams(max_tokens=8, temperature=0.7), "Bearer a", "m")
    others = [signature(replace(p, max_tokens=9), "Bearer a", "m"),
              signature(replace(p, temperature=0.8), "Bearer a", "m"),
              signature(replace(p, top_p=0.9), "Bearer a", "m"), signature(replace(p, top_k=5), "Bearer a", "m"),
              signature(replace(p, seed=1), "Bearer a", "m"), signature(replace(p, stop=["x"]), "Bearer a", "m"),
              signature(replace(p, stop_token_ids=[3]), "Bearer a", "m"),
              signature(replace(p, ignore_eos=True), "Bearer a", "m"),
              signature(p, "Bearer b", "m"), signature(p, None, "m"), signature(p, "Bearer a", "m2")]
    assert len({base, *others}) == len(others) + 1
    assert "Bearer a" not in base  # the key is digested, never kept

    class Keyed:
        key = '{"schema": 1}'

    assert signature(replace(p, constraint=Keyed()), None, "m") != signature(p, None, "m")
    assert signature(replace(p, constraint=object()), None, "m") is None  # cannot say what it is: not cached


def test_prompt_seed_and_bypass_header():
    assert prompt_seed([1, 2, 3]) == prompt_seed(array("i", [1, 2, 3])) != prompt_seed([1, 2, 4])
    assert 0 <= prompt_seed(list(range(1000))) < 2**63
    assert bypassed({"cache-control": "no-cache"}) and bypassed({"cache-control": "max-age=0, No-Store"})
    assert not bypassed({}) and not bypassed({"cache-control": "max-age=60"})


def _entry(prompt: list[int], sig: str, text: str = "hi") -> CachedResponse:
    return CachedResponse(array("i", prompt), sig, (((1,), text),), "stop", None)


def test_lru_and_collision_guard():
    cache = ResponseCache(2)
    for i in range(3):
        p = array("i", [i])
        cache.put(cache.key(p, "s"), _entry([i], "s"))
    assert cache.get(cache.key(array("i", [0]), "s"), array("i", [0]), "s") is None  # evicted
    assert cache.get(cache.key(array("i", [2]), "s"), array("i", [2]), "s") is not None
    # a key that (as if by collision) names another prompt or other parameters is a miss
    k1 = cache.key(array("i", [1]), "s")
    assert cache.get(k1, array("i", [7]), "s") is None
    assert cache.get(k1, array("i", [1, 1]), "s") is None
    assert cache.get(k1, array("i", [1]), "t") is None
    assert cache.stats() == ResponseCacheStats(hits=1, misses=4, stores=3, bypassed=0, entries=2)


class _FakeStream:
    def __init__(self, outs: list[RequestOutput]) -> None:
        self.request_id = "r"
        self.outs = list(outs)
        self.finished = False
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if not self.outs:
            raise StopAsyncIteration
        out = self.outs.pop(0)
        self.finished = out.finished
        return out

    def close(self) -> None:
        self.closed = True


def _out(text: str, finished: bool = False, reason: str | None = None) -> RequestOutput:
    return RequestOutput("r", "p", [len(text)], text, [], "", finished, reason, None, 3, 0, 0.0, None, None, 0.0)


@pytest.mark.parametrize("reason,stored", [("stop", True), ("length", True), ("abort", False), (None, False)])
def test_only_finished_outputs_are_stored(reason, stored):
    async def run():
        cache = ResponseCache(4)
        outs = [_out("a"), _out("b")] + ([_out("", True, reason)] if reason else [])
        rec = RecordingStream(_FakeStream(outs), cache, b"k", array("i", [1]), "s")
        async for _ in rec:
            pass
        rec.close()
        assert rec.inner.closed
        return cache.stats().stores

    assert asyncio.run(run()) == int(stored)


def test_an_output_its_validator_stopped_as_undeclared_is_not_stored():
    """Such a stream ends where a re-generation takes over: it is not the client's answer."""
    class Validator:
        stop_reason = "undeclared"

    async def run():
        cache = ResponseCache(4)
        params = SamplingParams(max_tokens=4)
        params.tool_validator = Validator()  # whatever the engine version, an attribute it may carry
        rec = RecordingStream(_FakeStream([_out("a", True, "stop")]), cache, b"k", array("i", [1]), "s", params)
        async for _ in rec:
            pass
        return cache.stats().stores

    assert asyncio.run(run()) == 0


def test_stats_line_counts_hits_even_when_the_model_idles():
    base = dict(num_running=0, num_waiting=0, num_blocks=100, num_free_blocks=100, num_pinned_blocks=0,
                num_pinned_programs=0, block_size=16, steps=0, preemptions=0, admitted_prompt_tokens=0,
                hit_tokens=0, loaded_tokens=0, pins_created=0, pins_hit=0, pins_expired=0, pins_reclaimed=0,
                pins_released_early=0, pins_released_at_end=0)
    a = EngineSnapshot.of(**base, response_cache=ResponseCacheStats(hits=1, misses=2, entries=2))
    b = EngineSnapshot.of(**base, response_cache=ResponseCacheStats(hits=6, misses=3, entries=3))
    assert stats_line(a, b, 10.0) == "10 s: no model steps; response cache 5 hits 1 misses, 3 entries"
    assert stats_line(a, a, 10.0) is None


# --- end to end ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    llm = tiny_llm()
    scripted = ScriptedExecutor(llm.engine.executor)
    llm.engine.executor = scripted
    srv = ServerThread(create_app(llm, ServerConfig(["tiny"], response_cache=2))).start()
    srv.llm, srv.scripted, srv.engine = llm, scripted, srv.app.state.server.engine
    srv.cache = srv.app.state.server.response_cache
    srv.added = 0
    add = llm.engine.add_request

    def counting(*a, **kw):
        srv.added += 1
        return add(*a, **kw)

    llm.engine.add_request = counting
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="key-a", max_retries=0, timeout=30)


def chat(client, content: str, **kw):
    kw.setdefault("max_tokens", 12)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], **kw)


def _chunks(stream) -> list[dict]:
    """A stream's chunks without what differs per request (id, creation time, call ids)."""
    out = []
    for c in stream:
        d = c.model_dump(exclude={"id", "created"})
        for ch in d["choices"]:
            for tc in ch["delta"].get("tool_calls") or ():
                tc.pop("id", None)
        out.append(d)
    return out


def _sample(server, name: str) -> float:
    httpx.get(server.url + "/metrics")  # the cache counters come with the snapshot a scrape takes
    return server.app.state.server.metrics.registry.get_sample_value(name, {"model_name": "tiny"}) or 0.0


def test_a_hit_does_not_reach_the_engine(server, client):
    before = server.added
    r1 = chat(client, "first question", temperature=0.9)
    assert server.added == before + 1
    r2 = chat(client, "first question", temperature=0.9)
    assert server.added == before + 1
    assert r2.choices[0].message.content == r1.choices[0].message.content
    assert r2.choices[0].finish_reason == r1.choices[0].finish_reason and r2.id != r1.id
    u1, u2 = r1.usage, r2.usage
    assert (u2.prompt_tokens, u2.completion_tokens) == (u1.prompt_tokens, u1.completion_tokens)
    assert u2.prompt_tokens_details.cached_tokens == u2.prompt_tokens
    text = httpx.get(server.url + "/metrics").text
    assert "agentserve:response_cache_hits_total" in text
    assert _sample(server, "agentserve:response_cache_hits_total") >= 1
    assert _sample(server, "agentserve:response_cache_entries") >= 1


def test_streamed_hit_replays_the_original_chunks(server, client):
    server.scripted.script("stream-tool", CALL_TEXT)
    kw = dict(tools=WEATHER, stream=True, stream_options={"include_usage": True},
              extra_headers={"X-Program-Id": "stream-tool"}, max_tokens=128)
    before = server.added
    first = _chunks(chat(client, "Weather in Paris?", **kw))
    assert server.added == before + 1
    again = _chunks(chat(client, "Weather in Paris?", **kw))
    assert server.added == before + 1
    assert again[:-1] == first[:-1] and len(first) > 5
    assert any(ch["delta"].get("tool_calls") for c in first for ch in c["choices"])
    u1, u2 = first[-1]["usage"], again[-1]["usage"]
    assert u2["completion_tokens"] == u1["completion_tokens"] and u2["prompt_tokens"] == u1["prompt_tokens"]
    assert u2["prompt_tokens_details"]["cached_tokens"] == u2["prompt_tokens"]
    # the same response, not streamed
    whole = chat(client, "Weather in Paris?", tools=WEATHER, max_tokens=128)
    assert server.added == before + 1
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content == "Checking."


def test_completions_hit_and_stream(server, client):
    before = server.added
    r1 = client.completions.create(model="tiny", prompt="Once upon", max_tokens=8, temperature=0)
    parts = list(client.completions.create(model="tiny", prompt="Once upon", max_tokens=8, temperature=0,
                                           stream=True))
    assert server.added == before + 1
    assert "".join(p.choices[0].text for p in parts) == r1.choices[0].text


def test_other_sampling_parameters_tenants_or_cache_control_miss(server, client):
    chat(client, "vary me", temperature=0.5)
    before = server.added
    for kw in (dict(temperature=0.6), dict(temperature=0.5, max_tokens=11), dict(temperature=0.5, top_p=0.9),
               dict(temperature=0.5, seed=7), dict(temperature=0.5, stop=["zz"])):
        chat(client, "vary me", **kw)
    assert server.added == before + 5
    other = openai.OpenAI(base_url=server.url + "/v1", api_key="key-b", max_retries=0, timeout=30)
    chat(other, "vary me", temperature=0.5)  # another API key: another tenant
    assert server.added == before + 6
    for parallel in (True, False):  # the tool choice decides what the output may hold
        chat(client, "vary me", temperature=0.5, tools=WEATHER, parallel_tool_calls=parallel)
    assert server.added == before + 8
    before += 2
    bypass = _sample(server, "agentserve:response_cache_bypassed_total")
    chat(client, "vary me", temperature=0.5, extra_headers={"Cache-Control": "no-cache"})
    assert server.added == before + 7
    assert _sample(server, "agentserve:response_cache_bypassed_total") == bypass + 1


def test_prompt_seed_repeats_sampled_outputs_after_eviction(server, client):
    kw = dict(temperature=2.0, max_tokens=16)  # OpenAI's highest temperature: varied samples
    a1 = chat(client, "sample me", **kw).choices[0].message.content
    for other in ("evict one", "evict two"):  # the cache holds 2 entries
        chat(client, other, **kw)
    before = server.added
    a2 = chat(client, "sample me", **kw).choices[0].message.content
    assert server.added == before + 1  # generated again, not a hit
    assert a2 == a1
    # and it is a sample: explicit seeds give other outputs
    seeded = {chat(client, "sample me", seed=s, **kw).choices[0].message.content for s in (1, 2, 3)}
    assert seeded - {a1}


def test_a_hit_still_ends_the_program(server, client):
    pid = "hit-end"
    server.scripted.script(pid, CALL_TEXT)
    kw = dict(tools=WEATHER, max_tokens=128, extra_headers={"X-Program-Id": pid, "X-Program-TTL": "60"})
    chat(client, "Weather in Lyon?", **kw)
    assert server.engine.call_sync(lambda: pid in server.llm.kv.pins)  # pinned across its tool call
    before = server.added
    r = chat(client, "Weather in Lyon?", extra_body={"end_program": True}, **kw)
    assert server.added == before and r.choices[0].finish_reason == "tool_calls"
    assert not server.engine.call_sync(lambda: pid in server.llm.kv.pins)


def test_off_by_default_and_from_the_command_line():
    assert ServerConfig(["m"]).response_cache == 0
    import argparse

    from agentserve.cli_serve import add_serve

    parser = argparse.ArgumentParser()
    add_serve(parser.add_subparsers())
    args = parser.parse_args(["serve"])
    assert args.response_cache == 0 and args.render_cache == 256
    args = parser.parse_args(["serve", "--response-cache", "64", "--render-cache", "0"])
    assert args.response_cache == 64 and args.render_cache == 0
    json.dumps(vars(args), default=str)
