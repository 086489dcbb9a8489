"""Other engines' agent-hint spellings (Continuum's `job_id` / `is_last_step`,
vLLM's agent-hint RFC `agent_hint`, SGLang's `agent_hints`), mapped to program
id, end and TTL: on their own (resolve_identity) and end to end (pins)."""

from __future__ import annotations

import time

import httpx
import pytest

from agentserve.server.identity import IdentityError, resolve_identity
from agentserve.server.protocol import ChatCompletionRequest, CompletionRequest
from server_fixtures import start_tiny_server

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
NO_HEADERS = httpx.Headers({})


def ident(headers: dict | None = None, scope: str | None = None, **body):
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
    return resolve_identity(req, httpx.Headers(headers or {}), scope)


def test_each_spelling_maps_to_program_id_end_and_ttl():
    c = ident(job_id="job-7", is_last_step=True)
    assert (c.program_id, c.source, c.end_program, c.is_last_turn) == ("job-7", "job_id", True, True)
    assert ident(job_id="job-7", is_last_step=False).end_program is False
    v = ident(agent_hint={"session_id": "worker-7", "parent_session_id": "orch-1",
                          "cache_control": {"type": "ephemeral", "ttl": 300}})
    assert (v.program_id, v.source, v.ttl) == ("worker-7", "agent_hint.session_id", 300.0)
    s = ident(agent_hints={"workflow_id": "wf", "agent_id": "planner", "step_id": "3", "cache_ttl_ms": 2500,
                           "reuse_hint": "high"})
    assert (s.program_id, s.source, s.ttl) == ("wf/planner", "agent_hints", 2.5)
    assert ident(agent_hints={"agent_id": "solo"}).program_id == "solo"
    assert ident(agent_hints={"workflow_id": "wf", "agent_id": " "}).program_id == "wf"
    # the same fields on /v1/completions
    req = CompletionRequest.model_validate({"prompt": "x", "job_id": "j", "is_last_step": True})
    assert resolve_identity(req, NO_HEADERS).program_id == "j" and resolve_identity(req, NO_HEADERS).end_program


def test_ours_win_and_user_comes_last():
    both = dict(job_id="job", agent_hint={"session_id": "vs", "cache_control": {"ttl": 9}},
                agent_hints={"workflow_id": "wf", "cache_ttl_ms": 1000}, user="u")
    assert ident(program_id="mine", **both).program_id == "mine"
    assert ident({"X-Session-Id": "hdr"}, **both).program_id == "hdr"
    assert ident(**both).program_id == "job"
    assert ident(**{**both, "job_id": None}).program_id == "vs"
    assert ident(**{**both, "job_id": None, "agent_hint": None}).program_id == "wf"
    assert ident(user="u", agent_hints={"workflow_id": "wf"}).program_id == "wf"
    # TTL: body ttl, then the header, then vLLM's, then SGLang's
    assert ident(ttl=5, **both).ttl == 5
    assert ident({"X-Program-TTL": "6"}, **both).ttl == 6
    assert ident(**both).ttl == 9
    assert ident(**{**both, "agent_hint": None}).ttl == 1.0


def test_bad_hint_values_are_400s_naming_the_field():
    for body, param in (({"agent_hints": {"agent_id": "a", "cache_ttl_ms": -1}}, "agent_hints.cache_ttl_ms"),
                        ({"agent_hint": {"session_id": "s", "cache_control": {"ttl": float("inf")}}},
                         "agent_hint.cache_control.ttl"),
                        ({"job_id": "j" * 300}, "job_id")):
        with pytest.raises(IdentityError) as e:
            ident(**body)
        assert e.value.param == param, body


def test_hints_without_a_program_are_ignored():
    # the request is its own program, ended with it: nothing to keep or release (and no 400 the
    # OpenAPI document could not state: the id and the hint may come from the body or the headers)
    anon = ident({"X-Program-TTL": "60", "X-Program-Release": "true"}, agent_hint={"cache_control": {"ttl": 3}})
    assert (anon.program_id, anon.ttl, anon.release_after, anon.is_last_turn) == (None, None, False, True)
    with pytest.raises(IdentityError):  # a bad value is still refused
        ident(agent_hints={"cache_ttl_ms": -1})


def test_a_malformed_hint_header_is_refused_even_where_the_body_decides():
    # the document gives each header its format; a value outside it is a 400 whatever else the request says
    for headers, body in (({"X-Program-TTL": "abc"}, {"program_id": "p", "ttl": 5}),
                          ({"X-Program-TTL": "1e3"}, {}),
                          ({"X-Program-Release": "maybe"}, {"program_id": "p", "release_program": True}),
                          ({"X-Program-End": "2"}, {"end_program": True})):
        with pytest.raises(IdentityError) as e:
            ident(headers, **body)
        assert e.value.param == next(iter(headers)), headers


def test_composite_ids_are_bounded_part_by_part():
    long = "w" * 256
    assert ident(agent_hints={"workflow_id": long, "agent_id": long}).program_id == f"{long}/{long}"
    with pytest.raises(IdentityError) as e:
        ident(agent_hints={"workflow_id": "w", "agent_id": long + "x"})
    assert e.value.param == "agent_hints.agent_id"
    claude = {"x-claude-code-session-id": long, "x-claude-code-agent-id": long}
    assert ident(claude).program_id == f"{long}/{long}"


