"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) end
to end: a real server on loopback with the tiny random model, driven by the
official `anthropic` client and LangChain's ChatAnthropic as a user would, by
httpx where a test needs a raw stream or a malformed request, and by a request
fixture in the shape Claude Code sends (system blocks with cache_control and
its per-request billing line, 16 tools, the session header, stream: true)
replayed over several turns. Scripted model output (ScriptedExecutor) stands
in for a model that writes tool calls."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid

import anthropic
import httpx
import pytest

from agentserve.llm import LLM
from agentserve.server.app import create_app
from agentserve.server.messages_endpoint import _with_pings
from agentserve.server.server_state import ServerConfig
from server_fixtures import ScriptedExecutor, ServerThread, idle
from tiny_models import DEVICE, byte_tokenizer, hf_llama, loaded

KEY = "test-key"
CONTEXT = 12288  # Claude Code's tools and system prompt are long (one token per byte here)
WEATHER = {"name": "get_weather", "description": "Current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def call_text(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


@pytest.fixture(scope="module")
def server():
    hf = hf_llama()
    hf.config.max_position_embeddings = CONTEXT  # the tiny model's own 1024 holds no Claude Code prompt
    llm = LLM(loaded(hf, byte_tokenizer()), dtype="float32", device=DEVICE, kv_cache_tokens=6 * CONTEXT,
              block_size=4, max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=CONTEXT)
    scripted = ScriptedExecutor(llm.engine.executor)
    llm.engine.executor = scripted
    app = create_app(llm, ServerConfig(["tiny", "tiny-alias"], api_key=KEY, max_queue=64,
                                       max_body_bytes=256 * 1024))
    srv = ServerThread(app).start()
    srv.llm, srv.scripted, srv.engine = llm, scripted, app.state.server.engine
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def program(server, pid: str):
    return server.engine.call_sync(lambda: server.llm.scheduler.programs.get(pid))


def sample(server, name: str) -> float:
    return server.app.state.server.metrics.registry.get_sample_value(name, {"model_name": "tiny"}) or 0.0


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def sse_events(lines) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event; every event has both lines and they agree."""
    out, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])  # no "[DONE]": Anthropic's streams end with message_stop
            assert name == data["type"], (name, data)
            out.append((name, data))
            name = None
    return out


def post_stream(server, body: dict, headers: dict | None = None, path: str = "/v1/messages"):
    with httpx.stream("POST", server.url + path, timeout=60, json={**body, "stream": True},
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01", **(headers or {})}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


# --- the official client -------------------------------------------------------------


def test_create_reports_anthropic_shapes_and_exact_usage(server, client):
    kw = dict(model="tiny", max_tokens=8, extra_body={"temperature": 0}, system="Be brief.",
              messages=user("hello there"))
    r = client.messages.create(**kw)
    assert r.type == "message" and r.role == "assistant" and r.model == "tiny" and r.id.startswith("msg_")
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    assert [b.type for b in r.content] in (["text"], [])
    u = r.usage
    assert 1 <= u.output_tokens <= 8 and u.cache_creation_input_tokens == 0
    # count_tokens renders exactly what the request renders; Anthropic's total input is the sum of the three
    n = client.messages.count_tokens(model="tiny", system="Be brief.", messages=user("hello there")).input_tokens
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == n
    # the same prompt again is read from the prefix cache, and input_tokens counts only the rest
    r2 = client.messages.create(**kw)
    cached = r2.usage.cache_read_input_tokens
    assert cached >= (n - 4) // 4 * 4 and r2.usage.input_tokens == n - cached
    assert r2.content == r.content  # greedy
    idle(server)


def test_stream_with_a_tool_parses_with_the_sdks_event_models(server, client):
    sid = "stream-tool"
    server.scripted.script(sid, "Checking." + call_text("get_weather", {"city": "Paris"}))
    with client.messages.stream(model="tiny", max_tokens=200, tools=[WEATHER], messages=user("weather in Paris?"),
                                extra_headers={"x-claude-code-session-id": sid}) as s:
        events = [e for e in s]
        final = s.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert isinstance(events[0], anthropic.types.RawMessageStartEvent)
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["text", "tool_use"]
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "text_delta" in deltas and deltas[-1] == "input_json_delta"
    assert kinds.count("content_block_stop") == 2
    assert final.stop_reason == "tool_use"
    text, use = final.content
    assert text.type == "text" and text.text == "Checking."
    assert use.type == "tool_use" and use.id.startswith("toolu_") and use.name == "get_weather"
    assert use.input == {"city": "Paris"}
    n = len(("Checking." + call_text("get_weather", {"city": "Paris"})).encode())
    assert final.usage.output_tokens in (n, n + 1)  # the validator may end it at the call's close, before EOS
    idle(server)


def test_raw_stream_has_event_lines_a_ping_and_no_done(server):
    events = post_stream(server, {"model": "tiny", "max_tokens": 6, "temperature": 0, "messages": user("hi")})
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"]  # a ping right after message_start, as Anthropic sends
    assert names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    u = delta["usage"]
    assert u["input_tokens"] + u["cache_read_input_tokens"] == start["usage"]["input_tokens"]
    idle(server)


def test_streamed_and_whole_replies_agree(server, client):
    kw = dict(model="tiny", max_tokens=12, extra_body={"temperature": 0}, messages=user("the same prompt"))
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    assert [b.text for b in streamed.content] == [b.text for b in whole.content]
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    idle(server)


def test_tool_use_tool_result_loop_over_three_turns(server, client):
    sid = "loop-" + uuid.uuid4().hex[:8]
    hdr = {"x-claude-code-session-id": sid}
    msgs = user("What should I wear in Paris and in Oslo?")
    server.scripted.script(sid, call_text("get_weather", {"city": "Paris"}))
    r1 = client.messages.create(model="tiny", max_tokens=200, tools=[WEATHER], messages=msgs, extra_headers=hdr)
    assert r1.stop_reason == "tool_use"
    (use1,) = r1.content
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r1.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use1.id, "content": "sunny, 24C"}]}]

    server.scripted.script(sid, "Paris is warm.\n" + call_text("get_weather", {"city": "Oslo"}))
    r2 = client.messages.create(model="tiny", max_tokens=200, tools=[WEATHER], messages=msgs, extra_headers=hdr)
    assert r2.stop_reason == "tool_use" and [b.type for b in r2.content] == ["text", "tool_use"]
    assert r2.content[1].input == {"city": "Oslo"}
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r2.content]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": r2.content[1].id, "is_error": True,
                  "content": [{"type": "text", "text": "weather service timed out"}]},
                 {"type": "text", "text": "Answer anyway."}]}]

    server.scripted.script(sid, "Bring a coat to Oslo.")
    r3 = client.messages.create(model="tiny", max_tokens=200, tools=[WEATHER], messages=msgs, extra_headers=hdr)
    assert r3.stop_reason == "end_turn" and r3.content[0].text == "Bring a coat to Oslo."
    # each turn re-sends the last: its prompt (and output) come from the cache
    for prev, r in ((r1, r2), (r2, r3)):
        covered = prev.usage.input_tokens + prev.usage.cache_read_input_tokens + prev.usage.output_tokens - 1
        assert r.usage.cache_read_input_tokens >= covered // 4 * 4 - 4
    # the error result reached the model as an error, after the call it answers and before the user's text
    prompt = server.app.state.server.llm.chat_template.render(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
         {"role": "tool", "tool_call_id": "a", "content": "Error: weather service timed out"},
         {"role": "user", "content": "Answer anyway."}])
    assert "<tool_response>\nError: weather service timed out\n</tool_response>" in prompt
    n = client.messages.count_tokens(model="tiny", tools=[WEATHER], messages=msgs).input_tokens
    assert n == r3.usage.input_tokens + r3.usage.cache_read_input_tokens
    idle(server)
    assert program(server, sid).turns_finished == 3


def test_stop_sequences_end_with_stop_sequence(server, client):
    sid = "stopseq"
    server.scripted.script(sid, "Hello STOP world")
    kw = dict(model="tiny", max_tokens=50, messages=user("say it"), stop_sequences=["STOP", "never"],
              extra_headers={"x-claude-code-session-id": sid})
    r = client.messages.create(**kw)
    assert (r.stop_reason, r.stop_sequence, r.content[0].text) == ("stop_sequence", "STOP", "Hello ")
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == ("stop_sequence", "STOP", "Hello ")
    idle(server)


def test_max_tokens_beyond_the_context_is_cut_to_it(server, client):
    """Claude Code asks for 32000 output tokens whatever the model: the cap is cut to the room the
    context leaves, and a reply that fills it says model_context_window_exceeded."""
    sid = "fills-context"
    server.scripted.script(sid, "z" * CONTEXT)
    prompt = "p" * (CONTEXT - 60)
    n = client.messages.count_tokens(model="tiny", messages=user(prompt)).input_tokens
    r = client.messages.create(model="tiny", max_tokens=32000, messages=user(prompt),
                               extra_headers={"x-claude-code-session-id": sid})
    assert r.stop_reason == "model_context_window_exceeded" and r.usage.output_tokens == CONTEXT - n
    r = client.messages.create(model="tiny", max_tokens=5, messages=user(prompt),
                               extra_headers={"x-claude-code-session-id": sid})
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 5
    idle(server)


def test_tool_choice_variants(server, client):
    sid = "choice"
    hdr = {"x-claude-code-session-id": sid}
    other = {"name": "get_time", "description": "Local time.", "input_schema": {"type": "object", "properties": {}}}
    server.scripted.script(sid, call_text("get_weather", {"city": "Rome"}) + call_text("get_weather", {"city": "Nice"}))
    base = dict(model="tiny", max_tokens=200, tools=[WEATHER, other], messages=user("go"), extra_headers=hdr)
    r = client.messages.create(**base, tool_choice={"type": "auto"})
    assert [b.input["city"] for b in r.content] == ["Rome", "Nice"]
    r = client.messages.create(**base, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [b.input["city"] for b in r.content] == ["Rome"] and r.stop_reason == "tool_use"
    r = client.messages.create(**base, tool_choice={"type": "none"})  # calls are not parsed: text
    assert r.stop_reason == "end_turn" and r.content[0].type == "text" and "<tool_call>" in r.content[0].text
    # a named tool, or `any`, is constrained by chat's grammar (the scripted text here follows it)
    server.scripted.script(sid, call_text("get_weather", {"city": "Rome"}))
    r = client.messages.create(**base, tool_choice={"type": "tool", "name": "get_weather"})
    assert r.content[0].name == "get_weather"
    r = client.messages.create(**base, tool_choice={"type": "any"})
    assert r.stop_reason == "tool_use"
    with pytest.raises(anthropic.BadRequestError, match="get_nothing"):
        client.messages.create(**base, tool_choice={"type": "tool", "name": "get_nothing"})
    idle(server)


def test_count_tokens_ignores_the_billing_line_and_accepts_the_beta_query(server):
    body = {"model": "tiny", "messages": user("hi"),
            "system": [{"type": "text",
                        "text": "x-anthropic-billing-header: cc_version=2.1.128.bd9; cc_entrypoint=cli; cch=78ef3;"},
                       {"type": "text", "text": "You are a coding agent."}]}
    counts = []
    for b in (body, {**body, "system": body["system"][1:]}, {**body, "system": "You are a coding agent."}):
        r = httpx.post(server.url + "/v1/messages/count_tokens?beta=true", json=b, timeout=30,
                       headers={"x-api-key": KEY, "anthropic-beta": "token-counting-2024-11-01"})
        assert r.status_code == 200, r.text
        counts.append(r.json()["input_tokens"])
    assert counts[0] == counts[1] == counts[2]


def test_x_api_key_and_bearer_name_the_same_tenant_on_every_path(server):
    body = {"model": "tiny", "max_tokens": 2, "messages": user("hi")}
    for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"},
                    {"Authorization": "Bearer wrong", "x-api-key": KEY}):
        assert httpx.post(server.url + "/v1/messages", json=body, headers=headers, timeout=30).status_code == 200
    chat = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(server.url + "/v1/chat/completions", json=chat, headers={"x-api-key": KEY},
                      timeout=30).status_code == 200
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="tiny", max_tokens=2, messages=user("hi"))
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                        "message": "incorrect API key provided"}}
    r = httpx.post(server.url + "/v1/messages", json=body)
    assert r.status_code == 401 and "x-api-key" in r.json()["error"]["message"]
    idle(server)


# --- bad input: a clear error in Anthropic's shape, nothing leaked ----------------------------

OK = {"model": "tiny", "max_tokens": 4, "messages": user("hi")}
USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}
BAD = [
    ("max_tokens missing", {k: v for k, v in OK.items() if k != "max_tokens"}, 400, "max_tokens: Field required"),
    ("model missing", {k: v for k, v in OK.items() if k != "model"}, 400, "model: Field required"),
    ("an image", {**OK, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}]}]},
     400, "messages[0].content[0]: content block type 'image' is refused: the model served here reads text only"),
    ("a document in a tool result", {**OK, "messages": [
        {"role": "user", "content": "go"}, {"role": "assistant", "content": [USE]},
        {"role": "user", "content": [{**RESULT, "content": [{"type": "document", "source": {}}]}]}]},
     400, "messages[2].content[0].content[0]: tool_result content block type 'document' is refused"),
    ("an unknown block", {**OK, "messages": [{"role": "user", "content": [{"type": "hologram"}]}]},
     400, "content block type 'hologram' is not supported"),
    ("a server tool", {**OK, "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]},
     400, "tools[0]: tool type 'web_search_20250305' is refused"),
    ("a tool without input_schema", {**OK, "tools": [{"name": "f"}]}, 400, "tools[0].input_schema: Field required"),
    ("a tool_result without its tool_use", {**OK, "messages": [{"role": "user", "content": [RESULT]}]},
     400, "messages[0].content[0]: tool_result for tool_use_id 'toolu_1' answers no unanswered tool_use"),
    ("a tool_result for another call", {**OK, "tools": [WEATHER], "messages": [
        {"role": "user", "content": "go"}, {"role": "assistant", "content": [USE]},
        {"role": "user", "content": [{**RESULT, "tool_use_id": "toolu_9"}]}]},
     400, "messages[2].content[0]: tool_result for tool_use_id 'toolu_9' answers no unanswered tool_use of the "
          "assistant message right before it (messages[1])"),
    ("a tool_use left unanswered", {**OK, "tools": [WEATHER], "messages": [
        {"role": "user", "content": "go"}, {"role": "assistant", "content": [{"type": "text", "text": "ok"}, USE]},
        {"role": "user", "content": "what now?"}]},
     400, "messages[1].content[1]: tool_use 'toolu_1' has no tool_result in messages[2]"),
    ("a conversation ending in a tool_use", {**OK, "tools": [WEATHER], "messages": [
        {"role": "user", "content": "go"}, {"role": "assistant", "content": [USE]}]},
     400, "messages[1].content[0]: tool_use 'toolu_1' has no tool_result: a conversation that ends with an "
          "assistant's tool_use cannot be continued"),
    ("a prefill with a JSON format", {**OK, "output_config": {"format": {"type": "json_schema", "schema": {}}},
                                      "messages": [{"role": "user", "content": "go"},
                                                   {"role": "assistant", "content": "{"}]},
     400, "messages[1]: the conversation ends with an assistant message (a prefill), and output_config.format"),
    ("a tool_result in an assistant message", {**OK, "messages": [
        {"role": "user", "content": "go"}, {"role": "assistant", "content": [RESULT]},
        {"role": "user", "content": "x"}]},
     400, "messages[1].content[0]: a tool_result block belongs in a user message"),
    ("temperature over 1", {**OK, "temperature": 1.5}, 400, "temperature: Input should be less than or equal to 1"),
    ("a string max_tokens", {**OK, "max_tokens": "4"}, 400, "max_tokens: Input should be a valid integer"),
    ("too many stop sequences", {**OK, "stop_sequences": [f"s{i}" for i in range(17)]},
     400, "stop_sequences: at most 16"),
    ("any without tools", {**OK, "tool_choice": {"type": "any"}}, 400, "tool_choice"),
    ("a tool named twice", {**OK, "tools": [WEATHER, WEATHER]},
     400, "tools[1]: the tool name 'get_weather' is already"),
    ("an unknown tool_choice", {**OK, "tools": [WEATHER], "tool_choice": {"type": "maybe"}},
     400, "tool_choice: tool_choice type 'maybe' is not supported"),
    ("Claude Code's model name", {**OK, "model": "claude-sonnet-4-5-20250929"},
     404, "the model `claude-sonnet-4-5-20250929` does not exist; this server serves tiny, tiny-alias. Claude Code "
          "sends its own model names unless told otherwise: start it with ANTHROPIC_MODEL=tiny (and "
          "ANTHROPIC_DEFAULT_OPUS_MODEL, ANTHROPIC_DEFAULT_SONNET_MODEL, ANTHROPIC_DEFAULT_HAIKU_MODEL"),
    ("a format that is no JSON schema", {**OK, "output_config": {"format": {"type": "regex", "pattern": "a+"}}},
     400, 'output_config.format: the format must be {"type": "json_schema", "schema": {...}}'),
    ("a prompt longer than the context", {**OK, "messages": user("x" * (CONTEXT + 10))},
     400, f"this model's maximum context length is {CONTEXT} tokens (tiny), but the prompt is"),
]


@pytest.mark.parametrize("body,status,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_a_clear_anthropic_error(server, body, status, message):
    r = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()
    assert set(err) == {"type", "error"} and err["type"] == "error" and set(err["error"]) == {"type", "message"}
    assert err["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert message in err["error"]["message"], err["error"]["message"]
    # count_tokens refuses the same prompts the same way (it has no max_tokens, stop_sequences, temperature)
    if not any(k in message for k in ("max_tokens", "stop_sequences", "temperature", "maximum context length")):
        c = httpx.post(server.url + "/v1/messages/count_tokens", headers={"x-api-key": KEY}, timeout=30,
                       json={k: v for k, v in body.items() if k != "max_tokens"})
        assert (c.status_code, c.json()["error"]["type"]) == (status, err["error"]["type"]), c.text
        assert message in c.json()["error"]["message"]
    idle(server)


# --- prefill: a conversation that ends with the assistant's text -------------------------------------


def test_a_prefill_is_continued_and_the_reply_holds_only_the_new_text(server, client):
    sid = "prefill-" + uuid.uuid4().hex[:8]
    server.scripted.script_turns(sid, ' "sunny", "temp": 21}', ' "rain"}')
    convo = [{"role": "user", "content": "Weather in Paris as JSON?"}, {"role": "assistant", "content": '{"sky":'}]
    hdr = {"x-claude-code-session-id": sid}
    r = client.messages.create(model="tiny", max_tokens=64, messages=convo, extra_headers=hdr)
    assert r.stop_reason == "end_turn" and [b.type for b in r.content] == ["text"]
    assert r.content[0].text == ' "sunny", "temp": 21}'  # the new text only: the client joins it to its prefill
    # the assistant turn is the generation prompt's continuation: the prefill's bytes after it, no end of turn
    plain = client.messages.count_tokens(model="tiny", messages=convo[:1]).input_tokens
    n = client.messages.count_tokens(model="tiny", messages=convo).input_tokens
    assert n == plain + len('{"sky":')  # one token a byte
    u = r.usage
    assert u.input_tokens + u.cache_read_input_tokens == n and u.output_tokens == len(r.content[0].text) + 1
    # streamed the same way: the deltas add up to the new text
    with client.messages.stream(model="tiny", max_tokens=64, messages=convo, extra_headers=hdr) as s:
        final = s.get_final_message()
    assert [b.text for b in final.content] == [' "rain"}'] and final.stop_reason == "end_turn"
    idle(server)


def test_a_prefill_renders_as_the_template_opens_the_turn():
    from agentserve.server.chat_run import continued_prompt
    from agentserve.server.chat_template import ChatTemplate, TemplateError

    chatml = ChatTemplate(None)
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    opened = chatml.render(convo[:1])  # ends with the generation prompt
    assert continued_prompt(chatml, convo, None) == opened + "Hel"
    # the template's own words are kept: Gemma's turn names the model, and trims the content's start
    gemma = ChatTemplate(
        "{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
        "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
        "{% endif %}")
    got = continued_prompt(gemma, [convo[0], {"role": "assistant", "content": "  Hel"}], None)
    assert got == "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\nHel"
    # an empty prefill is the generation prompt itself; a list of text parts is continued too
    assert continued_prompt(chatml, [convo[0], {"role": "assistant", "content": ""}], None) == opened
    parts = [{"type": "text", "text": "He"}, {"type": "text", "text": "l"}]
    assert continued_prompt(chatml, [convo[0], {"role": "assistant", "content": parts}], None) == opened + "Hel"
    # a template that leaves the last assistant turn out cannot be continued, nor a call, nor a user turn
    hides = ChatTemplate("{% for m in messages %}{% if not (loop.last and m['role'] == 'assistant') %}"
                         "{{ m['content'] }}{% endif %}{% endfor %}")
    with pytest.raises(TemplateError, match="does not show the final assistant message once"):
        continued_prompt(hides, convo, None)
    with pytest.raises(TemplateError, match="only an assistant message of text can be continued"):
        continued_prompt(chatml, [convo[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}], None)
    with pytest.raises(TemplateError, match="only an assistant message of text"):
        continued_prompt(chatml, convo[:1], None)


def test_a_prefill_with_tools_and_thinking_only(server, client):
    sid = "prefill-tools-" + uuid.uuid4().hex[:8]
    server.scripted.script(sid, " Paris." + call_text("get_weather", {"city": "Paris"}))
    hdr = {"x-claude-code-session-id": sid}
    convo = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "Looking up"}]
    r = client.messages.create(model="tiny", max_tokens=200, tools=[WEATHER], messages=convo, extra_headers=hdr)
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["text", "tool_use"]
    assert r.content[0].text == " Paris." and r.content[1].input == {"city": "Paris"}
    # a final assistant message of thinking only continues nothing: the reply opens the turn
    thinking = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"}]}]
    n = client.messages.count_tokens(model="tiny", messages=thinking).input_tokens
    assert n == client.messages.count_tokens(model="tiny", messages=thinking[:1]).input_tokens
    idle(server)


def test_the_context_error_names_the_model_and_a_context_that_fits(server, client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=10, messages=user("y" * (CONTEXT + 500)))
    msg = e.value.body["error"]["message"]
    assert f"maximum context length is {CONTEXT} tokens (tiny)" in msg
    assert "shorten the messages" in msg and "context holds at least 16384 tokens" in msg


def test_transport_errors_are_anthropic_shaped_too(server):
    h = {"x-api-key": KEY, "content-type": "application/json"}
    cases = [
        (httpx.post(server.url + "/v1/messages", content=b"{not json", headers=h), 400, "invalid_request_error"),
        (httpx.post(server.url + "/v1/messages", content=b"[]", headers=h), 400, "invalid_request_error"),
        (httpx.post(server.url + "/v1/messages", json={**OK, "messages": user("x" * 300_000)}, headers=h, timeout=30),
         413, "request_too_large"),
        (httpx.get(server.url + "/v1/messages", headers=h), 405, "invalid_request_error"),
        (httpx.post(server.url + "/v1/messages/batches", json=OK, headers=h), 404, "not_found_error"),
    ]
    for r, status, kind in cases:
        assert r.status_code == status, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind, r.text
    # chat keeps OpenAI's shape
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", headers=h)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_a_full_queue_is_overloaded_error_529(server, client):
    eng = server.engine
    eng.call_sync(lambda: setattr(eng, "max_queue", 0))
    try:
        with pytest.raises(anthropic.InternalServerError) as e:
            client.messages.create(model="tiny", max_tokens=2, messages=user("hi"))
        assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"
        assert e.value.response.headers["retry-after"] == "1"
    finally:
        eng.call_sync(lambda: setattr(eng, "max_queue", 64))
    idle(server)


def test_an_engine_failure_mid_stream_is_an_error_event(server, client):
    server.scripted.fail_programs.add("BOOM")
    try:
        events = post_stream(server, {**OK, "max_tokens": 8}, headers={"x-claude-code-session-id": "BOOM"})
        assert events[0][0] == "message_start" and events[-1][0] == "error"
        err = events[-1][1]["error"]
        assert err["type"] == "api_error" and "injected executor failure" in err["message"]
        with pytest.raises(anthropic.InternalServerError) as e:
            client.messages.create(**OK, extra_headers={"x-claude-code-session-id": "BOOM"})
        assert e.value.status_code == 500 and e.value.body["error"]["type"] == "api_error"
    finally:
        server.scripted.fail_programs.discard("BOOM")
    idle(server)
    assert client.messages.create(**OK).usage.output_tokens >= 1  # the server goes on


def test_thinking_is_accepted_and_logged_once(server, client, caplog):
    server.app.state.server.warned.discard("messages.thinking")
    with caplog.at_level(logging.INFO, logger="agentserve.server"):
        for _ in range(2):
            r = client.messages.create(model="tiny", max_tokens=3, messages=[
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "sig"},
                                                  {"type": "redacted_thinking", "data": "abc"},
                                                  {"type": "text", "text": "ok"}]},
                {"role": "user", "content": "more"}], thinking={"type": "enabled", "budget_tokens": 1024})
            assert r.usage.output_tokens >= 1
    assert sum("`thinking` is accepted and ignored" in m for m in caplog.messages) == 1
    idle(server)


def test_pings_fill_silence_without_losing_the_pending_read():
    async def scenario() -> list:
        go = asyncio.Event()

        async def slow():
            await go.wait()
            yield "first"
            yield "second"

        got = []
        gen = _with_pings(slow(), 0.01)
        got.append(await gen.__anext__())  # nothing for a while: a ping
        go.set()
        async for d in gen:
            got.append(d)
        return got

    got = asyncio.run(scenario())
    assert got[0] is None and [d for d in got if d is not None] == ["first", "second"]

    async def closed_early() -> bool:
        closed = asyncio.Event()

        async def never():
            try:
                await asyncio.Event().wait()
                yield "unreachable"
            finally:
                closed.set()

        gen = _with_pings(never(), 0.01)
        assert await gen.__anext__() is None
        await gen.aclose()  # a client gone: the pending read is cancelled, its generator closed
        return closed.is_set()

    assert asyncio.run(closed_early())


def test_a_client_gone_mid_stream_aborts_the_request_and_frees_its_kv(server):
    sid = "goes-away"
    server.scripted.script(sid, "y" * 4000)
    aborts = server.app.state.server.metrics.registry.get_sample_value(
        "agentserve:request_success_total", {"model_name": "tiny", "finished_reason": "abort"}) or 0.0
    with httpx.stream("POST", server.url + "/v1/messages", timeout=60,
                      json={**OK, "max_tokens": 4000, "stream": True},
                      headers={"x-api-key": KEY, "x-claude-code-session-id": sid}) as r:
        for i, line in enumerate(r.iter_lines()):
            if "content_block_delta" in line:
                break  # leaving the block closes the connection mid-stream
    idle(server)
    assert server.app.state.server.metrics.registry.get_sample_value(
        "agentserve:request_success_total", {"model_name": "tiny", "finished_reason": "abort"}) == aborts + 1


# --- Claude Code's shape, replayed -----------------------------------------------------------


def _tool(name: str, description: str, props: dict, required: list[str]) -> dict:
    return {"name": name, "description": description,
            "input_schema": {"type": "object", "properties": props, "required": required,
                             "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}}


S = {"type": "string"}
CLAUDE_CODE_TOOLS = [
    _tool("Task", "Start a subagent for a multi-step task; it works alone and reports back once.",
          {"description": {**S, "description": "three to five words"}, "prompt": S, "subagent_type": S},
          ["description", "prompt", "subagent_type"]),
    _tool("Bash", "Run a shell command in a persistent session, with an optional timeout.",
          {"command": S, "timeout": {"type": "number", "description": "milliseconds, at most 600000"},
           "description": S, "run_in_background": {"type": "boolean"}}, ["command"]),
    _tool("Glob", "Find files whose paths match a glob pattern, newest first.",
          {"pattern": S, "path": {**S, "description": "directory to search (default: the working one)"}}, ["pattern"]),
    _tool("Grep", "Search file contents with a regular expression (ripgrep syntax).",
          {"pattern": S, "path": S, "glob": S, "output_mode": {"type": "string", "enum": [
              "content", "files_with_matches", "count"]}, "-i": {"type": "boolean"}, "-n": {"type": "boolean"},
           "head_limit": {"type": "number"}}, ["pattern"]),
    _tool("ExitPlanMode", "Leave plan mode once the plan is ready for the user to approve.",
          {"plan": S}, ["plan"]),
    _tool("Read", "Read a file from the local filesystem, optionally a range of its lines.",
          {"file_path": {**S, "description": "an absolute path"}, "offset": {"type": "number"},
           "limit": {"type": "number"}}, ["file_path"]),
    _tool("Edit", "Replace an exact string in a file with another.",
          {"file_path": S, "old_string": S, "new_string": S, "replace_all": {"type": "boolean", "default": False}},
          ["file_path", "old_string", "new_string"]),
    _tool("MultiEdit", "Apply several exact-string edits to one file, in order, all or none.",
          {"file_path": S, "edits": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
              "old_string": S, "new_string": S, "replace_all": {"type": "boolean"}},
              "required": ["old_string", "new_string"]}}}, ["file_path", "edits"]),
    _tool("Write", "Write a file, replacing what it held.", {"file_path": S, "content": S}, ["file_path", "content"]),
    _tool("NotebookEdit", "Replace, insert or delete one cell of a Jupyter notebook.",
          {"notebook_path": S, "cell_id": S, "new_source": S,
           "cell_type": {"type": "string", "enum": ["code", "markdown"]},
           "edit_mode": {"type": "string", "enum": ["replace", "insert", "delete"]}}, ["notebook_path", "new_source"]),
    _tool("WebFetch", "Fetch a URL and answer a question about its content.",
          {"url": {**S, "format": "uri"}, "prompt": S}, ["url", "prompt"]),
    _tool("TodoWrite", "Keep a structured list of the session's tasks and their states.",
          {"todos": {"type": "array", "items": {"type": "object", "properties": {
              "content": S, "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
              "activeForm": S}, "required": ["content", "status", "activeForm"]}}}, ["todos"]),
    _tool("WebSearch", "Search the web and return result blocks.",
          {"query": {**S, "minLength": 2}, "allowed_domains": {"type": "array", "items": S},
           "blocked_domains": {"type": "array", "items": S}}, ["query"]),
    _tool("BashOutput", "Read new output of a shell running in the background.",
          {"bash_id": S, "filter": S}, ["bash_id"]),
    _tool("KillShell", "Stop a shell running in the background.", {"shell_id": S}, ["shell_id"]),
    _tool("SlashCommand", "Run a slash command of the project.", {"command": S}, ["command"]),
]
CLAUDE_CODE_PROMPT = (
    "You are an interactive command line tool that helps users with software engineering tasks. Use the "
    "instructions below and the tools available to you to assist the user.\n\n"
    "# Tone and style\nBe concise, direct, and to the point. Answer in fewer than four lines unless the user asks "
    "for detail. Do not add preamble or postamble. Explain a non-trivial shell command before you run it.\n\n"
    "# Following conventions\nWhen you change a file, first understand its conventions: mimic its style, use its "
    "libraries, follow its patterns. Never assume a library is available; check the project's manifest first. "
    "Never commit secrets or keys.\n\n"
    "# Doing tasks\nPlan with the todo list when a task has several steps. Search the code to understand it, "
    "implement the change with the tools, then verify it with the project's tests and its lint and typecheck "
    "commands. Never commit unless the user asks you to.\n\n"
    "# Tool usage policy\nPrefer the dedicated tools to shell commands for reading, searching and editing files. "
    "When several independent pieces of information are needed, call the tools in parallel.\n\n"
    "Here is useful information about the environment you are running in:\n<env>\nWorking directory: /repo\n"
    "Is directory a git repo: Yes\nPlatform: linux\nToday's date: 2026-11-28\n</env>\n")


def claude_code_request(messages: list[dict], session: str) -> dict:
    """One request as Claude Code sends it; its billing line changes on every request."""
    billing = f"x-anthropic-billing-header: cc_version=2.1.128.bd9; cc_entrypoint=cli; cch={secrets.token_hex(3)[:5]};"
    return {
        "model": "tiny", "max_tokens": 32000, "stream": True, "temperature": 1,
        "system": [{"type": "text", "text": billing},
                   {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                    "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": CLAUDE_CODE_PROMPT, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "tools": CLAUDE_CODE_TOOLS,
        "messages": messages,
        "metadata": {"user_id": f"user_5f2a_account__session_{session}"},
        "thinking": {"type": "enabled", "budget_tokens": 4000},
    }


def claude_code_headers(session: str, agent: str | None = None) -> dict:
    h = {"x-api-key": KEY, "anthropic-version": "2023-06-01", "x-app": "cli",
         "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                           "fine-grained-tool-streaming-2025-05-14",
         "x-claude-code-session-id": session, "user-agent": "claude-cli/2.1.128 (external, cli)"}
    return {**h, "x-claude-code-agent-id": agent} if agent else h


def replay_turn(server, messages: list[dict], session: str, agent: str | None = None) -> tuple[list[dict], dict]:
    """One Claude Code turn: the assistant's content blocks rebuilt from the stream, and the final usage."""
    events = post_stream(server, claude_code_request(messages, session), claude_code_headers(session, agent),
                         path="/v1/messages?beta=true")
    assert [n for n, _ in events[:2]] == ["message_start", "ping"] and events[-1][0] == "message_stop"
    blocks: dict[int, dict] = {}
    partial: dict[int, str] = {}
    for name, data in events:
        if name == "content_block_start":
            blocks[data["index"]] = dict(data["content_block"])
        elif name == "content_block_delta":
            d = data["delta"]
            if d["type"] == "text_delta":
                blocks[data["index"]]["text"] += d["text"]
            else:
                partial[data["index"]] = partial.get(data["index"], "") + d["partial_json"]
        elif name == "content_block_stop" and data["index"] in partial:
            blocks[data["index"]]["input"] = json.loads(partial[data["index"]])
    delta = next(d for n, d in events if n == "message_delta")
    return [blocks[i] for i in sorted(blocks)], {**delta["usage"], "stop_reason": delta["delta"]["stop_reason"]}


def test_claude_code_session_replayed_is_one_program_with_prefix_hits(server):
    session = str(uuid.uuid4())
    script = [
        "I'll look at the failing test first.\n" + call_text("Read", {"file_path": "/repo/tests/test_utils.py"}),
        call_text("Edit", {"file_path": "/repo/utils.py", "old_string": "a - b", "new_string": "a + b"}),
        call_text("Bash", {"command": "python -m pytest -q tests/test_utils.py", "description": "Run the tests"}),
        "Fixed: `add` subtracted instead of adding; the tests pass now.",
    ]
    results = ["def test_add():\n    assert add(2, 3) == 5\n", "The file /repo/utils.py has been updated.",
               "1 passed in 0.01s"]
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>\nAs you answer, use the todo list when it helps.\n"
                                 "</system-reminder>"},
        {"type": "text", "text": "The test of utils.add fails. Please fix it.",
         "cache_control": {"type": "ephemeral"}}]}]
    usages = []
    for turn, text in enumerate(script):
        server.scripted.script(session, text)
        content, usage = replay_turn(server, messages, session)
        usages.append(usage)
        if turn < len(script) - 1:
            assert usage["stop_reason"] == "tool_use", usage
            use = content[-1]
            assert use["type"] == "tool_use" and use["id"].startswith("toolu_")
            messages += [{"role": "assistant", "content": content},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                                       "content": results[turn]}]}]
        else:
            assert usage["stop_reason"] == "end_turn" and content == [{"type": "text", "text": text}]
    prompts = [u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"] for u in usages]
    assert prompts[0] > 5000, prompts  # Claude Code's size: 16 tools, the system prompt
    for u, p in zip(usages[1:], prompts[1:]):
        assert u["cache_read_input_tokens"] >= 0.9 * p, (u, p)  # the billing line changed; the prefix did not
    idle(server)
    prog = program(server, session)
    assert prog is not None and prog.turns_finished == len(script)  # one program, every turn
    ids = server.engine.call_sync(lambda: [pid for pid, _ in server.llm.scheduler.programs.entries()])
    assert not any(pid != session and pid.startswith(session) for pid in ids)
    # the largest cache_control ttl (1h) was the retention hint of every turn
    # (the policy caps a hint at its own maximum)
    state = httpx.get(server.url + "/dashboard/state", headers={"x-api-key": KEY}).json()
    mine = [d for d in state["decisions"] if d["program_id"] == session]
    assert len(mine) == len(script) and all(d["action"] == "pin" and d["regime"] == "hint" for d in mine)
    assert all(d["capped"] or d["ttl"] == 3600 for d in mine)


def test_a_claude_code_subagent_is_its_own_program_beside_its_parent(server):
    session, agent = str(uuid.uuid4()), "agent-" + uuid.uuid4().hex[:6]
    sub = f"{session}/{agent}"
    server.scripted.script(session, "Let me delegate.")
    server.scripted.script(sub, "Found 3 files.")
    parent, _ = replay_turn(server, user("find the config files"), session)
    child, _ = replay_turn(server, user("search for config files"), session, agent)
    assert parent == [{"type": "text", "text": "Let me delegate."}]
    assert child == [{"type": "text", "text": "Found 3 files."}]
    idle(server)
    assert program(server, session).turns_finished == 1 and program(server, sub).turns_finished == 1


# --- LangChain ----------------------------------------------------------------------------


def test_langchain_chat_anthropic_with_a_bound_tool(server):
    pytest.importorskip("langchain_anthropic")
    from langchain_anthropic import ChatAnthropic

    sid = "langchain-" + uuid.uuid4().hex[:6]
    server.scripted.script(sid, call_text("get_weather", {"city": "Lisbon"}))
    llm = ChatAnthropic(base_url=server.url, api_key=KEY, model="tiny", max_retries=0, max_tokens=200,
                        default_headers={"x-claude-code-session-id": sid})

    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return "sunny"

    msg = llm.bind_tools([get_weather]).invoke("What is the weather in Lisbon?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Lisbon"} and call["id"].startswith("toolu_")
    assert msg.response_metadata["stop_reason"] == "tool_use"
    idle(server)


def test_openapi_documents_both_operations_with_anthropic_errors(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    for path, reply in (("/v1/messages", "MessageResponse"), ("/v1/messages/count_tokens", "TokensCount")):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/MessagesRequest" if path == "/v1/messages" else "/CountTokensRequest")
        assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + reply)
        assert {"400", "401", "404", "413", "529"} <= set(op["responses"])
        assert all(r["content"]["application/json"]["schema"]["$ref"].endswith("/AnthropicErrorResponse")
                   for code, r in op["responses"].items() if code != "200")
        assert {"bearer": []} in op["security"] and {"x-api-key": []} in op["security"]
    schemas = doc["components"]["schemas"]
    assert schemas["MessagesRequest"]["required"] == ["model", "messages", "max_tokens"]
    assert schemas["MessagesRequest"]["properties"]["model"]["enum"] == ["tiny", "tiny-alias"]
    temp = next(s for s in schemas["MessagesRequest"]["properties"]["temperature"]["anyOf"] if s.get("type"))
    assert (temp["minimum"], temp["maximum"]) == (0.0, 1.0)


def test_metadata_user_id_names_the_program_without_a_session_header(server, client):
    uid = "user_" + uuid.uuid4().hex[:8]
    server.scripted.script(uid, "From metadata.")
    r = client.messages.create(model="tiny", max_tokens=20, messages=user("hi"), metadata={"user_id": uid})
    assert r.content[0].text == "From metadata."
    idle(server)
    assert program(server, uid).turns_finished == 1


def test_x_api_key_names_its_tenant_among_several():
    from starlette.requests import Request

    from agentserve.server.request_checks import authorize, tenant_scope

    class State:
        config = ServerConfig(["tiny"], api_keys={"key-a": "alice", "key-b": "bob"})

    def request(headers: dict) -> Request:
        return Request({"type": "http", "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]})

    for headers, tenant in (({"x-api-key": "key-b"}, "bob"), ({"Authorization": "Bearer key-a"}, "alice"),
                            ({"Authorization": "Bearer nope", "x-api-key": "key-b"}, "bob")):
        req = request(headers)
        assert authorize(State, req) == tenant and tenant_scope(State, req) == tenant


def test_output_config_format_holds_the_reply_to_the_schema(server):
    """Anthropic's structured outputs: the random model's reply follows the schema (the grammar makes it)."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    body = {"model": "tiny", "max_tokens": 200, "messages": user("Weather?"), "temperature": 0,
            "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    r = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 200, r.text
    (block,) = r.json()["content"]
    reply = json.loads(block["text"])
    assert set(reply) == {"city", "sunny"} and isinstance(reply["sunny"], bool) and reply["city"] in ("Paris", "Oslo")
    assert r.json()["stop_reason"] == "end_turn"
    # without the format the same request is free text that is not such an object
    free = httpx.post(server.url + "/v1/messages", json={k: v for k, v in body.items() if k != "output_config"},
                      headers={"x-api-key": KEY}, timeout=60).json()
    text = "".join(b.get("text", "") for b in free["content"])
    with pytest.raises((ValueError, AssertionError, TypeError)):
        assert set(json.loads(text)) == {"city", "sunny"}
    idle(server)
