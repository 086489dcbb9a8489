"""The OpenAI-compatible server, end to end: a real uvicorn server on loopback
with the tiny random model, driven by the official `openai` client (and httpx
where a test needs a malformed request). Tool-call output logic is tested on
its own (tool_output.py), and end to end with scripted model output."""

from __future__ import annotations

import argparse
import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentserve.server.identity import IdentityError, resolve_identity
from agentserve.server.protocol import ChatCompletionRequest
from agentserve.server.tool_output import (ToolCallStreamer, ToolChoiceError, parse_tool_output,
                                           tool_choice_for)
from server_fixtures import start_tiny_server, idle

KEY = "test-key"
BS = 4  # the tiny server's block size
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def server():
    srv, llm, scripted = start_tiny_server(api_key=KEY)
    srv.llm, srv.scripted, srv.engine = llm, scripted, srv.app.state.server.engine
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)


def pinned(server, pid: str) -> bool:
    return server.engine.call_sync(lambda: pid in server.llm.kv.pins)


def sample(server, name: str, labels: dict | None = None) -> float:
    v = server.app.state.server.metrics.registry.get_sample_value(name, {"model_name": "tiny", **(labels or {})})
    return v or 0.0


def chat(client, content: str = "hello", **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], **kw)


# --- happy paths ----------------------------------------------------------------------


def test_health_models_and_plain_chat(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list()] == ["tiny", "tiny-alias"]
    r = chat(client, max_tokens=10)
    assert r.object == "chat.completion" and r.model == "tiny" and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    u = r.usage
    assert 1 <= u.completion_tokens <= 10 and u.prompt_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0
    # the alias is accepted; an anonymous request is its own program and pins nothing
    assert client.chat.completions.create(model="tiny-alias", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=2).model == "tiny"
    idle(server)
    assert server.engine.call_sync(lambda: len(server.llm.kv.pins)) == 0


