"""Structured outputs end to end: chat's `response_format` (json_object,
json_schema strict and not) and the Responses API's `text.format`, on a real
server with the tiny random model, driven by the `openai` client and
LangChain's `with_structured_output`.

The model is random: it never writes JSON by itself (a test below shows it),
so a reply that parses and follows the schema is the grammar's doing. Schemas
bound their strings (a pattern, maxLength or an enum): a random model would
otherwise write one string until max_tokens."""

from __future__ import annotations

import json
import sys
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from server_fixtures import EOS, start_tiny_server, idle as fixtures_idle

pytest.importorskip("xgrammar")

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSGS = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{0,6}$"},
                                                     "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "nickname": {"type": ["string", "null"], "maxLength": 6},
    },
    "required": ["name", "age", "score", "active", "color", "address", "tags", "nickname"],
    "additionalProperties": False,
}
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def server():
    # a context with room for an agent's instructions and tools beside a reply of a few hundred tokens
    srv, llm, scripted = start_tiny_server(api_key=KEY, positions=4096, kv_cache_tokens=16384)
    srv.llm, srv.scripted, srv.engine = llm, scripted, srv.app.state.server.engine
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def idle(server, timeout: float = 20.0) -> None:
    """No request left in the engine, no pin, and the block accounting intact."""
    fixtures_idle(server, timeout)
    assert server.engine.call_sync(lambda: len(server.llm.kv.pins)) == 0


def schema_format(schema: dict, strict: bool | None = True, name: str = "person") -> dict:
    spec = {"name": name, "description": "A person.", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": MSGS, **body},
                      headers=AUTH, timeout=120)


def refused(r: httpx.Response, param: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err


# --- json_schema ----------------------------------------------------------------------


@pytest.mark.parametrize("strict", [True, False, None])
def test_a_json_schema_reply_parses_and_follows_the_schema_whole_and_streamed(server, client, strict):
    kw = dict(model="tiny", messages=MSGS, max_tokens=400, temperature=1.0, seed=7,
              response_format=schema_format(PERSON, strict))
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "stop", c.message.content
    value = json.loads(c.message.content)
    jsonschema.validate(value, PERSON)
    assert not c.message.tool_calls
    # streamed, the same seed gives the same reply, delta by delta
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) > 1
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == c.message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    idle(server)


def test_without_a_response_format_the_random_model_writes_no_json(server, client):
    """What makes the replies above JSON is the grammar: the same request without it is not."""
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=40, temperature=1.0, seed=7)
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=40, temperature=1.0, seed=7,
                                       response_format={"type": "text"})
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)


def test_strict_leaves_out_what_the_schema_does_not_declare(server, client):
    """A schema without additionalProperties: strict mode gives exactly its properties, over several seeds."""
    open_schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
                                                    "n": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["color", "n"]}
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=100, temperature=1.0, seed=seed,
                                           response_format=schema_format(open_schema, True, "pick"))
        value = json.loads(r.choices[0].message.content)
        assert set(value) == {"color", "n"} and value["color"] in ("red", "green") and 0 <= value["n"] <= 9
    idle(server)


def test_a_json_schema_format_cut_by_max_tokens_says_length(server, client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=5, temperature=1.0, seed=7,
                                       response_format=schema_format(PERSON))
    c = r.choices[0]
    assert c.finish_reason == "length" and c.message.content == '{"nam'  # one token a byte
    idle(server)


# --- json_object ----------------------------------------------------------------------


def test_json_object_returns_a_json_object(server, client):
    for stream in (False, True):
        kw = dict(model="tiny", messages=MSGS, max_tokens=300, temperature=0.0,
                  response_format={"type": "json_object"})
        if stream:
            text = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(stream=True, **kw)
                           if ch.choices)
        else:
            r = client.chat.completions.create(**kw)
            assert r.choices[0].finish_reason == "stop"
            text = r.choices[0].message.content
        assert isinstance(json.loads(text), dict), text
    idle(server)


# --- with tools -------------------------------------------------------------------------


