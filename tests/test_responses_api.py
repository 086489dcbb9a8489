"""The Responses API (POST /v1/responses and the stored responses' endpoints)
end to end: a real server on loopback with the tiny random model, driven by
the official `openai` client, the OpenAI Agents SDK on its default Responses
path and LangChain's ChatOpenAI(use_responses_api=True), and by raw request
fixtures in the shape Codex CLI sends. Model output is scripted
(ScriptedExecutor): Hermes tool calls, replies, in the order requests sample."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest
from pydantic import TypeAdapter

from server_fixtures import start_tiny_server, idle

KEY, OTHER_KEY = "test-key", "other-key"
TENANT = "api-key-1"  # the tenant of KEY (ServerConfig.api_key)
AUTH = {"Authorization": f"Bearer {KEY}"}
BS = 4  # the tiny server's block size
CONTEXT = 4096  # the tiny model's context here: room for an agent's tools
WEATHER = [{"type": "function", "name": "get_weather", "description": "Current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def call_text(name: str, **args) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


@pytest.fixture(scope="module")
def server():
    srv, llm, scripted = start_tiny_server(api_key=KEY, config={"api_keys": {OTHER_KEY: "tenant-b"}},
                                           positions=CONTEXT, kv_cache_tokens=4 * CONTEXT)
    srv.llm, srv.scripted, srv.engine = llm, scripted, srv.app.state.server.engine
    srv.store = srv.app.state.server.responses_store
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(autouse=True)
def _no_leftover_scripts(server):
    yield
    assert not server.scripted.queued, "a scripted reply was never used"
    server.scripted.queued.clear()


def program(server, pid: str):
    return server.engine.call_sync(lambda: server.llm.scheduler.programs.get(pid))


def post(server, body: dict, key: str = KEY, **kw) -> httpx.Response:
    return httpx.post(server.url + "/v1/responses", json={"model": "tiny", **body}, timeout=60,
                      headers={"Authorization": f"Bearer {key}", **kw.pop("headers", {})}, **kw)


def error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


EVENT = TypeAdapter(openai.types.responses.ResponseStreamEvent)


def sse_events(resp: httpx.Response) -> list:
    """A stream's events, each line pair checked (`event:` names its data's type) and parsed
    by the SDK's own event models."""
    out, name = [], None
    for line in resp.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
            assert data["type"] == name, (name, data)
            out.append(EVENT.validate_python(data))
    return out


# --- happy paths --------------------------------------------------------------------------