def test_streaming_matches_non_streaming_and_reports_usage(server, client):
    kw = dict(max_tokens=16, temperature=0, seed=1)
    whole = chat(client, "stream me", **kw)
    chunks = list(chat(client, "stream me", stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    # the second identical prompt found the first one's blocks
    assert last.usage.prompt_tokens_details.cached_tokens >= (whole.usage.prompt_tokens - 1) // BS * BS
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_text_tokens_and_stream(server, client):
    r = client.completions.create(model="tiny", prompt="Once upon", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.usage.prompt_tokens == len("Once upon".encode())
    r2 = client.completions.create(model="tiny", prompt=list("Once upon".encode()), max_tokens=8, temperature=0)
    assert r2.choices[0].text == r.choices[0].text
    parts = list(client.completions.create(model="tiny", prompt="Once upon", max_tokens=8, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in parts if p.choices) == r.choices[0].text
    assert parts[-1].usage.completion_tokens == r.usage.completion_tokens
    stop = client.completions.create(model="tiny", prompt="Once upon", max_tokens=8, temperature=0,
                                     stop=[r.choices[0].text[2:4]] if len(r.choices[0].text) >= 4 else None)
    assert len(stop.choices[0].text) <= len(r.choices[0].text)


def test_multi_turn_program_reuses_turn_one(server, client):
    """Turn 2 of a program (X-Program-Id) gets turn 1's prompt *and output* from the cache."""
    pid = "agent-multi"
    server.scripted.script(pid, CALL_TEXT)
    msgs = [{"role": "system", "content": "You are a weather bot."},
            {"role": "user", "content": "What is the weather in Paris?"}]
    hdr = {"X-Program-Id": pid, "X-Program-TTL": "60"}
    r1 = client.chat.completions.create(model="tiny", messages=msgs, tools=WEATHER, extra_headers=hdr)
    c1 = r1.choices[0]
    assert c1.finish_reason == "tool_calls" and c1.message.content is None
    (call,) = c1.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert pinned(server, pid), "a tool-calling turn with a TTL hint keeps its KV pinned"

    server.scripted.script(pid, "It is sunny in Paris.")
    msgs += [c1.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}]
    r2 = client.chat.completions.create(model="tiny", messages=msgs, tools=WEATHER,
                                        extra_headers={"X-Program-Id": pid, "X-Program-End": "true"})
    assert r2.choices[0].message.content == "It is sunny in Paris." and r2.choices[0].finish_reason == "stop"
    covered = r1.usage.prompt_tokens + r1.usage.completion_tokens - 1  # the last sampled token has no KV
    assert r2.usage.prompt_tokens_details.cached_tokens >= covered // BS * BS
    assert r2.usage.prompt_tokens > covered
    idle(server)
    assert not pinned(server, pid), "the program ended"
    assert sample(server, "agentserve:program_jct_seconds_count") >= 1
    assert sample(server, "agentserve:pin_ttl_seconds_sum") >= 60


def test_streamed_tool_call(server, client):
    pid = "agent-stream-tool"
    server.scripted.script(pid, "Checking.\n" + CALL_TEXT + "\n")
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=WEATHER, stream=True,
        extra_body={"program_id": pid, "end_program": True}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert content == "Checking."
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].id.startswith("call_")
    assert deltas[0].function.name == "get_weather"
    assert json.loads(deltas[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    idle(server)
    assert not pinned(server, pid)


def test_tool_choice_variants(server, client):
    msgs = [{"role": "user", "content": "Weather?"}]
    server.scripted.script("agent-none", CALL_TEXT)
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=WEATHER, tool_choice="none",
                                       extra_headers={"X-Program-Id": "agent-none", "X-Program-End": "1"})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == CALL_TEXT
    # a named tool the model did not call: what it wrote, finish_reason stop
    two = WEATHER + [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    server.scripted.script("agent-named", CALL_TEXT)
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=two,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       extra_headers={"X-Program-Id": "agent-named", "X-Program-End": "1"})
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    server.scripted.script("agent-req", CALL_TEXT)
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=two, tool_choice="required",
                                       extra_headers={"X-Program-Id": "agent-req", "X-Program-End": "1"})
    assert r.choices[0].finish_reason == "tool_calls"
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model="tiny", messages=msgs, tools=WEATHER,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        client.chat.completions.create(model="tiny", messages=msgs, tool_choice="required")
    idle(server)


def test_a_call_cut_by_max_tokens_is_dropped_and_no_call_means_no_tool_calls_field(server, client):
    msgs = [{"role": "user", "content": "Weather?"}]
    server.scripted.script("agent-cut", "Let me look. " + CALL_TEXT)
    kw = dict(model="tiny", messages=msgs, tools=WEATHER, max_tokens=30,
              extra_headers={"X-Program-Id": "agent-cut", "X-Program-End": "1"})
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "length" and c.message.content == "Let me look."
    assert not c.message.tool_calls and "<tool_call>" not in c.message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Let me look."
    assert chunks[-1].choices[0].finish_reason == "length"
    assert not any(ch.choices[0].delta.tool_calls for ch in chunks if ch.choices)
    # the raw body: OpenAI leaves tool_calls out when there are none (not `[]`)
    raw = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                     json={"model": "tiny", "messages": msgs, "max_tokens": 3}).json()
    assert "tool_calls" not in raw["choices"][0]["message"] and "content" in raw["choices"][0]["message"]
    # the model card names the weights' file, never where it lies on the server
    (card,) = [m for m in client.models.list().model_dump()["data"] if m["id"] == "tiny"]
    assert "/" not in card["root"] and "\\" not in card["root"]
    idle(server)


def test_release_and_end_program(server, client):
    pid = "agent-release"
    server.scripted.script(pid, CALL_TEXT)
    hdr = {"X-Program-Id": pid}
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}], tools=WEATHER,
                                   extra_headers=hdr, extra_body={"ttl": 60})
    assert pinned(server, pid)
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{server.url}/v1/programs/{pid}/release", headers=auth)
    assert r.json() == {"program_id": pid, "released": True} and not pinned(server, pid)
    # the body hint: release after this turn
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "b"}], tools=WEATHER,
                                   extra_headers=hdr, extra_body={"ttl": 60, "release_program": True})
    idle(server)
    assert not pinned(server, pid)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "c"}], tools=WEATHER,
                                   extra_headers=hdr, extra_body={"ttl": 60})
    before = sample(server, "agentserve:program_jct_seconds_count")
    r = httpx.post(f"{server.url}/v1/programs/{pid}/end", headers=auth)
    assert r.json()["ended"] and r.json()["known"] and not pinned(server, pid)
    assert sample(server, "agentserve:program_jct_seconds_count") == before + 1
    assert httpx.post(f"{server.url}/v1/programs/{pid}/end").status_code == 401
    idle(server)


