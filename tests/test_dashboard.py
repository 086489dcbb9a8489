"""The dashboard's data: the program timeline the engine feeds (bounded), the
JSON of /dashboard/state on a live tiny server (programs, turns, tool gaps,
pins with their TTL, KV by state, TTL decisions with inputs), the API key in
front of it, and the per-tenant filter. The page itself is tested in a real
browser in test_dashboard_browser.py."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from agentserve.engine.llm_engine import RequestOutput
from agentserve.server.dashboard_view import DashboardSource, build_state
from agentserve.server.engine_listeners import Listeners
from agentserve.server.program_timeline import ProgramTimeline
from server_fixtures import start_tiny_server

KEY = "dash-key"
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _out(rid: str, pid: str, *, finished: bool = False, arrival: float = 0.0, tokens: int = 1,
         finish_time: float | None = None, reason: str | None = None) -> RequestOutput:
    return RequestOutput(rid, pid, [1], "x", [1] * tokens, "x" * tokens, finished, reason if finished else None,
                         None, 10, 4, arrival, arrival + 0.2, finish_time, 0.1)


def _live(rid: str, pid: str, status: str, arrival: float = 0.0, anonymous: bool = False, blocks=()):
    table = SimpleNamespace(blocks=[SimpleNamespace(block_id=b) for b in blocks], released=False) if blocks else None
    return SimpleNamespace(request_id=rid, program_id=pid, anonymous=anonymous, arrival_time=arrival,
                           num_prompt_tokens=10, first_scheduled_time=None if status == "waiting" else arrival + 0.1,
                           status=SimpleNamespace(value=status), block_table=table)


# --- the timeline, alone ---------------------------------------------------------------

def test_timeline_records_turns_and_stays_bounded():
    tl = ProgramTimeline(max_programs=3, max_turns=2, max_one_shot=2)
    tl.on_request_output(_out("r1", "p1", arrival=1.0), 1.3, None)
    tl.on_request_output(_out("r1", "p1", finished=True, arrival=1.0, tokens=5, finish_time=2.0, reason="stop"),
                         2.0, 1.3)
    (p1,) = tl.programs()
    (t,) = p1.turns
    assert (t.arrival, t.admitted, t.first_token, t.end, t.outcome, t.output_tokens) == \
        (1.0, 1.1, 1.2, 2.0, "stop", 5)
    assert (t.prompt_tokens, t.cached_tokens) == (10, 4) and not t.open
    # more turns than kept: the oldest go; more programs than kept: the least recently active go
    for i in range(2, 5):
        tl.on_request_output(_out(f"r{i}", "p1", finished=True, arrival=float(i), finish_time=i + 0.5), i + 0.5, None)
    assert [t.request_id for t in tl.programs()[0].turns] == ["r3", "r4"]
    for pid in ("p2", "p3", "p4"):
        tl.on_request_output(_out("r-" + pid, pid, arrival=9.0), 9.0, None)
    assert [p.program_id for p in tl.programs()] == ["p4", "p3", "p2"] and len(tl) == 3
    # a request without a program (the engine names its program after it) goes to the one-shot ring
    for i in range(5):
        tl.on_request_output(_out(f"anon{i}", f"anon{i}"), 10.0, None)
    assert [t.request_id for t in tl.one_shot] == ["anon3", "anon4"] and len(tl) == 3
    # only the turns still open are indexed: what the rings dropped is not kept elsewhere
    assert set(tl._open) == {"r-p2", "r-p3", "r-p4", "anon3", "anon4"}


def test_observe_adds_waiting_requests_and_ends_vanished_ones():
    tl = ProgramTimeline()
    tl.on_request_output(_out("r1", "p1", arrival=1.0), 1.2, None)
    tl.observe([_live("r1", "p1", "running", 1.0), _live("r2", "p2", "waiting", 1.5),
                _live("r3", "r3", "waiting", 1.6, anonymous=True)], 2.0)
    progs = {p.program_id: p for p in tl.programs()}
    assert progs["p2"].turns[0].outcome == "waiting" and progs["p2"].turns[0].admitted is None
    assert tl.one_shot[0].request_id == "r3"
    # r1 went away without its last output (the client left): an abort, ended when noticed
    tl.observe([_live("r2", "p2", "running", 1.5), _live("r3", "r3", "running", 1.6, anonymous=True)], 3.0)
    t1 = progs["p1"].turns[0]
    assert (t1.outcome, t1.end) == ("abort", 3.0)
    assert (progs["p2"].turns[0].outcome, progs["p2"].turns[0].admitted) == ("running", 1.6)


def test_listeners_hear_all_even_when_one_fails():
    heard = []

    class Bad:
        def on_program_end(self, jct):
            raise RuntimeError("boom")

    class Good:
        def on_program_end(self, jct):
            heard.append(jct)

    Listeners(Bad(), Good()).on_program_end(1.5)
    assert heard == [1.5]


# --- the per-tenant filter ---------------------------------------------------------------

class _Pin:
    def __init__(self, blocks, expiry):
        self.blocks = [SimpleNamespace(block_id=b) for b in blocks]
        self.expiry = expiry
        self.num_tokens = 4 * len(blocks)


def _scheduler():
    """A scheduler's readable surface with two tenants' programs: 'a/...' and 'b/...'."""
    from agentserve.policy.decision_log import Decision, DecisionLog

    decisions = DecisionLog()
    decisions.add(Decision(9.0, "ra", "a/1", "search", "pin", 30.0, 2.0, 3))
    decisions.add(Decision(9.5, "rb", "b/1", "secret_tool", "pin", 20.0, 1.0, 5))
    running = [_live("ra2", "a/1", "running", 9.8, blocks=[6, 7]),
               _live("rb2", "b/2", "running", 9.9, blocks=[8, 9])]
    kv = SimpleNamespace(pins={"a/1": _Pin([1, 2], 40.0), "b/1": _Pin([3, 4, 5], 30.0)}, num_blocks=20,
                         block_size=4, num_free_blocks=10, num_pinned_blocks=5,
                         pool=SimpleNamespace(num_cached_free=6), host=SimpleNamespace(enabled=False))
    return SimpleNamespace(waiting=[], running=running, kv=kv, programs={"a/1", "b/1", "b/2"},
                           policy=SimpleNamespace(name="continuum", decisions=decisions),
                           stats=SimpleNamespace(pins_created=2, pins_hit=0, pins_expired=0, pins_reclaimed=0))


def test_a_tenant_sees_only_its_own_programs_pins_decisions_and_blocks():
    sched = _scheduler()
    source = DashboardSource()
    source.timeline.on_request_output(_out("ra", "a/1", finished=True, arrival=5.0, finish_time=9.0, reason="stop"),
                                      9.0, None)
    source.timeline.on_request_output(_out("rb", "b/1", finished=True, arrival=5.0, finish_time=9.5, reason="stop"),
                                      9.5, None)
    source.timeline.on_request_output(_out("anon", "anon"), 9.6, None)  # no program id: nobody's
    a = build_state(sched, source, 10.0, "a", "a")
    assert (a["tenant"], a["scoped"]) == ("a", True)
    assert [p["id"] for p in a["programs"]] == ["1"]  # the id its client sent, without the tenant
    assert [p["program_id"] for p in a["pins"]] == ["1"] and a["pins"][0]["ttl_left"] == 30.0
    assert [d["program_id"] for d in a["decisions"]] == ["1"]
    assert a["kv"]["states"] == {"running": 2, "pinned": 2, "other": 16}
    assert a["requests"] == {"running": 1, "waiting": 0} and "counters" not in a and a["one_shot"] == []
    assert "secret_tool" not in json.dumps(a) and "b/" not in json.dumps(a)
    # the turn of a/1 carries its decision: the tool that followed and the TTL kept for it
    (turn,) = [t for t in a["programs"][0]["turns"] if t["id"] == "ra"]
    assert (turn["tool"], turn["action"], turn["ttl"], turn["end"]) == ("search", "pin", 30.0, -1.0)
    # unscoped (one tenant or none): everything, and the whole pool by state
    everyone = build_state(sched, source, 10.0, None, "a")
    assert {p["id"] for p in everyone["programs"]} == {"a/1", "b/1", "b/2"} and not everyone["scoped"]
    assert [t["id"] for t in everyone["one_shot"]] == ["anon"]
    assert everyone["kv"]["states"] == {"running": 5, "pinned": 5, "cached": 6, "free": 4}
    assert everyone["counters"]["decisions"] == 2


# --- on a live server ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    srv, llm, scripted = start_tiny_server(api_key=KEY)
    srv.llm, srv.scripted, srv.engine = llm, scripted, srv.app.state.server.engine
    yield srv
    srv.stop()


def _state(server, key: str | None = KEY) -> httpx.Response:
    return httpx.get(server.url + "/dashboard/state", headers={"Authorization": f"Bearer {key}"} if key else {})


def test_the_page_is_served_and_the_state_needs_the_key(server):
    page = httpx.get(server.url + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/state" in page.text and "<script>" in page.text
    assert "http://" not in page.text.replace('"http://www.w3.org/2000/svg"', "") and "https://" not in page.text
    assert _state(server, None).status_code == 401
    assert _state(server, "wrong").status_code == 401
    r = _state(server)
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    assert r.json()["tenant"] == "api-key-1" and not r.json()["scoped"]  # one tenant: nobody to hide from


def test_a_program_shows_its_turns_tool_gap_pin_and_decision(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    pid = "dash-agent"
    server.scripted.script(pid, CALL_TEXT)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r1 = client.chat.completions.create(model="tiny", messages=msgs, tools=WEATHER, extra_body={"ttl": 45},
                                        extra_headers={"X-Program-Id": pid})
    assert r1.choices[0].finish_reason == "tool_calls"
    time.sleep(0.3)  # the tool runs
    state = _state(server).json()
    (prog,) = [p for p in state["programs"] if p["id"] == pid]
    assert prog["state"] == "pinned" and 40 < prog["pin"]["ttl_left"] <= 45
    (turn,) = prog["turns"]
    assert turn["outcome"] == "stop" and turn["tool"] == "get_weather" and turn["action"] == "pin"
    assert turn["ttl"] == 45 and turn["arrival"] <= turn["admitted"] <= turn["first_token"] <= turn["end"] < -0.2
    assert turn["output_tokens"] == len(CALL_TEXT) + 1 and turn["prompt_tokens"] > 0
    (pin,) = [p for p in state["pins"] if p["program_id"] == pid]
    assert pin["blocks"] > 0 and pin["tokens"] > 0
    d = state["decisions"][0]
    assert (d["program_id"], d["tool"], d["action"], d["ttl"], d["regime"]) == (pid, "get_weather", "pin", 45, "hint")
    kv = state["kv"]
    assert sum(kv["states"].values()) == kv["num_blocks"] and kv["states"]["pinned"] >= pin["blocks"]
    # turn 2 after the tool: the gap is between the two turns; then the program ends
    server.scripted.script(pid, "Sunny.")
    msgs += [r1.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": r1.choices[0].message.tool_calls[0].id, "content": "sunny"}]
    client.chat.completions.create(model="tiny", messages=msgs, tools=WEATHER,
                                   extra_headers={"X-Program-Id": pid, "X-Program-End": "true"})
    state = _state(server).json()
    (prog,) = [p for p in state["programs"] if p["id"] == pid]
    t1, t2 = prog["turns"]
    assert prog["state"] == "ended" and prog["pin"] is None and t2["arrival"] - t1["end"] >= 0.3
    assert t2["cached_tokens"] > 0 and "tool" not in t2  # the last turn: no retention decision
    assert pid not in [p["program_id"] for p in state["pins"]]


def test_an_abandoned_stream_shows_as_aborted(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    pid = "dash-leaver"
    with client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a long story"}],
                                        stream=True, max_tokens=900, extra_body={"ignore_eos": True},
                                        extra_headers={"X-Program-Id": pid}) as stream:
        for i, _ in enumerate(stream):
            if i == 3:
                break
    deadline = time.monotonic() + 10
    while True:
        (prog,) = [p for p in _state(server).json()["programs"] if p["id"] == pid]
        if prog["turns"][0]["outcome"] == "abort" or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert prog["turns"][0]["outcome"] == "abort" and prog["turns"][0]["end"] is not None


def test_with_two_tenants_a_caller_sees_its_own_running_blocks_and_programs_only():
    srv, llm, _ = start_tiny_server(api_key="key-a", config={"api_keys": {"key-b": "team-b"}})
    try:
        def long_answer(key: str, pid: str) -> None:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)
            c.completions.create(model="tiny", prompt="a long story " * 20, max_tokens=400,
                                 extra_body={"ignore_eos": True}, extra_headers={"X-Program-Id": pid})

        import threading
        threads = [threading.Thread(target=long_answer, args=a) for a in (("key-a", "a-long"), ("key-b", "b-long"))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while True:
            a = _state(srv, "key-a").json()
            if (a["kv"]["states"]["running"] > 0 and a["requests"]["running"] == 1) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        for t in threads:
            t.join(60)
        assert (a["tenant"], a["scoped"]) == ("api-key-1", True)
        assert a["requests"]["running"] == 1 and a["kv"]["states"]["running"] > 0
        assert set(a["kv"]["states"]) == {"running", "pinned", "other"} and "counters" not in a
        assert [p["id"] for p in a["programs"]] == ["a-long"] and "b-long" not in json.dumps(a)
        b = _state(srv, "key-b").json()
        assert b["tenant"] == "team-b" and [p["id"] for p in b["programs"]] == ["b-long"]
    finally:
        srv.stop()