def test_create_with_string_and_with_items(server, client):
    server.scripted.script_next("Hello, traveller.", "Bonjour.")
    r = client.responses.create(model="tiny", input="hello", temperature=0, metadata={"run": "1"})
    assert isinstance(r, openai.types.responses.Response)
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed" and r.model == "tiny"
    assert r.output_text == "Hello, traveller."
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.content[0].type == "output_text" and msg.content[0].annotations == []
    u = r.usage
    assert u.output_tokens == len("Hello, traveller.") + 1 and u.output_tokens_details.reasoning_tokens == 0
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.input_tokens_details.cached_tokens >= 0
    assert (r.store, r.truncation, r.parallel_tool_calls, r.tool_choice, r.tools) == (True, "disabled", True, "auto", [])
    assert r.metadata == {"run": "1"} and r.error is None and r.incomplete_details is None
    # the raw body passes the SDK's own model, validated (not only constructed)
    raw = httpx.get(f"{server.url}/v1/responses/{r.id}", headers=AUTH).json()
    assert openai.types.responses.Response.model_validate(raw).output_text == "Hello, traveller."
    # items: messages with and without `type`, text parts, developer and assistant roles
    r2 = client.responses.create(model="tiny", instructions="Answer in French.", input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hello."}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"role": "user", "content": "In French?"}])
    assert r2.output_text == "Bonjour." and r2.instructions == "Answer in French."
    # max_output_tokens cuts the reply: incomplete, with the reason (scripted: a sampled reply may end
    # within 3 tokens)
    server.scripted.script_next("Hello, traveller.")
    r3 = client.responses.create(model="tiny", input="hello", max_output_tokens=3, store=False)
    assert r3.status == "incomplete" and r3.incomplete_details.reason == "max_output_tokens"
    assert r3.usage.output_tokens == 3 and r3.store is False
    idle(server)


def test_stream_events_add_up_to_the_whole_response(server, client):
    text = "It is sunny. " + call_text("get_weather", city="Paris")
    server.scripted.script_next(text, text)
    whole = client.responses.create(model="tiny", input="Weather in Paris?", tools=WEATHER, store=False)
    with client.responses.stream(model="tiny", input="Weather in Paris?", tools=WEATHER, store=False) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == "response.completed"
    for k in ("response.output_text.delta", "response.output_text.done", "response.content_part.done",
              "response.function_call_arguments.delta", "response.function_call_arguments.done",
              "response.output_item.done"):
        assert k in kinds, k
    seqs = [e.sequence_number for e in events]
    assert seqs == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "It is sunny."
    args = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(args.arguments) == {"city": "Paris"}
    for r in (whole, final):
        msg, call = r.output
        assert msg.content[0].text == "It is sunny." and call.type == "function_call"
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
        assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    assert final.usage.output_tokens == whole.usage.output_tokens
    # create(stream=True) yields the same event models; no chat-style [DONE] line on the wire
    server.scripted.script_next("Short.")
    got = list(client.responses.create(model="tiny", input="hi", stream=True, store=False))
    assert got[-1].type == "response.completed" and got[-1].response.output_text == "Short."
    with httpx.stream("POST", server.url + "/v1/responses", headers=AUTH, timeout=60,
                      json={"model": "tiny", "input": "hi", "stream": True, "max_output_tokens": 2,
                            "store": False}) as resp:
        raw = resp.read().decode()
    assert "[DONE]" not in raw and raw.startswith("event: response.created\ndata: ")
    assert "event: response.incomplete" in raw  # cut at max_output_tokens
    idle(server)


def _weather_loop(client, server, *, chained: bool, salt: str) -> list:
    """Three turns: a call, a second call after its output, then the answer. Chained: each
    turn sends only its new items with previous_response_id; else the whole history, unstored."""
    scripts = [call_text("get_weather", city="Paris"), call_text("get_weather", city="Lyon"),
               "Sunny in Paris, rain in Lyon."]
    base = dict(model="tiny", tools=WEATHER, instructions="You report the weather.", extra_body={"cache_salt": salt})
    history: list = [{"role": "user", "content": "Weather in Paris and Lyon?"}]
    replies, prev = [], None
    for turn, script in enumerate(scripts):
        if chained and turn > 0:
            server.scripted.script_turns(f"{TENANT}/{replies[0].id}", script)
        else:
            server.scripted.script_next(script)
        new = history if not chained or prev is None else history[-1:]
        r = client.responses.create(input=new, previous_response_id=prev, store=chained, **base)
        replies.append(r)
        if r.output[-1].type == "function_call":
            call = r.output[-1]
            history = history + [o.model_dump(exclude_none=True) for o in r.output] + [
                {"type": "function_call_output", "call_id": call.call_id, "output": f"weather #{turn}"}]
        prev = r.id if chained else None
    return replies


def test_function_call_loop_chained_and_full_history(server, client):
    chained = _weather_loop(client, server, chained=True, salt="loop-a")
    full = _weather_loop(client, server, chained=False, salt="loop-b")
    for a, b in zip(chained, full):
        assert [o.type for o in a.output] == [o.type for o in b.output]
        assert a.output_text == b.output_text
        if a.output[-1].type == "function_call":
            assert (a.output[-1].name, a.output[-1].arguments) == (b.output[-1].name, b.output[-1].arguments)
        assert a.usage.input_tokens == b.usage.input_tokens  # the same prompt, rendered from the store or not
        assert a.usage.input_tokens_details.cached_tokens == b.usage.input_tokens_details.cached_tokens
    assert chained[-1].output_text == "Sunny in Paris, rain in Lyon."
    # each turn reused the previous turn's prompt and output
    for prev, r in zip(chained, chained[1:]):
        covered = prev.usage.input_tokens + prev.usage.output_tokens - 1
        assert r.usage.input_tokens_details.cached_tokens >= covered // BS * BS
    # the chain is one program, named by its first response
    p = program(server, f"{TENANT}/{chained[0].id}")
    assert p is not None and p.turns_finished == 3
    assert chained[1].previous_response_id == chained[0].id
    idle(server)


def test_ten_turn_chain_sends_only_the_delta_and_hits_as_the_full_history(server, client):
    def run(chained: bool, salt: str) -> list:
        history, out, prev = [], [], None
        for turn in range(10):
            server.scripted.script_next(f"ok {turn}.")
            msg = {"role": "user", "content": f"step {turn}: go on."}
            history.append(msg)
            r = client.responses.create(model="tiny", input=[msg] if chained else list(history), store=chained,
                                        previous_response_id=prev, extra_body={"cache_salt": salt})
            history += [o.model_dump(exclude_none=True) for o in r.output]
            out.append(r)
            prev = r.id if chained else None
        return out

    delta, full = run(True, "ten-a"), run(False, "ten-b")
    assert [r.output_text for r in delta] == [f"ok {t}." for t in range(10)] == [r.output_text for r in full]
    assert [r.usage.input_tokens for r in delta] == [r.usage.input_tokens for r in full]
    hits = [r.usage.input_tokens_details.cached_tokens for r in delta]
    assert hits == [r.usage.input_tokens_details.cached_tokens for r in full]
    assert hits[0] == 0 and all(h > 0 for h in hits[1:])
    # the whole conversation is listed as the last response's input, newest first by default
    items = client.responses.input_items.list(delta[-1].id, limit=100).data
    assert len(items) == 10 + 9 and items[0].content[0].text == "step 9: go on."
    idle(server)


def test_get_delete_and_input_items(server, client):
    server.scripted.script_next("First.", "Second.")
    r1 = client.responses.create(model="tiny", input=[{"role": "user", "content": "one"}])
    r2 = client.responses.create(model="tiny", input=[{"role": "user", "content": "two"}], previous_response_id=r1.id)
    got = client.responses.retrieve(r2.id)
    assert got.id == r2.id and got.output_text == "Second." and got.previous_response_id == r1.id
    page = client.responses.input_items.list(r2.id, order="asc")
    assert [i.type for i in page.data] == ["message", "message", "message"]
    assert [i.role for i in page.data] == ["user", "assistant", "user"]
    assert page.data[1].content[0].text == "First." and page.has_more is False
    raw = httpx.get(f"{server.url}/v1/responses/{r2.id}/input_items?order=asc&limit=1", headers=AUTH).json()
    assert raw["object"] == "list" and raw["has_more"] is True and raw["first_id"] == raw["last_id"]
    after = httpx.get(f"{server.url}/v1/responses/{r2.id}/input_items",
                      params={"order": "asc", "after": raw["last_id"]}, headers=AUTH).json()
    assert [i["role"] for i in after["data"]] == ["assistant", "user"]
    item = TypeAdapter(openai.types.responses.ResponseItem)
    assert [item.validate_python(i).type for i in after["data"]] == ["message", "message"]
    # the SDK's cursor pagination walks every page
    assert len(list(client.responses.input_items.list(r2.id, limit=1))) == 3
    r = httpx.delete(f"{server.url}/v1/responses/{r1.id}", headers=AUTH)
    assert r.json() == {"id": r1.id, "object": "response", "deleted": True}
    assert httpx.get(f"{server.url}/v1/responses/{r1.id}", headers=AUTH).status_code == 404
    assert httpx.delete(f"{server.url}/v1/responses/{r1.id}", headers=AUTH).status_code == 404
    # what continued it still holds its part of the chain
    assert len(client.responses.input_items.list(r2.id).data) == 3
    idle(server)


def test_custom_tool_round_trip_streamed_and_whole(server, client):
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
    tools = [{"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
              "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /(.|\\n)*/'}},
             *WEATHER]
    server.scripted.script_next(call_text("apply_patch", input=patch))
    r = client.responses.create(model="tiny", input="Add a.txt", tools=tools, prompt_cache_key="patcher")
    (call,) = r.output
    assert call.type == "custom_tool_call" and call.name == "apply_patch" and call.input == patch
    assert call.call_id.startswith("call_")
    server.scripted.script_turns(f"{TENANT}/patcher", "Done.")
    r2 = client.responses.create(model="tiny", previous_response_id=r.id, tools=tools, input=[
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Success."}])
    assert r2.output_text == "Done."
    assert r2.usage.input_tokens_details.cached_tokens >= (r.usage.input_tokens + r.usage.output_tokens - 1) // BS * BS
    # streamed: the input arrives in custom_tool_call_input events
    server.scripted.script_next(call_text("apply_patch", input=patch))
    with client.responses.stream(model="tiny", input="Add a.txt", tools=tools, store=False) as s:
        events = list(s)
    done = next(e for e in events if e.type == "response.custom_tool_call_input.done")
    assert done.input == patch
    assert "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta") == patch
    assert events[-1].response.output[0].type == "custom_tool_call"
    assert program(server, f"{TENANT}/patcher").turns_finished == 2
    idle(server)


def test_a_regex_grammar_holds_a_forced_custom_call(server, client):
    tools = [{"type": "custom", "name": "ticket", "format": {"type": "grammar", "syntax": "regex",
                                                             "definition": "[A-Z]{3}-[0-9]{2}"}}]
    # no script: the random model writes the call, held to the grammar by the decoder
    r = client.responses.create(model="tiny", input="Open a ticket.", tools=tools, store=False,
                                tool_choice={"type": "custom", "name": "ticket"}, max_output_tokens=80)
    (call,) = r.output
    assert call.type == "custom_tool_call" and re.fullmatch(r"[A-Z]{3}-[0-9]{2}", call.input), call
    idle(server)


def test_namespaced_tools_are_flattened(server, client):
    tools = [{"type": "namespace", "name": "crm", "description": "Customer records.", "tools": [
        {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {
            "email": {"type": "string"}}}},
        {"type": "custom", "name": "note"}]}, *WEATHER]
    server.scripted.script_next(call_text("lookup", email="a@b.c") + "\n" + call_text("note", input="called"))
    r = client.responses.create(model="tiny", input="Find a@b.c", tools=tools, store=False)
    lookup, note = r.output
    assert (lookup.type, lookup.name, lookup.namespace) == ("function_call", "lookup", "crm")
    assert json.loads(lookup.arguments) == {"email": "a@b.c"}
    assert (note.type, note.name, note.namespace, note.input) == ("custom_tool_call", "note", "crm", "called")
    dup = [*tools, {"type": "namespace", "name": "other", "tools": [{"type": "function", "name": "lookup"}]}]
    resp = post(server, {"input": "x", "tools": dup})
    assert resp.status_code == 400 and error(resp)["param"] == "tools[2].tools[0].name"
    idle(server)


def test_prewarm_then_a_chained_turn_hits_its_kv(server, client):
    body = dict(model="tiny", instructions="You are a coding agent.", tools=WEATHER,
                input=[{"role": "user", "content": "Fix the failing test in parser.py."}])
    warm = client.responses.create(**body, extra_body={"generate": False})
    assert warm.status == "completed" and warm.output == [] and warm.output_text == ""
    assert warm.usage.output_tokens == 0 and warm.usage.input_tokens > 0
    pid = f"{TENANT}/{warm.id}"
    assert program(server, pid).turns_finished == 1  # the program's first turn: a prefill
    server.scripted.script_turns(pid, "Looking at parser.py.")
    # instructions are never carried over from a previous response (OpenAI's rule): Codex sends them each time
    r = client.responses.create(model="tiny", instructions=body["instructions"], tools=WEATHER,
                                previous_response_id=warm.id, input=[])
    assert r.output_text == "Looking at parser.py." and r.usage.input_tokens == warm.usage.input_tokens
    assert r.usage.input_tokens_details.cached_tokens >= (warm.usage.input_tokens - 1) // BS * BS
    assert program(server, pid).turns_finished == 2
    # OpenAI's spelling, streamed: created, in_progress, completed, nothing else
    events = list(client.responses.create(**body, stream=True, store=False,
                                          extra_body={"prompt_cache_options": {"prewarm": True}}))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.completed"]
    assert events[-1].response.output == [] and events[-1].response.usage.output_tokens == 0
    idle(server)


def test_truncation_auto_drops_the_oldest_turns(server, client):
    history = []
    for i in range(8):
        history += [{"role": "user", "content": f"turn {i}: " + "x" * 600},
                    {"role": "assistant", "content": "noted " + "y" * 20}]
    history.append({"role": "user", "content": "and now?"})
    resp = post(server, {"instructions": "Keep notes.", "input": history, "store": False})
    assert resp.status_code == 400 and error(resp)["code"] == "context_length_exceeded"
    assert f"{CONTEXT} tokens (tiny)" in error(resp)["message"]
    server.scripted.script_next("Fits now.")
    r = client.responses.create(model="tiny", instructions="Keep notes.", input=history, truncation="auto",
                                store=False, max_output_tokens=50)
    assert r.output_text == "Fits now." and r.truncation == "auto"
    assert CONTEXT - 50 - 700 < r.usage.input_tokens <= CONTEXT - 50  # one turn is ~650 tokens: no more went
    idle(server)


def test_the_openai_agents_sdk_on_its_default_responses_path(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        seen.append(city)
        return "sunny"

    async def run(**kw):
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        model = agents.OpenAIResponsesModel(model="tiny", openai_client=client)
        agent = agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                             model=model)
        try:
            return await agents.Runner.run(agent, "Weather in Paris?", **kw)
        finally:
            await client.close()

    # as is: the SDK sends the whole history each call, names no program: each call is its own
    server.scripted.script_next(call_text("get_weather", city="Paris"), "Sunny in Paris.")
    result = asyncio.run(run())
    assert seen == ["Paris"] and result.final_output == "Sunny in Paris."
    first, second = result.raw_responses
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 2
    # chained by the SDK (auto_previous_response_id): the chain is one program
    server.scripted.script_next(call_text("get_weather", city="Oslo"), "Snow in Oslo.")
    result = asyncio.run(run(auto_previous_response_id=True))
    assert seen == ["Paris", "Oslo"] and result.final_output == "Snow in Oslo."
    first_id = result.raw_responses[0].response_id
    assert program(server, f"{TENANT}/{first_id}").turns_finished == 2
    idle(server)


def test_langchain_chat_openai_on_the_responses_api(server):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return "sunny"

    llm = lc.ChatOpenAI(model="tiny", base_url=server.url + "/v1", api_key=KEY, use_responses_api=True,
                        max_retries=0)
    server.scripted.script_next(call_text("get_weather", city="Rome"))
    msg = llm.bind_tools([get_weather]).invoke("Weather in Rome?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Rome"}
    idle(server)


def test_a_codex_session_fixture(server):
    """Requests in the shape Codex CLI sends, replayed over four turns: instructions, function
    tools and a custom apply_patch tool, store false with the full input, prompt_cache_key and
    the session-id header, streamed. Each turn is answered, turn 2+ hits at least 90% of its
    prompt in the cache, and all of them are one program."""
    session = "019a5c2e-codex-session"
    tools = [
        {"type": "function", "name": "shell", "description": "Run a command.", "strict": False,
         "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}},
                                                          "workdir": {"type": "string"}},
                        "required": ["command"], "additionalProperties": False}},
        {"type": "function", "name": "update_plan", "description": "Update the plan.", "strict": False,
         "parameters": {"type": "object", "properties": {"plan": {"type": "string"}}, "required": ["plan"]}},
        {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
         "format": {"type": "grammar", "syntax": "lark",
                    "definition": 'start: "*** Begin Patch" LF hunk+ "*** End Patch"\nhunk: /[^\\n]*/ LF\n'}},
    ]
    base = {"model": "tiny", "instructions": "You are Codex, a coding agent. Be terse.", "tools": tools,
            "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": {"effort": "low", "summary": "auto"},
            "store": False, "stream": True, "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": session}
    headers = {"session-id": session, "originator": "codex_cli_rs", "OpenAI-Beta": "responses=experimental"}
    pid = f"{TENANT}/{session}"
    server.scripted.script_turns(pid, call_text("shell", command=["ls"]),
                                 call_text("apply_patch", input="*** Begin Patch\nfix\n*** End Patch"),
                                 call_text("shell", command=["pytest", "-q"]), "Fixed.")
    items: list = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix the bug."}]}]
    usages = []
    for turn in range(4):
        with httpx.stream("POST", server.url + "/v1/responses", json={**base, "input": items}, timeout=60,
                          headers={**AUTH, **headers}) as resp:
            assert resp.status_code == 200, resp.read()
            events = sse_events(resp)
        final = events[-1]
        assert final.type == "response.completed", final
        usages.append(final.response.usage)
        out = [o.model_dump(exclude_none=True) for o in final.response.output]
        items += out
        last = out[-1]
        if last["type"] == "function_call":
            items.append({"type": "function_call_output", "call_id": last["call_id"], "output": "ok\nexit 0"})
        elif last["type"] == "custom_tool_call":
            items.append({"type": "custom_tool_call_output", "call_id": last["call_id"], "output": "Success."})
        else:
            assert turn == 3 and final.response.output_text == "Fixed."
    for u in usages[1:]:
        assert u.input_tokens_details.cached_tokens >= 0.9 * u.input_tokens, usages
    assert program(server, pid).turns_finished == 4
    idle(server)