# --- errors ----------------------------------------------------------------------------


def _error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_error_statuses(server, client):
    url, auth = server.url + "/v1/chat/completions", {"Authorization": f"Bearer {KEY}"}
    ok = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    def post(body=None, headers=auth, path=url, **kw):
        return httpx.post(path, json=body, headers=headers, **kw) if body is not None else \
            httpx.post(path, headers=headers, **kw)

    # 400: malformed body, schema, values, lengths
    r = post(headers={**auth, "Content-Type": "application/json"}, content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in _error(r)["message"]
    assert post(path=url, headers=auth, content=b"[1, 2]").status_code == 400
    assert post(path=url, headers=auth, content=b"[" * 30_000).status_code == 400  # too deep for json
    r = post({"model": "tiny"})
    assert r.status_code == 400 and _error(r)["param"] == "messages"
    assert post({**ok, "messages": []}).status_code == 400
    assert post({**ok, "messages": [{"role": "wizard", "content": "x"}]}).status_code == 400
    for bad, param in (({"n": 2}, "n"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                       ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 5000}, "max_tokens"),
                       ({"stop": ["a"] * 17}, "stop"), ({"logprobs": True}, "logprobs"),
                       ({"presence_penalty": 0.5}, "presence_penalty"), ({"ttl": -1, "program_id": "p"}, "ttl")):
        r = post({**ok, **bad})
        assert r.status_code == 400, (bad, r.text)
        assert _error(r)["param"] == param, (bad, r.text)
    r = post({**ok, "messages": [{"role": "user", "content": "x" * 2000}]})
    assert r.status_code == 400 and _error(r)["code"] == "context_length_exceeded"
    # the message names the model and a context that would hold the prompt and a reply
    assert "(tiny)" in _error(r)["message"] and "at least 4096 tokens" in _error(r)["message"]
    r = post(ok, headers={**auth, "X-Program-TTL": "soon"})
    assert r.status_code == 400 and _error(r)["param"] == "X-Program-TTL"
    with pytest.raises(openai.BadRequestError, match="not a token id"):
        client.completions.create(model="tiny", prompt=[1, 2, 99999], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="one prompt per request"):
        client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=2)
    # 401
    r = post(ok, headers={})
    assert r.status_code == 401 and _error(r)["code"] == "invalid_api_key"
    bad_key = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    # 404: unknown model, unknown route
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found"
    assert _error(httpx.get(server.url + "/v1/nothing", headers=auth))["code"] == "not_found"
    # 413
    r = post({**ok, "messages": [{"role": "user", "content": "x" * 70_000}]})
    assert r.status_code == 413 and _error(r)["code"] == "request_too_large"
    # 503: a full queue (max_queue 0 refuses every request deterministically)
    eng = server.engine
    eng.call_sync(lambda: setattr(eng, "max_queue", 0))
    try:
        with pytest.raises(openai.InternalServerError) as e:
            chat(client)
        assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
    finally:
        eng.call_sync(lambda: setattr(eng, "max_queue", 64))
    # none of it hurt the server
    idle(server)
    assert chat(client, max_tokens=2).usage.completion_tokens >= 1
    assert httpx.get(server.url + "/health").status_code == 200


