"""No input gets a 5xx (issue 14, item 2): every string valid Unicode (a
lone surrogate is a 400 wherever it is), strict types (no coercion), OpenAI's
ranges, tool messages checked as OpenAI checks them, unique tool names, ids
of bounded length wherever they come from, no internal paths in error text,
Retry-After on 429/503, /metrics behind the API key. End to end against the
tiny server on loopback; each refusal is a 400 in OpenAI's shape that names
the parameter, and the server goes on serving with its KV accounting intact."""

from __future__ import annotations

import json

import httpx
import pytest

from agentserve.server.api_errors import APIError, scrub_internal_paths
from agentserve.server.identity import MAX_ID_LENGTH
from agentserve.server.input_checks import invalid_text_at, param_of
from agentserve.server.protocol import ChatCompletionRequest
from server_fixtures import start_tiny_server

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
USER = {"role": "user", "content": "hi"}
CHAT = {"model": "tiny", "messages": [USER], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server():
    srv, llm, _ = start_tiny_server(api_key=KEY)
    srv.llm, srv.engine = llm, srv.app.state.server.engine
    yield srv
    srv.stop()


def post(server, body: dict, path: str = "/v1/chat/completions", headers: dict | None = None) -> httpx.Response:
    # json.dumps writes a lone surrogate as the escape \ud800, as a client's JSON encoder would
    return httpx.post(server.url + path, content=json.dumps(body).encode(), timeout=30,
                      headers={**AUTH, "Content-Type": "application/json", **(headers or {})})


def refused(r: httpx.Response, param: str | None = None, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = json.loads(r.content.decode("utf-8"))["error"]  # the reply itself is valid UTF-8
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    return err


def still_serving(server) -> None:
    r = post(server, CHAT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    kv = server.llm.kv
    server.engine.call_sync(server.llm.check_integrity)
    free, total, held = server.engine.call_sync(lambda: (kv.num_free_blocks, kv.num_blocks, kv.num_pinned_blocks))
    assert free == total - held


# --- lone surrogates ------------------------------------------------------------------

BAD = "a\ud800b"
SURROGATE_CASES = [
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": BAD}]}, "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": BAD}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {**CHAT, "model": BAD}, "model"),
    ("/v1/chat/completions", {**CHAT, "user": BAD}, "user"),
    ("/v1/chat/completions", {**CHAT, "program_id": BAD}, "program_id"),
    ("/v1/chat/completions", {**CHAT, "stop": ["ok", BAD]}, "stop[1]"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "description": BAD}}]},
     "tools[0].function.description"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {BAD: {"type": "string"}}}}}]},
     "tools[0].function.parameters.properties.a\ufffdb"),
    ("/v1/chat/completions", {**CHAT, "messages": [
        USER, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                    "function": {"name": "f", "arguments": BAD}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}, "messages[1].tool_calls[0].function.arguments"),
    ("/v1/chat/completions", {**CHAT, "an_unknown_field": {"x": [BAD]}}, "an_unknown_field.x[0]"),
    ("/v1/completions", {**COMPLETION, "prompt": BAD}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [BAD]}, "prompt[0]"),
    ("/v1/completions", {**COMPLETION, "stop": BAD}, "stop"),
]


@pytest.mark.parametrize("path,body,param", SURROGATE_CASES)
def test_a_lone_surrogate_anywhere_is_a_400_naming_it(server, path, body, param):
    err = refused(post(server, body, path), param)
    assert "lone UTF-16 surrogate" in err["message"]


def test_surrogates_leave_the_server_serving_and_valid_pairs_pass(server):
    for path, body, _ in SURROGATE_CASES:
        post(server, body, path)
    # a surrogate *pair* is one character (U+1F600), valid everywhere
    r = post(server, {**CHAT, "messages": [{"role": "user", "content": "smile \ud83d\ude00"}], "user": "\ud83d\ude00"})
    assert r.status_code == 200, r.text
    still_serving(server)