def test_an_engine_failure_mid_stream_is_an_error_event_then_response_failed(server, client):
    pid = f"{TENANT}/boom"
    server.scripted.fail_programs.add(pid)
    try:
        with httpx.stream("POST", server.url + "/v1/responses", headers=AUTH, timeout=60,
                          json={"model": "tiny", "input": "hi", "stream": True, "prompt_cache_key": "boom"}) as resp:
            assert resp.status_code == 200
            events = sse_events(resp)
        assert [e.type for e in events[-2:]] == ["error", "response.failed"]
        assert "injected executor failure" in events[-2].message
        failed = events[-1].response
        assert failed.status == "failed" and failed.error.code == "server_error"
        with pytest.raises(openai.NotFoundError):  # a failed response is not stored
            client.responses.retrieve(failed.id)
    finally:
        server.scripted.fail_programs.discard(pid)
    server.scripted.script_next("still here")
    assert client.responses.create(model="tiny", input="hi", store=False).output_text == "still here"
    idle(server)


# --- bad input ----------------------------------------------------------------------------


def test_bad_input_is_a_clear_error_and_loses_nothing(server, client):
    server.scripted.script_next(call_text("get_weather", city="Paris"))
    r = client.responses.create(model="tiny", input="Weather?", tools=WEATHER)
    call = r.output[-1]
    stored = len(server.store)
    cases = [
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "input[0].type", "web_search_call"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, 400,
         "input[0].content[0].type", "input_image"),
        ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]}, 400,
         "input[0].call_id", "answers no call"),
        ({"input": [{"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                    {"role": "user", "content": "hi"}], "tools": WEATHER}, 400, "input[1]", "no tool output"),
        ({"previous_response_id": r.id, "input": "and?", "tools": WEATHER}, 400, "input[0]", "no tool output"),
        ({"previous_response_id": r.id, "tools": WEATHER, "input": [
            {"type": "function_call_output", "call_id": call.call_id, "output": "x"},
            {"type": "function_call_output", "call_id": call.call_id, "output": "x"}]}, 400, "input[1].call_id",
         "answered already"),
        ({"previous_response_id": "resp_unknown", "input": "x"}, 404, "previous_response_id", "not found"),
        ({"input": "x", "background": True}, 400, "background", "background"),
        ({"input": "x", "conversation": "conv_1"}, 400, "conversation", "Conversations API"),
        ({"input": "x", "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, 400, "tool_choice",
         "allowed_tools"),
        ({"input": "x", "tools": WEATHER, "tool_choice": {"type": "custom", "name": "get_weather"}}, 400,
         "tool_choice", "function tool"),
        ({"input": "x", "tools": WEATHER, "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice",
         "not among the tools"),
        ({"input": []}, 400, "input", "nothing to answer"),
        ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens", ""),
        ({"input": "x", "temperature": "hot"}, 400, "temperature", ""),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, 400, "text.format", "name"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}}, 400,
         "text.format.name", "pattern"),
    ]
    for kind in ("web_search", "web_search_preview", "file_search", "computer_use_preview", "mcp",
                 "code_interpreter", "image_generation", "local_shell"):
        cases.append(({"input": "x", "tools": [*WEATHER, {"type": kind}]}, 400, "tools[1].type", repr(kind)))
    for body, status, param, words in cases:
        resp = post(server, body)
        assert resp.status_code == status, (body, resp.text)
        err = error(resp)
        assert err["param"] == param and words in err["message"], (body, err)
        assert err["type"] == "invalid_request_error"
    assert error(post(server, {"previous_response_id": "resp_unknown", "input": "x"}))["code"] == \
        "previous_response_not_found"
    # a chain longer than the context: the model and its context are named
    server.scripted.script_next("ok")
    big = client.responses.create(model="tiny", input="z" * 2500)
    resp = post(server, {"previous_response_id": big.id, "input": "w" * 2000})
    assert resp.status_code == 400 and error(resp)["code"] == "context_length_exceeded"
    assert f"{CONTEXT} tokens (tiny)" in error(resp)["message"] and "truncation" in error(resp)["message"]
    # stored responses: unknown ids, bad listings
    assert error(httpx.get(f"{server.url}/v1/responses/resp_nope", headers=AUTH))["code"] == "response_not_found"
    for q in ("limit=0", "limit=101", "limit=x", "order=up", "after=msg_nope"):
        resp = httpx.get(f"{server.url}/v1/responses/{big.id}/input_items?{q}", headers=AUTH)
        assert resp.status_code == 400, q
    assert httpx.get(f"{server.url}/v1/responses/{big.id}").status_code == 401
    idle(server)
    assert len(server.store) == stored + 1  # only `big` was added; nothing refused was stored
    assert client.responses.retrieve(r.id).id == r.id
    assert server.engine.call_sync(lambda: server.llm.kv.num_free_blocks) > 0


def test_another_tenants_response_is_unknown(server, client):
    server.scripted.script_next("mine")
    r = client.responses.create(model="tiny", input="secret")
    theirs = post(server, {"previous_response_id": r.id, "input": "x"}, key=OTHER_KEY)
    unknown = post(server, {"previous_response_id": "resp_" + "0" * 24, "input": "x"}, key=OTHER_KEY)
    assert theirs.status_code == unknown.status_code == 404
    assert error(theirs)["message"].replace(r.id, "ID") == error(unknown)["message"].replace("resp_" + "0" * 24, "ID")
    assert error(theirs)["code"] == "previous_response_not_found"
    for method in ("GET", "DELETE"):
        resp = httpx.request(method, f"{server.url}/v1/responses/{r.id}", headers={"Authorization": f"Bearer {OTHER_KEY}"})
        assert resp.status_code == 404
    assert httpx.get(f"{server.url}/v1/responses/{r.id}/input_items",
                     headers={"Authorization": f"Bearer {OTHER_KEY}"}).status_code == 404
    assert client.responses.retrieve(r.id).output_text == "mine"  # still there for its owner
    idle(server)


def test_the_store_evicts_by_count_and_bytes():
    srv, llm, scripted = start_tiny_server(api_key=KEY, config={"responses_store_max": 3,
                                                                "responses_store_bytes": 64 * 1024})
    try:
        srv.llm, srv.scripted, srv.engine = llm, scripted, srv.app.state.server.engine
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        scripted.script_next(*[f"r{i}" for i in range(5)])
        ids = [client.responses.create(model="tiny", input=f"q{i}", max_output_tokens=5).id for i in range(5)]
        store = srv.app.state.server.responses_store
        assert len(store) == 3 and store.evicted == 2
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.create(model="tiny", input="more", previous_response_id=ids[0])
        assert e.value.body["code"] == "previous_response_not_found" and "evicted" in e.value.body["message"]
        assert client.responses.retrieve(ids[4]).output_text == "r4"
        # a chain longer than the count stays whole: its evicted ancestors are still held by it
        scripted.script_next(*[f"c{i}" for i in range(5)])
        prev = None
        for i in range(5):
            prev = client.responses.create(model="tiny", input=[{"role": "user", "content": f"c{i}"}],
                                           previous_response_id=prev, max_output_tokens=5).id
        items = client.responses.input_items.list(prev, limit=100).data
        assert len(items) == 9 and len(store) == 3
        assert store.bytes <= store.max_bytes
        # bytes: one response larger than the bound is not kept at all
        scripted.script_next("big")
        big = client.responses.create(model="tiny", input="b" * 200,
                                      metadata={f"k{i}": "v" * 512 for i in range(16)}).id
        store.max_bytes = 2000
        scripted.script_next("small")
        client.responses.create(model="tiny", input="s")
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(big)
        assert store.bytes <= 2000
        idle(srv)
    finally:
        srv.stop()