def test_engine_failure_mid_stream_ends_with_an_error_event(server, client):
    server.scripted.fail_programs.add("BOOM")
    try:
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"})):
            events = []
            with httpx.stream("POST", server.url + path, timeout=30,
                              headers={"Authorization": f"Bearer {KEY}", "X-Program-Id": "BOOM"},
                              json={"model": "tiny", "max_tokens": 8, "stream": True, **body}) as r:
                assert r.status_code == 200
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            err = json.loads(events[-2])
            assert "injected executor failure" in err["error"]["message"], err
    finally:
        server.scripted.fail_programs.discard("BOOM")
    assert chat(client).choices[0].finish_reason == "length"  # the server goes on
    idle(server)


def test_client_disconnect_aborts_and_frees_kv(server, client):
    aborts = sample(server, "agentserve:request_success_total", {"finished_reason": "abort"})
    long = dict(max_tokens=900, extra_body={"ignore_eos": True})
    with chat(client, "a long story", stream=True, **long) as stream:
        for i, _ in enumerate(stream):
            if i == 3:
                break  # leaving the block closes the connection mid-stream
    # a non-streaming request whose client gives up
    with pytest.raises(openai.APITimeoutError):
        chat(client, "another long story", timeout=0.5, **long)
    idle(server)
    assert sample(server, "agentserve:request_success_total", {"finished_reason": "abort"}) == aborts + 2
    kv = server.llm.kv
    free, total, held = server.engine.call_sync(lambda: (kv.num_free_blocks, kv.num_blocks, kv.num_pinned_blocks))
    assert free == total - held, "every block not held by a pin is free"


def test_concurrent_mixed_traffic_leaks_nothing(server, client):
    """Streams that finish, streams dropped midway, programs with several turns, all at once."""
    from concurrent.futures import ThreadPoolExecutor

    def job(i: int) -> int:
        kind = i % 4
        if kind == 0:
            return chat(client, f"job {i}", max_tokens=20, extra_headers={"X-Program-Id": f"mix-{i % 3}"}) \
                .usage.completion_tokens
        if kind == 1:
            return len(list(chat(client, f"job {i}", max_tokens=20, stream=True, temperature=0.8, seed=i)))
        if kind == 2:
            with chat(client, f"job {i}", stream=True, max_tokens=400, extra_body={"ignore_eos": True}) as s:
                return sum(1 for _, _ in zip(range(2), s))
        return client.completions.create(model="tiny", prompt=f"job {i}", max_tokens=10).usage.completion_tokens

    with ThreadPoolExecutor(12) as ex:
        assert all(n > 0 for n in ex.map(job, range(24)))
    idle(server)
    kv = server.llm.kv
    free, total, held = server.engine.call_sync(lambda: (kv.num_free_blocks, kv.num_blocks, kv.num_pinned_blocks))
    assert free == total - held


def test_metrics_endpoint(server, client):
    chat(client, "metrics please", max_tokens=4)
    r = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})  # behind the key
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "pinned_blocks",
                 "pinned_programs", "prompt_tokens", "prefix_hit_tokens", "pins_expired", "pins_hit",
                 "pins_reclaimed", "time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds", "program_jct_seconds",
                 "pin_ttl_seconds", "request_success", "generation_tokens", "host_kv_blocks", "disk_kv_blocks",
                 "disk_kv_blocks_written", "kv_tier_copy_failures", "kv_spill_backlog_waits", "running_kv_share",
                 "max_wait_seconds", "kv_pressure"):
        assert "agentserve:" + name in fams, name

    def value(name, suffix=""):
        return next(s.value for s in fams["agentserve:" + name].samples if s.name.endswith(name + suffix))

    assert value("kv_cache_blocks") == server.llm.kv.num_blocks
    assert 0.0 <= value("kv_cache_usage_perc") <= 1.0
    assert value("prompt_tokens", "_total") > 0 and value("time_to_first_token_seconds", "_count") > 0
    assert value("e2e_request_latency_seconds", "_count") > 0
    assert value("inter_token_latency_seconds", "_count") > 0
    share = server.engine.call_sync(lambda: server.llm.scheduler.policy.running_kv_share)
    assert 0.0 < value("running_kv_share") == share <= 1.0
    wait = server.engine.call_sync(lambda: server.llm.scheduler.policy.max_wait())
    assert value("max_wait_seconds") == (wait or 0.0) >= 0.0
    assert 0.0 <= value("kv_pressure") <= 1.0