def test_invalid_text_at_walks_keys_values_and_lists():
    assert invalid_text_at({"a": ["ok", {"b": "é"}], "c": 1, "d": None}) is None
    assert invalid_text_at({"a": ["ok", {"b": "\udfff"}]}) == "a[1].b"
    assert invalid_text_at({"a": {"\ud800": 1}}) == "a.\ud800"
    assert invalid_text_at("\ud800") == "body"


# --- strict types and OpenAI's ranges -----------------------------------------------------

COERCED = [
    ({"max_tokens": "8"}, "max_tokens"), ({"max_tokens": 8.5}, "max_tokens"), ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"), ({"temperature": "0.5"}, "temperature"), ({"temperature": True}, "temperature"),
    ({"n": "1"}, "n"), ({"seed": "7"}, "seed"), ({"top_k": "5"}, "top_k"), ({"ignore_eos": "true"}, "ignore_eos"),
    ({"logprobs": "false"}, "logprobs"), ({"stream_options": {"include_usage": "true"}}, "stream_options.include_usage"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text"),
    ({"ttl": "60", "program_id": "p"}, "ttl"), ({"end_program": "yes", "program_id": "p"}, "end_program"),
    ({"program_id": 7}, "program_id"), ({"user": 7}, "user"),
]


@pytest.mark.parametrize("extra,param", COERCED)
def test_no_coercion(server, extra, param):
    refused(post(server, {**CHAT, **extra}), param)


def test_a_whole_number_is_an_integer(server):
    # JSON has one kind of number, and JSON Schema's `integer` (the OpenAPI document's) holds 8.0: so does
    # the server, as 8; a fraction, a string or a boolean is still refused
    r = post(server, {**CHAT, "max_tokens": 2.0, "seed": 7.0, "n": 1.0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2
    refused(post(server, {**CHAT, "max_tokens": True}), "max_tokens")


def test_no_coercion_in_completions(server):
    refused(post(server, {**COMPLETION, "prompt": [1, "2"]}, "/v1/completions"))
    refused(post(server, {**COMPLETION, "max_tokens": "2"}, "/v1/completions"), "max_tokens")
    refused(post(server, {**COMPLETION, "echo": "false"}, "/v1/completions"), "echo")


OUT_OF_RANGE = [
    ({"temperature": 2.01}, "temperature"), ({"temperature": -0.1}, "temperature"), ({"top_p": 1.5}, "top_p"),
    ({"top_p": 0}, "top_p"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"n": 0}, "n"), ({"n": 129}, "n"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"top_logprobs": 21}, "top_logprobs"), ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"seed": 2**64}, "seed"), ({"seed": -2**63 - 1}, "seed"), ({"top_k": -2}, "top_k"),
    ({"stop_token_ids": [-1]}, "stop_token_ids[0]"), ({"ttl": -1, "program_id": "p"}, "ttl"),
    ({"top_k": 2**70}, "top_k"),  # was a failed engine step: a 500, and every request in that step aborted
]


@pytest.mark.parametrize("extra,param", OUT_OF_RANGE)
def test_openai_ranges(server, extra, param):
    refused(post(server, {**CHAT, **extra}), param)


def test_range_edges_and_ints_for_floats_pass(server):
    for extra in ({"temperature": 2}, {"temperature": 0}, {"top_p": 1}, {"presence_penalty": 0},
                  {"seed": 2**64 - 1}, {"seed": -2**63}, {"n": 1}, {"top_k": -1}, {"top_k": 2**63 - 1}):
        r = post(server, {**CHAT, **extra})
        assert r.status_code == 200, (extra, r.text)
    refused(post(server, {**COMPLETION, "logprobs": 6}, "/v1/completions"), "logprobs")
    refused(post(server, {**COMPLETION, "best_of": 21}, "/v1/completions"), "best_of")


def test_the_model_refuses_coercion_without_the_server():
    from pydantic import ValidationError
    for bad in ({"max_tokens": "8"}, {"stream": "yes"}, {"temperature": 100}):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate({"messages": [USER], **bad})


# --- tool messages and tools -------------------------------------------------------------