PICK = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}}, "required": ["color"],
        "additionalProperties": False}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_with_tools_the_grammar_allows_one_call_or_the_json(server):
    """tool_choice auto with a format: the grammar takes one call of a declared tool, or the
    JSON, each followed by the end of the turn; nothing else (prose, another tool, two calls)."""
    import xgrammar as xgr

    c = server.llm.json_constraint(PICK, True, WEATHER)

    def takes(text: str) -> bool:
        m = xgr.GrammarMatcher(c.compiled)
        return m.accept_string(text) and m.accept_token(EOS) and m.is_terminated()

    assert takes(CALL_TEXT) and takes('{"color": "red"}')
    assert not takes("Sure! " + CALL_TEXT) and not takes('{"color": "blue"}') and not takes(CALL_TEXT + CALL_TEXT)
    assert not takes(CALL_TEXT.replace("get_weather", "get_time")) and not takes('{"color": "red"} ok')
    # without tools, the JSON only
    assert not xgr.GrammarMatcher(server.llm.json_constraint(PICK, True).compiled).accept_string(CALL_TEXT)


def test_with_tools_the_reply_is_the_json_or_a_call(server, client):
    kw = dict(model="tiny", messages=MSGS, max_tokens=100, temperature=1.0, seed=4, tools=WEATHER,
              response_format=schema_format(PICK, True, "pick"))
    r = client.chat.completions.create(**kw)
    c = r.choices[0]  # the random model answers with the JSON (it would need `<` first to call)
    assert c.finish_reason == "stop" and json.loads(c.message.content)["color"] in ("red", "green")
    assert not c.message.tool_calls
    # streamed as it grows (not held whole as a possible bare-JSON call)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    parts = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(parts) > 1 and "".join(parts) == c.message.content
    # a call the model writes is a call (scripted: the random model does not choose one)
    server.scripted.script("fmt-call", CALL_TEXT)
    r = client.chat.completions.create(**kw, extra_headers={"X-Program-Id": "fmt-call", "X-Program-End": "1"})
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    # a forced call is a call, whatever the format
    r = client.chat.completions.create(**{**kw, "tool_choice": "required"})
    assert r.choices[0].finish_reason == "tool_calls"
    # tool_choice none: the JSON only
    r = client.chat.completions.create(**{**kw, "tool_choice": "none"})
    assert json.loads(r.choices[0].message.content)["color"] in ("red", "green")
    idle(server)


def test_a_json_reply_shaped_like_a_call_stays_the_answer():
    """Under a JSON format a bare-JSON reply is the answer, never read as a Llama 3 style call."""
    from agentserve.server.structured_output import without_bare_json_calls
    from agentserve.server.tool_output import parse_tool_output, tool_choice_for

    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    choice = tool_choice_for(["get_weather"], "auto")
    assert parse_tool_output(text, choice)[1]  # without a format, a Llama 3 call
    assert parse_tool_output(text, without_bare_json_calls(choice)) == (text, [])


# --- bad input --------------------------------------------------------------------------


def prefilled(server) -> int:
    return server.engine.call_sync(lambda: server.llm.scheduler.stats.prefill_tokens)


def test_bad_formats_are_a_400_naming_the_field(server):
    idle(server)
    before = prefilled(server)
    err = refused(post(server, {"response_format": schema_format({"type": "strin"})}), "response_format")
    assert "strin" in err["message"] and ".cc" not in err["message"]
    # a schema that converts but does not compile (a negative minLength) is the client's too
    bad = {"type": "object", "properties": {"x": {"type": "string", "minLength": -1}}, "required": ["x"]}
    assert "not a usable JSON schema" in refused(post(server, {"response_format": schema_format(bad)}),
                                                 "response_format")["message"]
    # with tools, the grammar that fails names its owner
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": bad}}]
    ok = {"type": "object", "properties": {"y": {"enum": [1, 2]}}, "required": ["y"]}
    refused(post(server, {"tools": WEATHER, "response_format": schema_format(bad)}), "response_format")
    refused(post(server, {"tools": bad_tool, "response_format": schema_format(ok)}), "tools")
    refused(post(server, {"response_format": {"type": "json_schema"}}), "response_format")
    refused(post(server, {"response_format": {"type": "xml"}}), "response_format.type")
    for name in ("has space", "", "n" * 65):
        refused(post(server, {"response_format": schema_format(ok, name=name)}), "response_format.json_schema.name")
    refused(post(server, {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": "yes",
                                                                                      "schema": ok}}}),
            "response_format.json_schema.strict")
    deep: dict = {"type": "object"}
    for _ in range(70):
        deep = {"type": "object", "properties": {"a": deep}}
    err = refused(post(server, {"response_format": schema_format(deep)}), "response_format.json_schema.schema")
    assert "64 levels" in err["message"]
    assert prefilled(server) == before  # nothing reached the engine
    idle(server)
    r = post(server, {"max_tokens": 60, "response_format": schema_format(ok, name="ok_name-2")})
    assert r.status_code == 200 and json.loads(r.json()["choices"][0]["message"]["content"])["y"] in (1, 2)
    idle(server)