# --- units: tool output, identity, CLI ---------------------------------------------------


def _stream_all(text: str, choice, step: int = 1):
    s = ToolCallStreamer(choice)
    content, calls = "", []
    for i in range(0, len(text), step):
        d = s.feed(text[i:i + step])
        content += d.content
        calls += d.calls
    d = s.finish()
    return content + d.content, calls + d.calls


CHOICE = tool_choice_for(["get_weather", "calc"], None)
CASES = [
    ("plain answer, no call  ", "plain answer, no call  ", []),
    ("Let me look.\n" + CALL_TEXT, "Let me look.", ["get_weather"]),
    (CALL_TEXT + "\n" + CALL_TEXT.replace("get_weather", "calc"), None, ["get_weather", "calc"]),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', '<tool_call>{"name": "rm_rf", '
     '"arguments": {}}</tool_call>', []),
    ("<tool_call>{not json}</tool_call> ok", "<tool_call>{not json}</tool_call> ok", []),
    ('<tool_call>{"name": "calc", "arguments": {"x": 1}}', None, ["calc"]),  # unclosed at the very end
    ('<tool_call>{"name": "calc", "arguments": {"x": 1', '<tool_call>{"name": "calc", "arguments": {"x": 1', []),
    ('{"name": "calc", "parameters": {"x": 2}}', None, ["calc"]),  # Llama 3 JSON
    ('{"answer": 42}', '{"answer": 42}', []),
    ("a < b and <tool is not a tag", "a < b and <tool is not a tag", []),
]


@pytest.mark.parametrize("text,content,names", CASES)
def test_tool_output_whole_and_streamed_agree(text, content, names):
    got_content, calls = parse_tool_output(text, CHOICE)
    assert got_content == content and [c.name for c in calls] == names
    for c in calls:
        assert isinstance(json.loads(c.arguments), dict) and c.id.startswith("call_")
    for step in (1, 3, 7):  # split points everywhere, including inside tags
        s_content, s_calls = _stream_all(text, CHOICE, step)
        assert (s_content or None if s_calls else s_content) == content
        assert [c.name for c in s_calls] == names


def test_tool_output_holds_back_only_what_may_be_a_call():
    s = ToolCallStreamer(CHOICE)
    assert s.feed("Hello <tool").content == "Hello"  # "<tool" (and the space) may start a call
    assert s.feed("box> ok").content == " <toolbox> ok"
    d = s.feed(" <tool_call>{\"name\": \"calc\", \"arguments\": {}}")
    assert d.content == "" and not d.calls  # inside a call: held
    d = s.feed("</tool_call>")
    assert [c.name for c in d.calls] == ["calc"] and d.content == ""


def test_tool_choice_rules():
    assert tool_choice_for([], None) is None and tool_choice_for(["a"], "none") is None
    assert tool_choice_for(["a", "b"], None, "b").allowed == {"b"}
    with pytest.raises(ToolChoiceError):
        tool_choice_for(["a"], None, "c")
    with pytest.raises(ToolChoiceError):
        tool_choice_for([], "required")
    one = tool_choice_for(["calc"], "auto", parallel=False)
    text = '<tool_call>{"name": "calc", "arguments": {}}</tool_call><tool_call>{"name": "calc", "arguments": {}}' \
           '</tool_call>'
    assert len(parse_tool_output(text, one)[1]) == 1
    assert parse_tool_output(CALL_TEXT, None) == (CALL_TEXT, [])


