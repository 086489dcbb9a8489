"""The replay client (`bench/replay*.py`): text calibration, plans, metrics, and
a live replay against the tiny server of server_fixtures.py."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from agentserve.bench import replay_apis as rapi
from agentserve.bench import replay_client as rcl
from agentserve.bench import replay_plan as rpl
from agentserve.bench import replay_report as rr
from agentserve.bench import replay_results as rres
from agentserve.bench import replay_stream as rs
from agentserve.bench import replay_text as rt
from agentserve.cli import main as cli_main
from agentserve.workload.generators import generate_swebench
from agentserve.workload.trace import Program, TraceCall
from agentserve.workload.trace_jsonl import save_jsonl

KEY = "replay-key"
API_KEYS = {f"key-{api}": f"t-{api}" for api in rapi.API_NAMES}  # a tenant per API: each run starts cold
SLEEP = 0.05


def program(pid: str, arrival: float, turns: int, shared: int = 60, task: int = 60, out: int = 6,
            obs: int = 40, sleep: float = SLEEP) -> Program:
    """A pure-append program: call 0 = shared + task, each later call adds out + obs."""
    calls, prompt = [], shared + task
    for k in range(turns):
        last = k == turns - 1
        calls.append(TraceCall(pid, k, arrival + k * sleep, prompt, prompt if k == 0 else obs, out,
                               None if last else "bash", 0.0 if last else sleep, shared_prefix_tokens=shared))
        prompt += out + obs
    return Program(pid, calls)


# ---------------------------------------------------------------------------
# calibration


def test_filler_text_is_deterministic_and_sized():
    a = rt.filler_text(40, "s")
    assert a == rt.filler_text(40, "s") != rt.filler_text(40, "t")
    assert len(a.split()) == 40 and a.count("\n") == 2
    assert rt.filler_text(0, "s").split() and len(rt.filler_text(0, "s").split()) == 1
    tm = rt.TextModel(tokens_per_word=2.0, message_overhead=4.0)
    assert tm.words_for(24) == 10 and tm.words_for(1) == 1
    assert len(tm.text(24, "x").split()) == 10


def test_calibration_recovers_a_linear_tokenizer():
    # a fake server: 1.5 tokens per word, 7 template tokens per message, 3 for the generation prompt
    def count(messages):
        words = sum(len(m["content"].split()) for m in messages)
        return round(1.5 * words) + 7 * len(messages) + 3

    async def count_prompt(messages):
        return count(messages)

    tm = asyncio.run(rt.calibrate(count_prompt))
    assert tm.tokens_per_word == pytest.approx(1.5, abs=0.02)
    assert tm.message_overhead == pytest.approx(7.0, abs=0.5)
    # a small context shrinks the probes
    assert rt.probe_words(1024) < rt.probe_words(None)
    seen = []

    async def recording(messages):
        seen.append(count(messages))
        return seen[-1]

    asyncio.run(rt.calibrate(recording, max_context=256))
    assert max(seen) < 256


def test_calibration_rejects_a_flat_count():
    with pytest.raises(rs.ReplayError, match="tokens-per-word"):
        rt.fit_text_model({"base": 10, "longer": 10, "more": 20}, 112)


# ---------------------------------------------------------------------------
# plans


def test_plan_keeps_turns_prefix_and_tool_time():
    tm = rt.TextModel(1.3, 5.0)
    progs = generate_swebench(4, 1.0, seed=3)
    plans = rpl.plan_workload(progs, tm, token_scale=0.02, time_scale=0.5, seed=1)
    assert plans[0].arrival == 0.0
    systems = set()
    for p, pl in zip(progs, plans):
        assert len(pl.turns) == p.num_turns
        first = pl.turns[0]
        assert first.reset and [m["role"] for m in first.append] == ["system", "user"]
        systems.add(first.append[0]["content"])
        for c, tp in zip(p.calls, pl.turns):
            assert tp.sleep_s == pytest.approx(c.tool_duration * 0.5)
            assert tp.max_tokens == max(1, round(c.output_tokens * 0.02))
            if tp.turn:
                assert not tp.reset and [m["role"] for m in tp.append] == ["user"]
                assert tp.planned_prompt_tokens > pl.turns[tp.turn - 1].planned_prompt_tokens
        # planned prompts follow the scaled trace (the template adds a few tokens a message)
        assert pl.turns[-1].planned_prompt_tokens == pytest.approx(p.calls[-1].prompt_tokens * 0.02, rel=0.5)
    assert len(systems) == 1  # the shared system prompt
    again = rpl.plan_workload(progs, tm, token_scale=0.02, seed=1)
    other = rpl.plan_workload(progs, tm, token_scale=0.02, seed="x")
    assert again[0].turns[1].append == plans[0].turns[1].append != other[0].turns[1].append


def test_plan_clamps_to_max_context():
    tm = rt.TextModel(1.0, 4.0)
    p = program("big", 0.0, turns=6, shared=50, task=400, out=100, obs=300)
    free = rpl.plan_program(p, tm)
    assert free.clamp == 1.0
    pl = rpl.plan_program(p, tm, max_context=800)
    assert pl.clamp < 1.0 and len(pl.turns) == 6
    assert all(t.planned_prompt_tokens + t.max_tokens <= 800 - 24 for t in pl.turns)
    assert pl.turns[0].append[0] == free.turns[0].append[0]  # the shared prefix is not shrunk
    with pytest.raises(rs.ReplayError, match="max-context"):
        rpl.plan_program(p, tm, max_context=40)


def test_plan_compacts_at_real_lengths_and_keeps_every_turn():
    tm = rt.TextModel(1.0, 4.0)
    # turn prompts ~460, 860, 1260, 1665, ...: at a 2000-token context (1940 with the margin) turn 4 cannot fit
    p = program("long", 0.0, turns=12, shared=50, task=400, out=100, obs=300)
    free = rpl.plan_program(p, tm)
    pl = rpl.plan_program(p, tm, max_context=2000, clamp="compact")
    assert len(pl.turns) == 12 and pl.clamp == 1.0 and pl.first_cut == 1.0 and pl.compactions >= 2
    assert all(t.planned_prompt_tokens + t.max_tokens <= 2000 - 60 for t in pl.turns)
    for a, b in zip(pl.turns[:4], free.turns):  # until the context fills, the real turns
        assert (a.planned_prompt_tokens, a.max_tokens, a.reset) == (b.planned_prompt_tokens, b.max_tokens, b.reset)
    # turn 4 starts a new conversation: the shared system prompt and a summary of an eighth of the room
    t4 = pl.turns[4]
    assert t4.reset and t4.append[0] == pl.turns[0].append[0] and t4.append[1]["content"] != free.turns[4].append[0]
    assert t4.planned_prompt_tokens == pytest.approx(50 + (2000 - 60) // 8 + 3, abs=12)
    assert not pl.turns[5].reset and pl.turns[5].planned_prompt_tokens > t4.planned_prompt_tokens
    assert [t.sleep_s for t in pl.turns] == [t.sleep_s for t in free.turns]  # tool times kept
    # the summary line counts the compactions; a program that fits is left as it is
    short = program("short", 1.0, turns=2)
    plans = rpl.plan_workload([p, short], tm, max_context=2000, clamp="compact")
    c = rpl.clamp_summary([p, short], plans, 2000, "compact", None)
    assert (c["compacted_programs"], c["compactions"], c["turns_sent"]) == (1, pl.compactions, 14)
    assert rpl.format_clamp(c).startswith(
        f"clamped to a 2000-token context (compact): 1 of 2 programs compacted ({pl.compactions} turns sent")
    # a first prompt longer than the context (the tool definitions and system prompt) is cut to half of it
    huge = program("huge", 0.0, turns=4, shared=0, task=5000, out=50, obs=100)
    pl = rpl.plan_program(huge, tm, max_context=2000, clamp="compact")
    first = pl.turns[0]
    assert pl.first_cut < 1.0 and first.planned_prompt_tokens + first.max_tokens <= (2000 - 60) // 2 + 1
    assert len(pl.turns) == 4 and pl.compactions == 0  # the later turns, at their real lengths, still fit
    assert pl.turns[1].planned_prompt_tokens - first.planned_prompt_tokens - first.max_tokens == pytest.approx(104, abs=1)
    with pytest.raises(rs.ReplayError, match="max-context"):
        rpl.plan_program(program("s", 0.0, 2, shared=1950, task=10), tm, max_context=2000, clamp="compact")


def test_plan_gives_a_program_its_own_system_prompt():
    """Program.prefix_tokens (the Claude Code traces' tool definitions and system prompt) opens
    the first prompt as a system message of the program's own text, and a compaction keeps it."""
    tm = rt.TextModel(1.0, 4.0)
    a, b = (Program(x, program(x, 0.0, 12, shared=0, task=900, out=100, obs=300).calls, prefix_tokens=500)
            for x in ("a", "b"))
    pa, pb = (rpl.plan_program(x, tm, max_context=2000, clamp="compact") for x in (a, b))
    sys_a = pa.turns[0].append[0]
    assert sys_a["role"] == "system" and sys_a != pb.turns[0].append[0]  # not shared between programs
    assert pa.turns[0].append[1]["role"] == "user"
    assert pa.turns[0].planned_prompt_tokens == 900 + 3  # the trace's first prompt, now in two messages
    compacted = [t for t in pa.turns[1:] if t.reset]
    assert compacted and all(t.append[0] == sys_a for t in compacted)


def test_plan_bounds_outputs_and_says_what_it_clamped():
    tm = rt.TextModel(1.0, 4.0)
    parent = program("p", 0.0, turns=8, shared=50, task=400, out=100, obs=300)
    sub = Program("p:a1", program("p:a1", 0.1, 2).calls, parent_id="p", parent_turn=1)
    progs = [parent, sub]
    plans = rpl.plan_workload(progs, tm, max_context=2000, clamp="compact", max_output_tokens=64)
    assert [pl.program_id for pl in plans] == ["p", "p:a1"] and plans[1].parent_turn == 1
    assert all(t.max_tokens <= 64 for pl in plans for t in pl.turns)
    c = rpl.clamp_summary(progs, plans, 2000, "compact", 64)
    assert c["capped_outputs"] == 8 and c["turns"] == 10 and c["turns_sent"] == 10
    assert "outputs bounded at 64 tokens (8 turns)" in rpl.format_clamp(c)
    scaled = rpl.plan_workload(progs, tm, max_context=2000, clamp="scale")
    line = rpl.format_clamp(rpl.clamp_summary(progs, scaled, 2000, "scale", None))
    assert len(scaled) == 2 and "1 of 2 programs scaled down to fit" in line and "outputs unbounded" in line
    assert rpl.resolve_clamp("auto", "claude-code") == "compact" and rpl.resolve_clamp("auto", "swebench") == "scale"
    assert rpl.resolve_clamp("scale", "claude-code") == "scale"
    with pytest.raises(ValueError):
        rpl.resolve_clamp("truncate", "swebench")
    with pytest.raises(ValueError, match="max_output_tokens"):
        rpl.plan_workload(progs, tm, max_output_tokens=0)

def test_claude_code_traces_at_real_length_fit_a_32k_context():
    """The shared Claude Code traces at --token-scale 1.0 against Gemma 3's 32k: every turn sent fits, at its
    real length, tool definitions and system prompt included."""
    from agentserve.workload.load import load_workload

    try:
        progs = load_workload("claude-code", 6, 0.1, 0)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tm = rt.TextModel(1.3, 5.0)
    plans = rpl.plan_workload(progs, tm, max_context=32768, clamp=rpl.resolve_clamp("auto", "claude-code"),
                              max_output_tokens=1024)
    assert plans and all(t.planned_prompt_tokens + t.max_tokens <= 32768 for pl in plans for t in pl.turns)
    by_id = {p.program_id: p for p in progs}
    for pl in plans:
        if pl.first_cut == 1.0:  # a first prompt that fits is sent whole
            assert pl.turns[0].planned_prompt_tokens >= by_id[pl.program_id].calls[0].prompt_tokens


def test_plan_compaction_restarts_the_conversation():
    tm = rt.TextModel(1.0, 4.0)
    calls = [TraceCall("c", 0, 0.0, 500, 500, 10, "tool", 0.1, shared_prefix_tokens=100),
             TraceCall("c", 1, 0.1, 200, 150, 10, None, 0.0, shared_prefix_tokens=100)]
    pl = rpl.plan_program(Program("c", calls), tm)
    assert pl.turns[1].reset and [m["role"] for m in pl.turns[1].append] == ["system", "user"]
    assert pl.turns[1].append[0] == pl.turns[0].append[0]


def test_plan_replays_real_text_and_tool_role():
    msgs = [{"role": "system", "content": "S" * 400}, {"role": "user", "content": "task " * 100},
            {"role": "assistant", "content": "a", "tool_calls": [{"id": "x", "function": {"name": "bash",
                                                                                         "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "x", "content": "R" * 800},
            {"role": "assistant", "content": "done"}]
    calls = [TraceCall("s", 0, 0.0, 225, 225, 1, "bash", 0.2, shared_prefix_tokens=100, message_index=2),
             TraceCall("s", 1, 0.2, 426, 200, 1, None, 0.0, shared_prefix_tokens=100, message_index=4)]
    p = Program("s", calls, messages=msgs)
    pl = rpl.plan_program(p, rt.TextModel(1.0, 4.0), token_scale=0.5, tool_role="tool")
    t0, t1 = pl.turns
    assert [m["role"] for m in t0.append] == ["system", "user"]
    assert t0.append[0]["content"] == "S" * 200 and t0.append[1]["content"] == ("task " * 100)[:250]
    assert t0.tool_call_ids == ["call_0_0"]
    assert t1.append == [{"role": "tool", "tool_call_id": "call_0_0", "content": "R" * 400}]
    user = rpl.plan_program(p, rt.TextModel(1.0, 4.0), token_scale=0.5)
    assert user.turns[1].append == [{"role": "user", "content": "R" * 400}] and not user.turns[0].tool_call_ids


# ---------------------------------------------------------------------------
# metrics


def _turn(pid, k, send, first, end, prompt=100, cached=0, err=None, sleep=0.0):
    return {"program_id": pid, "turn": k, "t_send": send, "t_first": first, "t_end": end,
            "ttft": None if err else first - send, "latency": end - send, "prompt_tokens": prompt,
            "cached_tokens": cached, "completion_tokens": 5, "planned_prompt_tokens": prompt, "max_tokens": 5,
            "sleep_s": sleep, "tool_name": None, "end_program": False, "error": err}


def test_summarize_metrics():
    turns = [_turn("a", 0, 0.0, 0.1, 0.5), _turn("a", 1, 1.0, 1.2, 1.5, prompt=200, cached=100),
             _turn("b", 0, 1.0, 1.3, 2.0), _turn("b", 1, 3.0, 3.4, 5.0, prompt=300, cached=200),
             _turn("c", 0, 2.0, 2.0, 2.5, err="timeout after 9 s")]
    res = [{"program_id": "a", "arrival": 0.0, "start": 0.0, "end": 1.5, "jct": 1.5, "completed": True},
           {"program_id": "b", "arrival": 1.0, "start": 1.0, "end": 5.0, "jct": 4.0, "completed": True},
           {"program_id": "c", "arrival": 2.0, "start": 2.0, "end": None, "jct": None, "completed": False}]
    s = rres.summarize(turns, res, {"server": "x", "workload": "w", "rate": 1.0})
    for k in rres.SUMMARY_KEYS:
        assert k in s
    assert (s["programs"], s["completed"], s["failed"], s["errors"]) == (3, 2, 1, 1)
    assert s["error_kinds"] == {"timeout after N s": 1}
    assert s["mean_jct"] == pytest.approx(2.75) and s["p50_jct"] == pytest.approx(2.75)
    assert s["p90_jct"] == pytest.approx(1.5 + 0.9 * 2.5)
    assert s["mean_ttft"] == pytest.approx((0.1 + 0.2 + 0.3 + 0.4) / 4)
    assert s["throughput_jobs_s"] == pytest.approx(2 / 5.0)
    assert s["cached_ratio"] == pytest.approx(300 / 700)
    empty = rres.summarize([], [], {})
    assert empty["programs"] == 0 and math.isnan(empty["mean_jct"]) and empty["throughput_jobs_s"] == 0.0


def test_time_split_per_program_and_turn():
    def t(pid, k, ttft, lat, out, err=None):
        return {"program_id": pid, "turn": k, "ttft": ttft, "latency": lat, "completion_tokens": out,
                "error": err}
    result = {"server": "x",
              "program_results": [{"program_id": "a", "jct": 10.0, "tool_time": 2.0, "error": None},
                                  {"program_id": "b", "jct": 6.0, "tool_time": 1.0, "error": None},
                                  {"program_id": "c", "jct": None, "tool_time": 0.0, "error": "boom"}],
              "turns": [t("a", 0, 1.0, 3.0, 11), t("a", 1, 0.5, 4.5, 21), t("b", 0, 2.0, 4.0, 11),
                        t("c", 0, 9.0, 9.0, 0, err="boom")]}
    (row,) = rr.time_rows([result])
    # a: first tokens 1.5, decode 6, tools 2, other 0.5; b: 2, 2, 1, 1 (c failed: left out)
    assert row == ["x", "8.0", "1.8", "4.0", "1.5", "0.8", "1.5", "1.167", "2.667", "14.3", "5.0"]
    assert "tok/s/stream" in rr.format_time_table([result])


def test_stream_accumulator():
    acc = rs.StreamAccumulator(1.0)
    acc.feed('data: {"choices":[{"delta":{"role":"assistant","content":""}}]}', 1.1)
    assert acc.t_first is None
    acc.feed(": keep-alive", 1.15)
    acc.feed('data: {"choices":[{"delta":{"content":"he"}}]}', 1.2)
    acc.feed('data: {"choices":[{"delta":{"content":"llo"},"finish_reason":"length"}]}', 1.3)
    acc.feed('data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,'
             '"prompt_tokens_details":{"cached_tokens":4}}}', 1.3)
    acc.feed("data: [DONE]", 1.4)
    assert (acc.t_first, acc.text, acc.finish_reason, acc.done) == (1.2, "hello", "length", True)
    assert (acc.prompt_tokens, acc.completion_tokens, acc.cached_tokens) == (9, 2, 4)
    with pytest.raises(rs.ReplayError, match="boom"):
        acc.feed('data: {"error":{"message":"boom"}}', 1.5)


# ---------------------------------------------------------------------------
# live


@pytest.fixture(scope="module")
def server():
    from server_fixtures import start_tiny_server

    srv, llm, _ = start_tiny_server(api_key=KEY, config={"api_keys": API_KEYS})
    srv.llm, srv.engine = llm, srv.app.state.server.engine
    yield srv
    srv.stop()


def test_calibration_against_the_server(server):
    import httpx

    async def go():
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}) as c:
            rep = rcl.Replayer(rcl.ReplayConfig(server.url), c, "tiny", 1024)
            return await rt.calibrate(rep.count_prompt, 1024)

    tm = asyncio.run(go())
    # the byte tokenizer: one token per byte of text
    w_b = rt.probe_words(1024)
    probes = rt.probe_messages(w_b)
    ya, yb = probes["base"][1]["content"], probes["longer"][1]["content"]
    assert tm.tokens_per_word == pytest.approx((len(yb) - len(ya)) / (w_b - rt.W_A))
    assert 5 <= tm.message_overhead <= 16  # ChatML: '<|im_start|>' role '\n' ... '<|im_end|>\n'


def test_replay_live(server):
    sub = program("p0:sub", 0.0, 2, shared=0)  # a subagent launched by p0's turn 1, no system prompt
    sub.parent_id, sub.parent_turn = "p0", 1
    progs = [program("p0", 0.0, 3), program("p1", 0.05, 4), program("p2", 0.1, 2), program("p3", 0.15, 3), sub]
    # A fixed text seed, so the run is the same every time: the random model's outputs, sent back
    # as assistant turns, depend on the text, and with a fresh seed about one run in six had a
    # prompt beyond the 25% tolerance below (83 tokens against 63 planned).
    cfg = rcl.ReplayConfig(server.url + "/v1", api_key=KEY, workload="unit", rate=10.0, progress=False,
                           request_timeout=30, text_seed="1")
    res = rcl.replay(progs, cfg)
    for k in rres.SUMMARY_KEYS:
        assert k in res
    assert res["model"] == "tiny" and res["config"]["max_context"] == 1024
    assert (res["programs"], res["completed"], res["errors"]) == (5, 5, 0)
    assert res["turns_ok"] == 14
    by = {}
    for t in res["turns"]:
        by.setdefault(t["program_id"], []).append(t)
    for pr in res["program_results"]:
        ts = by[pr["program_id"]]
        assert [t["turn"] for t in ts] == list(range(pr["turns"]))
        assert pr["completed"] and pr["turns_done"] == pr["turns"]
        for a, b in zip(ts, ts[1:]):  # turn k+1 is sent after turn k's response and its tool time
            assert b["t_send"] >= a["t_end"] + a["sleep_s"] - 2e-3
            assert b["cached_tokens"] > 0
            assert b["prompt_tokens"] > a["prompt_tokens"]
        assert pr["jct"] >= SLEEP * (pr["turns"] - 1) and pr["jct"] >= pr["tool_time"]
        assert pr["jct"] == pytest.approx(ts[-1]["t_end"] - ts[0]["t_send"])
        assert [t["end_program"] for t in ts] == [False] * (len(ts) - 1) + [True]
        for t in ts:
            assert t["completion_tokens"] == t["max_tokens"] == 6  # ignore_eos
            assert 0 <= t["ttft"] <= t["latency"]
            assert t["prompt_tokens"] == pytest.approx(t["planned_prompt_tokens"], rel=0.25)
    assert by["p0:sub"][0]["t_send"] >= by["p0"][1]["t_end"]  # the subagent waits for its launch
    # the shared system prompt hits across programs: p1's first turn reuses p0's
    first = {t["program_id"]: t for t in res["turns"] if t["turn"] == 0}
    assert max(first[p]["cached_tokens"] for p in ("p1", "p2", "p3")) > 0
    assert 0 < res["cached_ratio"] < 1
    assert res["mean_jct"] >= SLEEP and res["throughput_jobs_s"] > 0
    json.dumps(rres._jsonable(res), allow_nan=False)


def test_replay_counts_errors_instead_of_crashing(server):
    progs = [program("e0", 0.0, 2), program("e1", 0.0, 3)]
    cfg = rcl.ReplayConfig(server.url, model="tiny", api_key=KEY, tokens_per_word=6.0, request_timeout=1e-4,
                           progress=False)
    res = rcl.replay(progs, cfg)
    assert (res["completed"], res["failed"], res["errors"]) == (0, 2, 2)
    assert all(p["turns_done"] == 0 and "turn 0" in p["error"] for p in res["program_results"])
    # a server that is not there
    bad = rcl.ReplayConfig("http://127.0.0.1:9", model="m", tokens_per_word=1.0, progress=False)
    res = rcl.replay(progs, bad)
    assert res["failed"] == 2 and "ConnectError" in next(iter(res["error_kinds"]))
    # a wrong key: HTTP 401 per request
    res = rcl.replay(progs[:1], rcl.ReplayConfig(server.url, model="tiny", api_key="wrong", tokens_per_word=6.0,
                                                 progress=False))
    assert res["errors"] == 1 and "HTTP 401" in next(iter(res["error_kinds"]))


def test_cli_run_and_report(server, tmp_path, capsys):
    trace = tmp_path / "w.jsonl"
    save_jsonl([program("g0", 0.0, 2), program("g1", 0.0, 3)], trace)
    out = tmp_path / "run.json"
    md = tmp_path / "run.md"
    rc = cli_main(["bench", "run", "--url", server.url, "--api-key", KEY, "--workload", str(trace),
                   "--programs", "3", "--rate", "20", "--time-scale", "0.5", "--text-seed", "t1", "--json", str(out),
                   "--report", str(md), "--plot", str(tmp_path / "p"), "--label", "tiny-agentserve", "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "tiny-agentserve" in printed and "mean JCT" in printed and "cached %" in printed
    res = json.loads(out.read_text())
    for k in rres.SUMMARY_KEYS:
        assert k in res
    assert res["server"] == "tiny-agentserve" and res["programs"] == 3 and res["completed"] == 3
    assert res["config"]["text_seed"] == "t1"
    assert res["turns"] and res["program_results"]
    assert (tmp_path / "p_jct_cdf.png").stat().st_size > 0 and (tmp_path / "p_timeline.png").stat().st_size > 0
    text = md.read_text()
    assert "## Summary" in text and "p_jct_cdf.png" in text
    assert res["config"]["clamp"]["mode"] == "scale" and res["config"]["max_output_tokens"] is None
    assert "outputs unbounded (--max-output-tokens not set)" in text
    # comparing two results: both in the table and the CDF
    res2 = dict(res, server="other")
    other = tmp_path / "other.json"
    other.write_text(json.dumps(res2))
    assert cli_main(["bench", "report", str(out), str(other), "--plot", str(tmp_path / "cmp")]) == 0
    table = capsys.readouterr().out
    assert "tiny-agentserve" in table and "other" in table
    assert (tmp_path / "cmp_timeline_other.png").exists()
    assert rr.load_result(out)["server"] == "tiny-agentserve"


def test_replay_resends_a_turn_the_server_failed(server, monkeypatch):
    """--retry-failed-turns: a cut stream (error event) is sent again and its program completes; the
    failed attempt stays in the records; a client error (4xx) is never resent."""
    real = rcl.Replayer._stream
    cuts = {"left": 2}

    async def flaky(self, messages, pid, max_tokens, end, t_send):
        if pid == "r0" and any(m["role"] == "assistant" for m in messages) and cuts["left"]:
            cuts["left"] -= 1
            raise rs.ReplayError("error event: the engine replica serving this stream failed; retry the request")
        return await real(self, messages, pid, max_tokens, end, t_send)

    monkeypatch.setattr(rcl.Replayer, "_stream", flaky)
    progs = [program("r0", 0.0, 3), program("r1", 0.0, 2)]
    cfg = rcl.ReplayConfig(server.url, model="tiny", api_key=KEY, tokens_per_word=6.0, progress=False,
                           request_timeout=30, retry_failed_turns=2)
    res = rcl.replay(progs, cfg)
    assert (res["programs"], res["completed"]) == (2, 2)
    r0 = [t for t in res["turns"] if t["program_id"] == "r0"]
    assert [(t["turn"], t["error"] is None, t.get("attempt")) for t in r0] == \
        [(0, True, None), (1, False, None), (1, False, 1), (1, True, 2), (2, True, None)]
    assert r0[3]["t_send"] >= r0[2]["t_end"]
    # with fewer resends than cuts, the turn ends its program as before
    cuts["left"] = 2
    res = rcl.replay(progs, rcl.ReplayConfig(server.url, model="tiny", api_key=KEY, tokens_per_word=6.0,
                                             progress=False, request_timeout=30, retry_failed_turns=1))
    assert res["completed"] == 1 and "turn 1" in next(p for p in res["program_results"] if p["program_id"] == "r0")["error"]
    # a refused request (HTTP 401) is the client's fault: never resent
    res = rcl.replay(progs[:1], rcl.ReplayConfig(server.url, model="tiny", api_key="wrong", tokens_per_word=6.0,
                                                 progress=False, retry_failed_turns=3))
    assert res["errors"] == 1 and len(res["turns"]) == 1


def test_retryable_errors():
    assert rcl.retryable("error event: replica failed") and rcl.retryable("HTTP 503: busy")
    assert rcl.retryable("RemoteProtocolError: peer closed connection")
    assert not rcl.retryable("HTTP 400: bad request") and not rcl.retryable("timeout after 5 s")


# ---------------------------------------------------------------------------
# the APIs (--api)

CONVERSATION = [
    {"role": "system", "content": "sys"}, {"role": "user", "content": "task"},
    {"role": "assistant", "content": "looking", "tool_calls": [
        {"id": "call_0_0", "type": "function", "function": {"name": "bash", "arguments": "{}"}},
        {"id": "call_0_1", "type": "function", "function": {"name": "bash", "arguments": '{"a": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_0_0", "content": "out0"},
    {"role": "tool", "tool_call_id": "call_0_1", "content": "out1"},
    {"role": "assistant", "content": "done"}, {"role": "user", "content": "more"},
]


def test_each_api_carries_the_conversation_in_its_own_shape():
    chat = rapi.wire("chat").request("m", CONVERSATION, "p", 5, stream=True, ignore_eos=True, end=True)
    assert (chat.path, chat.headers) == ("/v1/chat/completions", {"X-Program-Id": "p", "X-Session-ID": "p"})
    assert chat.body["messages"] is CONVERSATION and chat.body["end_program"] and chat.body["vllm_xargs"] == {"end_program": True} and chat.body["ignore_eos"]

    r = rapi.wire("responses").request("m", CONVERSATION, "p", 5, stream=True, ignore_eos=True, end=False)
    assert r.path == "/v1/responses" and r.headers == {}
    b = r.body
    assert (b["instructions"], b["store"], b["prompt_cache_key"], b["max_output_tokens"]) == ("sys", False, "p", 5)
    assert "end_program" not in b and b["ignore_eos"] and b["temperature"] == 0
    assert [i["type"] for i in b["input"]] == ["message", "message", "function_call", "function_call",
                                                "function_call_output", "function_call_output", "message", "message"]
    assert b["input"][0] == {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "task"}]}
    assert b["input"][1]["content"] == [{"type": "output_text", "text": "looking"}]
    assert b["input"][3] == {"type": "function_call", "call_id": "call_0_1", "name": "bash", "arguments": '{"a": 1}'}
    assert b["input"][5] == {"type": "function_call_output", "call_id": "call_0_1", "output": "out1"}

    m = rapi.wire("messages", "k").request("m", CONVERSATION, "p", 5, stream=True, ignore_eos=False, end=True)
    assert m.path == "/v1/messages" and m.headers["x-claude-code-session-id"] == "p"
    assert m.headers["X-Program-End"] == "1" and m.headers["x-api-key"] == "k" and "anthropic-version" in m.headers
    assert (m.body["system"], m.body["max_tokens"]) == ("sys", 5) and "ignore_eos" not in m.body
    msgs = m.body["messages"]
    assert [x["role"] for x in msgs] == ["user", "assistant", "user", "assistant", "user"]
    assert msgs[1]["content"] == [{"type": "text", "text": "looking"},
                                  {"type": "tool_use", "id": "call_0_0", "name": "bash", "input": {}},
                                  {"type": "tool_use", "id": "call_0_1", "name": "bash", "input": {"a": 1}}]
    assert msgs[2]["content"] == [{"type": "tool_result", "tool_use_id": "call_0_0", "content": "out0"},
                                  {"type": "tool_result", "tool_use_id": "call_0_1", "content": "out1"}]
    with pytest.raises(ValueError, match="unknown API"):
        rapi.wire("grpc")


def test_the_chain_sends_only_what_the_server_does_not_hold():
    w = rapi.wire("responses-chain")
    conv = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    first = w.request("m", conv, "p", 5, stream=True, ignore_eos=True, end=False).body
    assert (first["store"], first["instructions"]) == (True, "sys") and "previous_response_id" not in first
    assert "prompt_cache_key" not in first and len(first["input"]) == 1  # the chain names the program
    acc = rapi.ResponsesAccumulator(0.0)
    acc.feed('data: {"type": "response.created", "response": {"id": "resp_1"}}', 0.1)
    w.answered("p", conv, acc)
    conv += [{"role": "assistant", "content": "reply"}, {"role": "user", "content": "tool out"}]
    second = w.request("m", conv, "p", 5, stream=True, ignore_eos=True, end=True).body
    assert second["previous_response_id"] == "resp_1" and second["instructions"] == "sys"
    assert second["input"] == [{"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                                  "text": "tool out"}]}]
    acc2 = rapi.ResponsesAccumulator(0.0)
    acc2.feed('data: {"type": "response.completed", "response": {"id": "resp_2", "status": "completed"}}', 0.1)
    w.answered("p", conv, acc2)
    assert w.program("p") == "resp_1" and w.chains["p"].response_id == "resp_2"
    # a restarted conversation (a compaction) starts a new chain
    fresh = [{"role": "system", "content": "sys"}, {"role": "user", "content": "summary"}]
    third = w.request("m", fresh, "p", 5, stream=True, ignore_eos=True, end=False).body
    assert "previous_response_id" not in third and len(third["input"]) == 1
    assert isinstance(w.probe(), rapi.ResponsesWire) and not isinstance(w.probe(), rapi.ResponsesChainWire)


def test_responses_stream_accumulator():
    acc = rapi.ResponsesAccumulator(1.0)
    for line in ['event: response.created', 'data: {"type":"response.created","response":{"id":"resp_9"}}', "",
                 'data: {"type":"response.output_item.added","item":{"type":"message"}}']:
        acc.feed(line, 1.1)
    assert acc.t_first is None and acc.response_id == "resp_9"
    acc.feed('data: {"type":"response.output_text.delta","delta":"he"}', 1.2)
    acc.feed('data: {"type":"response.output_text.delta","delta":"llo"}', 1.3)
    acc.feed('data: {"type":"response.function_call_arguments.delta","delta":"{}"}', 1.35)
    acc.feed('data: {"type":"response.incomplete","response":{"id":"resp_9","status":"incomplete",'
             '"incomplete_details":{"reason":"max_output_tokens"},"usage":{"input_tokens":9,'
             '"input_tokens_details":{"cached_tokens":4},"output_tokens":3,"total_tokens":12}}}', 1.4)
    assert (acc.t_first, acc.text, acc.token_times, acc.done) == (1.2, "hello", [1.2, 1.3, 1.35], True)
    assert (acc.prompt_tokens, acc.cached_tokens, acc.completion_tokens, acc.finish_reason) == \
        (9, 4, 3, "max_output_tokens")
    with pytest.raises(rs.ReplayError, match="error event: boom"):
        acc.feed('data: {"type":"error","code":"server_error","message":"boom","param":null}', 1.5)
    assert rcl.retryable("error event: boom")


def test_messages_stream_accumulator():
    acc = rapi.MessagesAccumulator(1.0)
    acc.feed("event: message_start", 1.1)
    acc.feed('data: {"type":"message_start","message":{"id":"msg_1","usage":{"input_tokens":20,"output_tokens":0}}}',
             1.1)
    acc.feed('data: {"type":"ping"}', 1.15)
    acc.feed('data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}', 1.15)
    acc.feed('data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hi"}}', 1.2)
    acc.feed('data: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta",'
             '"partial_json":"{}"}}', 1.3)
    assert (acc.prompt_tokens, acc.cached_tokens) == (20, 0)  # message_start: all of it as input
    acc.feed('data: {"type":"message_delta","delta":{"stop_reason":"max_tokens"},"usage":{"input_tokens":8,'
             '"output_tokens":2,"cache_read_input_tokens":12,"cache_creation_input_tokens":0}}', 1.4)
    acc.feed('data: {"type":"message_stop"}', 1.4)
    assert (acc.t_first, acc.text, acc.done, acc.finish_reason) == (1.2, "hi", True, "max_tokens")
    assert (acc.prompt_tokens, acc.cached_tokens, acc.completion_tokens) == (20, 12, 2)
    # a server whose message_delta carries the output count only: message_start's prompt stands
    acc2 = rapi.MessagesAccumulator(0.0)
    acc2.feed('data: {"type":"message_start","message":{"usage":{"input_tokens":5,"cache_read_input_tokens":7,'
              '"cache_creation_input_tokens":3,"output_tokens":1}}}', 0.1)
    acc2.feed('data: {"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":4}}', 0.2)
    assert (acc2.prompt_tokens, acc2.cached_tokens, acc2.completion_tokens) == (15, 7, 4)
    with pytest.raises(rs.ReplayError, match="error event: overloaded"):
        acc.feed('data: {"type":"error","error":{"type":"overloaded_error","message":"overloaded"}}', 1.5)


def _ended_programs(server, monkeypatch) -> dict[str, int]:
    """Program id -> its finished turns, for every program the engine ends from now on."""
    sched = server.llm.scheduler
    real, ended = sched.end_program, {}

    def end_program(pid):
        prog = real(pid)
        if prog is not None:
            ended[pid] = prog.turns_finished
        return prog

    monkeypatch.setattr(sched, "end_program", end_program)
    return ended


def test_a_workload_over_each_api_has_the_same_token_counts(server, monkeypatch):
    """The same short workload over each API (each its own tenant, so each starts cold):
    every turn answered, the same prompt, cached and completion tokens turn by turn, each
    program one program on the server, named by what its API carries, and ended by its last turn."""
    ended = _ended_programs(server, monkeypatch)
    runs = {}
    for api in rapi.API_NAMES:
        ended.clear()
        progs = [program("a0", 0.0, 3), program("a1", 0.0, 4)]
        cfg = rcl.ReplayConfig(server.url, api_key=f"key-{api}", workload="unit", rate=10.0, progress=False,
                               request_timeout=30, text_seed="apis", api=api)
        res = runs[api] = rcl.replay(progs, cfg)
        assert (res["programs"], res["completed"], res["errors"]) == (2, 2, 0), res["error_kinds"]
        assert res["api"] == res["config"]["api"] == api
        assert res["server"].endswith("" if api == "chat" else f" ({api})")
        done = {pid: n for pid, n in ended.items() if n > 1}  # (the calibration probes are one-turn programs)
        if api == "responses-chain":  # named by the chain: its first response's id
            assert sorted(done.values()) == [3, 4] and all(pid.startswith(f"t-{api}/resp_") for pid in done)
        else:
            assert done == {f"t-{api}/a0": 3, f"t-{api}/a1": 4}
        for t in res["turns"]:
            assert t["completion_tokens"] == t["max_tokens"] == 6 and 0 <= t["ttft"] <= t["latency"]
            if t["turn"] > 0:
                assert t["cached_tokens"] > 0
    from server_fixtures import idle

    idle(server)

    def counts(res, key):
        return {(t["program_id"], t["turn"]): t[key] for t in res["turns"]}

    for key in ("prompt_tokens", "completion_tokens"):
        want = counts(runs["chat"], key)
        for api in rapi.API_NAMES:
            assert counts(runs[api], key) == want, (api, key)
    # later turns hit what the program's own earlier turns left (the same in every API)
    want = {k: v for k, v in counts(runs["chat"], "cached_tokens").items() if k[1] > 0}
    for api in rapi.API_NAMES:
        assert {k: v for k, v in counts(runs[api], "cached_tokens").items() if k[1] > 0} == want, api
    for api in rapi.API_NAMES:
        assert runs[api]["config"]["tokens_per_word"] == runs["chat"]["config"]["tokens_per_word"]


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_tool_messages_over_the_other_apis(server, api):
    """--tool-role tool: calls and their results as function_call / function_call_output items, or
    tool_use / tool_result blocks."""
    progs = [program("c0", 0.0, 3)]
    res = rcl.replay(progs, rcl.ReplayConfig(server.url, api_key=KEY, tokens_per_word=6.0, progress=False,
                                             request_timeout=30, tool_role="tool", api=api))
    assert (res["completed"], res["errors"]) == (1, 0), res["error_kinds"]


def test_cli_run_over_another_api(server, tmp_path, capsys):
    trace = tmp_path / "w.jsonl"
    save_jsonl([program("m0", 0.0, 2)], trace)
    out, md = tmp_path / "run.json", tmp_path / "run.md"
    rc = cli_main(["bench", "run", "--url", server.url, "--api-key", KEY, "--workload", str(trace),
                   "--programs", "1", "--rate", "20", "--api", "messages", "--json", str(out), "--report", str(md),
                   "--no-progress"])
    assert rc == 0
    assert "(messages)" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["api"] == "messages" and res["completed"] == 1 and "API: messages" in md.read_text()
    rc = cli_main(["bench", "run", "--url", server.url, "--workload", str(trace), "--api", "responses-chain",
                   "--tool-role", "tool", "--no-progress"])
    assert rc == 2 and "--tool-role user" in capsys.readouterr().err


def test_cli_program_selection_errors_are_one_line(capsys):
    for args, msg in ((["--min-turns", "0"], "--min-turns must be at least 1"),
                      (["--max-turns", "-1"], "--max-turns must be at least 1"),
                      (["--programs", "-1"], "--programs must be at least 1"),
                      (["--min-turns", "3"], "min_turns selects recorded sessions; swebench is generated")):
        assert cli_main(["bench", "run", "--url", "http://127.0.0.1:9", "--workload", "swebench", *args]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err