@pytest.fixture
def server_without_xgrammar(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    srv, llm, _ = start_tiny_server(api_key=None)
    srv.llm, srv.engine = llm, srv.app.state.server.engine
    yield srv
    srv.stop()


def test_without_xgrammar_a_json_format_is_a_400_that_says_how_to_install_it(server_without_xgrammar):
    srv = server_without_xgrammar
    for fmt in ({"type": "json_object"}, schema_format({"type": "object"})):
        for stream in (False, True):
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json={
                "model": "tiny", "messages": MSGS, "max_tokens": 8, "response_format": fmt, "stream": stream})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert (err["param"], err["code"]) == ("response_format", "structured_output_unavailable")
            assert "pip install 'agentserve[structured]'" in err["message"]
    assert srv.llm.scheduler.stats.prefill_tokens == 0  # nothing reached the engine
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": MSGS, "max_tokens": 4, "response_format": {"type": "text"}})
    assert r.status_code == 200
    idle(srv)


# --- the clients ------------------------------------------------------------------------


class Address(BaseModel):
    city: Literal["Paris", "Oslo", "Rome"]
    zip: int = Field(ge=0, le=99999)


class Person(BaseModel):
    name: str = Field(pattern="^[a-z]{1,8}$")
    age: int = Field(ge=0, le=150)
    color: Literal["red", "green", "blue"]
    address: Address
    tags: list[Literal["a", "b"]] = Field(max_length=3)


def test_langchain_with_structured_output_returns_the_parsed_object(server):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(base_url=server.url + "/v1", api_key=KEY, model="tiny", max_retries=0, max_tokens=400,
                        temperature=1.0, seed=3)
    person = llm.with_structured_output(Person).invoke("Describe a person.")
    assert isinstance(person, Person) and isinstance(person.address, Address)
    idle(server)


def test_the_responses_api_text_format(server, client):
    r = client.responses.parse(model="tiny", input="Describe a person.", text_format=Person, max_output_tokens=400,
                               temperature=1.0, store=False)
    assert r.status == "completed" and isinstance(r.output_parsed, Person)
    r = client.responses.create(model="tiny", input="Describe a person.", max_output_tokens=400, temperature=1.0,
                                store=False, text={"format": {"type": "json_schema", "name": "person",
                                                              "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), PERSON)
    idle(server)


def test_the_openai_agents_sdk_with_an_output_type_and_a_tool(server):
    """The Agents SDK sends the output type as text.format beside its tools: the agent calls its
    tool (scripted), then answers under the format's grammar, which the SDK parses."""
    agents = pytest.importorskip("agents")
    import asyncio

    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        seen.append(city)
        return "sunny"

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        model = agents.OpenAIResponsesModel(model="tiny", openai_client=aclient)
        agent = agents.Agent(name="typed", instructions="Describe a person.", tools=[get_weather], model=model,
                             output_type=Person, model_settings=agents.ModelSettings(max_tokens=1500))
        try:
            return await agents.Runner.run(agent, "Weather in Paris, then a person?")
        finally:
            await aclient.close()

    server.scripted.script_next(CALL_TEXT)
    result = asyncio.run(run())
    assert seen == ["Paris"] and isinstance(result.final_output, Person)
    idle(server)


def test_a_bounded_string_takes_whole_utf8_characters_only():
    """maxLength counts characters: a byte-level model must not write a surrogate's 3-byte
    encoding (not UTF-8; it decodes to three U+FFFD where the grammar counted one), while real
    multibyte characters stay allowed."""
    import xgrammar as xgr

    from agentserve.runner.structured import json_schema_grammar

    grammar = json_schema_grammar({"type": "string", "maxLength": 2})
    info = xgr.TokenizerInfo([bytes([b]) for b in range(256)], xgr.VocabType.RAW, vocab_size=256)
    compiled = xgr.GrammarCompiler(info).compile_grammar(grammar)

    def takes(text: bytes) -> bool:
        m = xgr.GrammarMatcher(compiled)
        return all(m.accept_token(b) for b in text)

    assert takes('"é\U0001F600"'.encode())
    assert takes(b'"\\t"')
    assert not takes(b'"\xed\xa0\x80"')  # U+D800's encoding
    assert not takes(b'"abc"')  # three characters
    assert not takes(b'"\t"')  # a raw control character