def _req(**body):
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})


def test_identity_resolution_order_and_hints():
    h = httpx.Headers({"X-Program-Id": "hdr", "X-Session-Id": "sess-h"})
    assert resolve_identity(_req(program_id="body", user="u"), h).program_id == "body"
    assert resolve_identity(_req(session_id="s", user="u"), h).program_id == "hdr"
    assert resolve_identity(_req(session_id="s", user="u"), httpx.Headers({})).source == "session_id"
    assert resolve_identity(_req(user="u"), httpx.Headers({"X-Session-Id": "sh"})).program_id == "sh"
    assert resolve_identity(_req(user="u"), httpx.Headers({})).program_id == "u"
    anon = resolve_identity(_req(), httpx.Headers({}))
    assert anon.program_id is None and anon.is_last_turn
    hinted = resolve_identity(_req(), httpx.Headers({"X-Program-Id": "p", "X-Program-TTL": "2.5",
                                                     "X-Program-End": "yes", "X-Program-Release": "0"}))
    assert (hinted.ttl, hinted.end_program, hinted.release_after, hinted.is_last_turn) == (2.5, True, False, True)
    # a retention hint on a request that names no program is ignored (no program to hold)
    assert resolve_identity(_req(), httpx.Headers({"X-Program-TTL": "3"})).ttl is None
    for headers in ({"X-Program-Id": "p", "X-Program-TTL": "inf"}, {"X-Program-Id": "p", "X-Program-End": "maybe"},
                    {"X-Program-Id": "p" * 300}):
        with pytest.raises(IdentityError):
            resolve_identity(_req(), httpx.Headers(headers))


def test_serve_cli_options_and_default_name():
    from agentserve.cli_serve import add_serve, default_served_name

    ap = argparse.ArgumentParser(prog="agentserve")
    add_serve(ap.add_subparsers(dest="command"))
    args = ap.parse_args(["serve", "--port", "9001", "--served-model-name", "a", "b", "--api-key", "k",
                          "--max-queue", "0", "--api-key", "k2"])
    assert (args.port, args.served_model_name, args.api_key, args.max_queue, args.host) == (
        9001, ["a", "b"], ["k", "k2"], 0, "127.0.0.1")
    assert args.model == "default" and args.func.__name__ == "cmd_serve"
    help_text = ap._subparsers._group_actions[0].choices["serve"].format_help()
    for flag in ("--served-model-name", "--max-queue", "--max-body-bytes", "--api-key", "--log-level",
                 "--api-keys-file", "--cached-tokens-report"):
        assert flag in help_text
    assert default_served_name("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert default_served_name("/m/Llama-3.2-1B-Instruct-Q4_K_M.gguf") == "Llama-3.2-1B-Instruct"
    assert default_served_name("/models/Qwen2.5-0.5B-Instruct") == "Qwen2.5-0.5B-Instruct"


def test_serve_step_time_target_option():
    from agentserve.cli_serve import add_serve
    from server_fixtures import tiny_llm

    ap = argparse.ArgumentParser(prog="agentserve")
    add_serve(ap.add_subparsers(dest="command"))
    assert ap.parse_args(["serve"]).max_step_ms_with_decodes == 200.0
    assert ap.parse_args(["serve", "--max-step-ms-with-decodes", "50"]).max_step_ms_with_decodes == 50.0
    for bad in ("-1", "nan", "fast"):
        with pytest.raises(SystemExit):
            ap.parse_args(["serve", "--max-step-ms-with-decodes", bad])
    assert tiny_llm().scheduler.config.max_step_ms_with_decodes == 200.0
    assert tiny_llm(max_step_ms_with_decodes=0).scheduler.config.max_step_ms_with_decodes == 0