def _call(cid: str, name: str = "get_weather") -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": '{"city": "Paris"}'}}


def _calls(*ids: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [_call(i) for i in ids]}


def _tool(cid: str | None, content: str | None = "sunny") -> dict:
    m = {"role": "tool", "content": content}
    if cid is not None:
        m["tool_call_id"] = cid
    return m


TOOL_MESSAGE_CASES = [
    ([USER, _calls("c1"), _tool(None)], "messages[2].tool_call_id", "Field required"),
    ([USER, _calls("c1"), _tool("c1", None)], "messages[2].content", None),
    ([USER, _tool("c1")], "messages[1]", "must answer a call"),
    ([USER, _calls("c1"), _tool("c2")], "messages[2].tool_call_id", "not an unanswered call"),
    ([USER, _calls("c1"), _tool("c1"), _tool("c1")], "messages[3].tool_call_id", "not an unanswered call"),
    ([USER, _calls("c1", "c2"), _tool("c1"), USER], "messages[1].tool_calls", "'c2'"),
    ([USER, _calls("c1")], "messages[1].tool_calls", "no answer for 'c1'"),
    ([USER, _calls("c1"), USER, _tool("c1")], "messages[1].tool_calls", "no answer"),
    ([USER, _calls("c1", "c1"), _tool("c1")], "messages[1].tool_calls[1].id", "used twice"),
    ([USER, {"role": "assistant", "content": None}], "messages[1]", "needs `content` or `tool_calls`"),
    ([USER, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}],
     "messages[1].tool_calls[0].id", "Field required"),
    ([USER, _calls("c1"), _tool("c" * (MAX_ID_LENGTH + 1))], "messages[2].tool_call_id", "at most"),
    ([{"role": "user"}], "messages[0].content", "Field required"),
]


@pytest.mark.parametrize("messages,param,text", TOOL_MESSAGE_CASES)
def test_tool_messages_are_checked_as_openai_does(server, messages, param, text):
    err = refused(post(server, {**CHAT, "messages": messages, "tools": [WEATHER]}), param)
    assert text is None or text in err["message"], err


def test_answered_calls_in_any_order_pass(server):
    msgs = [{"role": "system", "content": "s"}, USER, _calls("c1", "c2"), _tool("c2"), _tool("c1"),
            {"role": "assistant", "content": "done"}, USER, _calls("c3"), _tool("c3")]
    r = post(server, {**CHAT, "messages": msgs, "tools": [WEATHER]})
    assert r.status_code == 200, r.text


def test_duplicate_tool_names_are_refused(server):
    other = {"type": "function", "function": {"name": "get_time"}}
    err = refused(post(server, {**CHAT, "tools": [WEATHER, other, WEATHER]}), "tools[2].function.name")
    assert "'get_weather'" in err["message"] and "tools[0]" in err["message"]
    assert post(server, {**CHAT, "tools": [WEATHER, other]}).status_code == 200


def _nested(levels: int) -> list:
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


def test_tool_parameters_nest_at_most_64_levels(server):
    def tools(levels: int) -> list:
        return [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "default": _nested(levels - 1)}}}]  # the schema object is a level too

    assert post(server, {**CHAT, "tools": tools(64)}).status_code == 200
    err = refused(post(server, {**CHAT, "tools": tools(65)}), "tools[0].function.parameters")
    assert "64 levels" in err["message"]


def test_a_schema_xgrammar_refuses_only_when_compiling_is_a_400(server):
    """A negative minLength passes xgrammar's schema conversion and fails its grammar
    compilation; that failure used to read as 'xgrammar is not installed', so the
    call went out unconstrained."""
    pytest.importorskip("xgrammar")
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "minLength": -1}}, "required": ["x"]}}}
    err = refused(post(server, {**CHAT, "tools": [tool], "tool_choice": "required"}), "tools")
    assert "not a usable JSON schema" in err["message"] and ".cc" not in err["message"]
    still_serving(server)


# --- ids ----------------------------------------------------------------------------------