def test_tenant_scope_prefixes_every_spelling():
    assert ident(scope="t-a", job_id="j").program_id == "t-a/j"
    assert ident(scope="t-a", agent_hints={"workflow_id": "w", "agent_id": "a"}).program_id == "t-a/w/a"
    anon = ident(scope="t-a")
    assert anon.program_id is None and anon.cache_salt == ("t-a", None)
    assert ident(cache_salt="s").cache_salt == (None, "s") and ident().cache_salt is None


@pytest.fixture(scope="module")
def server():
    srv, llm, scripted = start_tiny_server(api_key=None)
    srv.llm, srv.scripted, srv.engine = llm, scripted, srv.app.state.server.engine
    yield srv
    srv.stop()


def _turn(server, content: str, **body) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "max_tokens": 80, "temperature": 0, "tools": WEATHER,
        "messages": [{"role": "user", "content": content}], **body})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10
    while server.engine.call_sync(lambda: server.llm.engine.has_unfinished):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return r.json()


def _pin_ttl(server, pid: str) -> float | None:
    def get():
        p = server.llm.kv.pins.get(pid)
        return None if p is None else p.expiry - server.llm.engine.clock.now()
    return server.engine.call_sync(get)


@pytest.mark.parametrize("pid,first,last", [
    ("job-42", {"job_id": "job-42"}, {"job_id": "job-42", "is_last_step": True}),
    ("worker-7", {"agent_hint": {"session_id": "worker-7", "cache_control": {"type": "ephemeral", "ttl": 45}}},
     {"agent_hint": {"session_id": "worker-7"}, "end_program": True}),
    ("wf/coder", {"agent_hints": {"workflow_id": "wf", "agent_id": "coder", "cache_ttl_ms": 45000}},
     {"agent_hints": {"workflow_id": "wf", "agent_id": "coder"}, "end_program": True}),
])
def test_hinted_programs_pin_and_end(server, pid, first, last):
    server.scripted.script(pid, CALL_TEXT)
    body = first if "ttl" in str(first) else {**first, "ttl": 45}
    r = _turn(server, f"First turn of {pid}.", **body)
    assert r["choices"][0]["finish_reason"] == "tool_calls"
    ttl = _pin_ttl(server, pid)
    assert ttl is not None and 30 < ttl <= 45, "pinned under the hinted id, for the hinted TTL"
    _turn(server, f"First turn of {pid}. And the last.", **last)
    assert _pin_ttl(server, pid) is None, "the program ended"
    server.engine.call_sync(server.llm.check_integrity)


def test_the_agent_protocols_name_the_program_in_the_documented_order():
    cc = {"x-claude-code-session-id": "cc-1"}
    codex = {"session-id": "cx-1", "conversation_id": "conv-1"}
    full = dict(prompt_cache_key="pck", metadata={"user_id": "meta"}, session_id="vs", user="u")
    # ours first, then the chain, then the protocols' own, then today's other spellings
    assert ident({"X-Program-Id": "mine", **cc}, **full).program_id == "mine"
    chained = resolve_identity(_chat(**full), httpx.Headers(cc), chain="resp_1")
    assert (chained.program_id, chained.source) == ("resp_1", "previous_response_id")
    assert ident(cc, **full).source == "prompt_cache_key"
    assert ident({**cc, **codex}, **{**full, "prompt_cache_key": None}).program_id == "cc-1"
    sub = ident({**cc, "x-claude-code-agent-id": "agent_001"})
    assert sub.program_id == "cc-1/agent_001", "a subagent is its own program beside its parent's"
    assert ident(codex, metadata={"user_id": "meta"}).program_id == "cx-1"
    assert ident({"session_id": "cx-2"}).program_id == "cx-2"
    assert ident({"conversation_id": "conv-1"}, metadata={"user_id": "meta"}).program_id == "conv-1"
    assert ident(metadata={"user_id": "meta"}, session_id="vs", user="u").source == "metadata.user_id"
    assert ident(metadata={"other": "x"}, session_id="vs").program_id == "vs"
    # tenant-scoped like every other source
    assert resolve_identity(_chat(), httpx.Headers(cc), "team-a").program_id == "team-a/cc-1"


def test_cache_control_ttl_is_a_hint_only_for_a_named_program():
    named = resolve_identity(_chat(), httpx.Headers({"x-claude-code-session-id": "s"}), cache_ttl=3600.0)
    assert (named.ttl, named.program_id) == (3600.0, "s")
    # clients send cache_control on every request: without a program it is no error, and no hint
    anon = resolve_identity(_chat(), NO_HEADERS, cache_ttl=300.0)
    assert anon.program_id is None and anon.ttl is None
    # an explicit TTL wins over the block hint
    assert resolve_identity(_chat(ttl=5), httpx.Headers({"X-Program-Id": "p"}), cache_ttl=300.0).ttl == 5


def _chat(**body):
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