def test_every_id_has_a_length_limit(server):
    long, ok = "i" * (MAX_ID_LENGTH + 1), "i" * MAX_ID_LENGTH
    for field in ("program_id", "session_id", "user", "model"):
        refused(post(server, {**CHAT, field: long}), field)
    # a header id is checked even when another source names the program
    refused(post(server, {**CHAT, "program_id": "p"}, headers={"X-Session-Id": long}), "X-Session-Id")
    refused(post(server, CHAT, headers={"X-Program-Id": long}), "X-Program-Id")
    assert post(server, {**CHAT, "user": ok, "session_id": ok}, headers={"X-Program-Id": ok}).status_code == 200
    for op in ("release", "end"):
        r = httpx.post(f"{server.url}/v1/programs/{long}/{op}", headers=AUTH)
        assert "longer than" in refused(r, "program_id")["message"]
        refused(httpx.post(f"{server.url}/v1/programs/%20/{op}", headers=AUTH), "program_id")
        assert httpx.post(f"{server.url}/v1/programs/{ok}/{op}", headers=AUTH).status_code == 200
    still_serving(server)


# --- error text, Retry-After, /metrics ----------------------------------------------------------


def test_internal_paths_are_scrubbed_from_error_text():
    xgr = ('a tool\'s parameters are not a usable JSON schema: [04:45:08] /project/cpp/json_schema_converter.cc:4944: '
           'Unsupported type "strin"\n')
    assert scrub_internal_paths(xgr) == 'a tool\'s parameters are not a usable JSON schema: Unsupported type "strin"'
    assert scrub_internal_paths('File "/usr/lib/python3/x.py", line 3, in f: boom') == "in f: boom"
    assert scrub_internal_paths("the model `org/model-7b` does not exist") == "the model `org/model-7b` does not exist"
    assert APIError(400, "C:\\src\\grammar.cpp:12: bad token").message == "bad token"


def test_a_grammar_error_reaches_the_client_without_source_paths(server):
    pytest.importorskip("xgrammar")
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}
    err = refused(post(server, {**CHAT, "tools": [tool], "tool_choice": "required"}), "tools")
    assert "strin" in err["message"] and ".cc" not in err["message"] and "/" not in err["message"], err


def test_retry_after_on_429_and_503(server):
    for status in (429, 503):
        assert APIError(status, "busy").response().headers["retry-after"] == "1"
    assert "retry-after" not in APIError(400, "bad").response().headers
    eng = server.engine
    eng.call_sync(lambda: setattr(eng, "max_queue", 0))  # every request is refused: the queue is full
    try:
        r = post(server, CHAT)
    finally:
        eng.call_sync(lambda: setattr(eng, "max_queue", 64))
    assert refused(r, status=503)["code"] == "queue_full"
    assert int(r.headers["retry-after"]) >= 1


def test_health_503_says_when_to_retry():
    from starlette.testclient import TestClient

    from agentserve.server.app import create_app
    from agentserve.server.server_state import ServerConfig
    from server_fixtures import tiny_llm

    app = create_app(tiny_llm(), ServerConfig(["tiny"]))
    r = TestClient(app).get("/health")  # outside `with`: no lifespan, so the engine never started
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1


def test_metrics_need_the_api_key(server):
    assert refused(httpx.get(server.url + "/metrics"), status=401)["code"] == "invalid_api_key"
    refused(httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer wrong"}), status=401)
    r = httpx.get(server.url + "/metrics", headers=AUTH)
    assert r.status_code == 200 and "agentserve:" in r.text
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key


def test_pydantic_locations_become_openai_params():
    assert param_of(("messages", 1, "tool", "tool_call_id")) == "messages[1].tool_call_id"
    assert param_of(("messages", 0, "user", "content", "list[TextPart]", 0, "text")) == "messages[0].content[0].text"
    assert param_of(("stop", "str")) == "stop"
    assert param_of(("tool_choice", "NamedToolChoice", "function", "name")) == "tool_choice.function.name"
    assert param_of(("logit_bias", "50256")) == "logit_bias.50256"
