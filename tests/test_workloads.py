"""Workloads: the JSONL trace format, Table-2 generators, token plans, and the
loaders of the shared recorded traces (skipped when ../shared/traces is absent)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace

import pytest

from agentserve.workload.claude_code import load_claude_code
from agentserve.workload.generators import (
    assign_poisson_arrivals,
    generate_bfcl,
    generate_swebench,
    workload_spec,
)
from agentserve.workload.swe_smith import load_swe_smith
from agentserve.workload.tokens import program_token_plan, shared_token_pool
from agentserve.workload.trace import Program, TraceCall, find_shared_traces, format_stats, workload_stats
from agentserve.workload.trace_jsonl import TraceError, load_jsonl, save_jsonl
from agentserve.workload.load import load_workload


def _close(got: float, want: float, rel: float) -> bool:
    return abs(got - want) <= rel * abs(want)


# ---------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def traces_dir():
    d = find_shared_traces()
    if d is None or not (d / "claude-code").is_dir():
        pytest.skip("shared traces folder (../shared/traces) not found")
    return d


@pytest.fixture(scope="module")
def claude(traces_dir):
    return load_claude_code(traces_dir / "claude-code")


@pytest.fixture(scope="module")
def smith(traces_dir):
    return load_swe_smith(traces_dir / "swe_smith_5traj_tool_timings.json")


@pytest.fixture(scope="module")
def swe():
    return generate_swebench(2000, rate=2.0, seed=1)


@pytest.fixture(scope="module")
def bfcl():
    return generate_bfcl(3000, rate=2.0, seed=1)


# ---------------------------------------------------------------------------
# generators vs the CacheTTL paper's Table 2

TABLE2 = {
    # turns (mean, std), tool ms (mean, std), tokens per program (mean, std)
    "swebench": ((10.9, 2.1), (925, 3550), (70126, 19732)),
    "bfcl": ((6.3, 2.3), (1923, 2133), (93256, 68687)),
}


@pytest.mark.parametrize("name", ["swebench", "bfcl"])
def test_generated_stats_match_table2(name, swe, bfcl):
    progs = swe if name == "swebench" else bfcl
    (tm, ts), (dm, ds), (km, ks) = TABLE2[name]
    s = workload_stats(progs)
    assert _close(s["turns_mean"], tm, 0.03) and _close(s["turns_std"], ts, 0.10), s
    # heavy-tailed: the sample std converges slowly (SWE-bench kurtosis ~300)
    assert _close(s["tool_time_ms_mean"], dm, 0.10) and _close(s["tool_time_ms_std"], ds, 0.20), s
    assert _close(s["tokens_per_program_mean"], km, 0.04) and _close(s["tokens_per_program_std"], ks, 0.10), s
    assert s["tool_time_ms_p50"] < dm  # most tools are short
    out_mean = 250 if name == "swebench" else 150
    assert _close(s["output_tokens_mean"], out_mean, 0.05)
    assert 1500 <= s["first_prompt_tokens_mean"] <= 2500
    assert s["prompt_growth_mean"] > 0
    assert "tokens_per_program_mean" in format_stats(s)


@pytest.mark.parametrize("name", ["swebench", "bfcl"])
def test_generated_structure(name, swe, bfcl):
    progs = swe if name == "swebench" else bfcl
    spec = workload_spec(name)
    tools = {t.name for t in spec.tools}
    for p in progs[:300]:
        assert p.num_turns >= 2
        for k, c in enumerate(p.calls):
            assert c.turn == k and c.program_id == p.program_id
            assert c.shared_prefix_tokens == spec.shared_prefix_tokens <= c.prompt_tokens
            assert c.arrival >= p.arrival
            if k == p.num_turns - 1:
                assert c.tool_name is None and c.tool_duration == 0
            else:
                assert c.tool_name in tools and c.tool_duration >= 0
            if k == 0:
                assert c.new_tokens == c.prompt_tokens
            else:
                prev = p.calls[k - 1]
                assert c.new_tokens == c.prompt_tokens - prev.prompt_tokens - prev.output_tokens > 0
    if name == "swebench":
        assert {"cat", "grep", "sed", "python", "cd", "ls", "find", "echo"} <= tools
        outs = sorted(c.output_tokens for p in progs for c in p.calls)
        assert 90 <= outs[len(outs) // 20] and outs[-len(outs) // 20] <= 500  # 5%..95% within ~100-500
    else:
        assert tools == {"web_search", "fetch_url"}


def test_generation_deterministic_and_prefix_stable():
    a = generate_swebench(50, rate=1.0, seed=7)
    b = generate_swebench(50, rate=1.0, seed=7)
    c = generate_swebench(50, rate=1.0, seed=8)
    assert a == b
    assert [p.calls for p in a] != [p.calls for p in c]
    # program i does not depend on the count or the rate (except its arrival)
    d = generate_swebench(20, rate=5.0, seed=7)
    for p, q in zip(a, d):
        assert p.program_id == q.program_id
        assert [replace(x, arrival=0.0) for x in p.calls] == [replace(x, arrival=0.0) for x in q.calls]
    assert generate_bfcl(30, 1.0, 3) == generate_bfcl(30, 1.0, 3)
    assert len({p.program_id for p in a}) == 50


def test_poisson_arrivals():
    progs = generate_bfcl(4000, rate=4.0, seed=2)
    arr = [p.arrival for p in progs]
    assert arr == sorted(arr) and arr[0] > 0
    gaps = [b - a for a, b in zip([0.0] + arr, arr)]
    mean = sum(gaps) / len(gaps)
    std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert _close(mean, 0.25, 0.05) and _close(std, 0.25, 0.08)  # exponential: std == mean


# ---------------------------------------------------------------------------
# JSONL


def test_jsonl_round_trip(tmp_path, swe):
    progs = swe[:40]
    path = tmp_path / "w.jsonl"
    save_jsonl(progs, path)
    assert load_jsonl(path) == progs
    lines = path.read_text().splitlines()
    assert len(lines) == sum(p.num_turns for p in progs)
    obj = json.loads(lines[0])
    for key in ("program_id", "turn", "arrival", "prompt_tokens", "new_tokens", "output_tokens",
                "tool_name", "tool_duration", "shared_prefix_tokens"):
        assert key in obj


def test_jsonl_round_trip_optional_fields(tmp_path):
    calls = [
        TraceCall("p", 0, 0.5, 130, 130, 7, "tool", 1.25, hash_ids=[1, 2], hash_block_size=64, message_index=2),
        TraceCall("p", 1, 3.0, 200, 72, 9, None, 0.0, hash_ids=[1, 2, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14],
                  hash_block_size=16, message_index=4),
    ]
    sub = [TraceCall("p:a", 0, 1.0, 10, 10, 1, None, 0.0, shared_prefix_tokens=3)]
    progs = [Program("p", calls, messages=[{"role": "system", "content": "hi"}]),
             Program("p:a", sub, parent_id="p", parent_turn=0)]
    path = tmp_path / "o.jsonl"
    save_jsonl(progs, path)
    assert load_jsonl(path) == progs


def test_jsonl_sorted_by_arrival(tmp_path):
    a = Program("a", [TraceCall("a", 0, 5.0, 10, 10, 1, None, 0.0)])
    b = Program("b", [TraceCall("b", 0, 1.0, 10, 10, 1, "x", 0.1), TraceCall("b", 1, 2.0, 21, 10, 1, None, 0.0)])
    path = tmp_path / "s.jsonl"
    save_jsonl([a, b], path)
    assert [p.program_id for p in load_jsonl(path)] == ["b", "a"]


GOOD = {"program_id": "p", "turn": 0, "arrival": 0.0, "prompt_tokens": 100, "new_tokens": 100,
        "output_tokens": 5, "tool_name": "t", "tool_duration": 0.5}


@pytest.mark.parametrize(
    "second, line, fieldname",
    [
        ({k: v for k, v in GOOD.items() if k != "output_tokens"} | {"turn": 1}, 2, "output_tokens"),
        (GOOD | {"turn": 1, "tool_duration": -1.0}, 2, "tool_duration"),
        (GOOD | {"turn": 1, "prompt_tokens": 50, "new_tokens": 60}, 2, "new_tokens"),
        (GOOD | {"turn": 2}, 2, "turn"),  # gap: turn 1 missing
        (GOOD, 2, "turn"),  # duplicate turn 0
        (GOOD | {"turn": 1, "prompt_tokens": 300, "new_tokens": 10}, 2, "new_tokens"),  # reuse > prev prompt+out
        (GOOD | {"turn": 1, "prompt_tokens": "7"}, 2, "prompt_tokens"),
        (GOOD | {"turn": 1, "hash_ids": [1, 2, 3]}, 2, "hash_ids"),  # 100 // 64 = 1 id expected
    ],
)
def test_jsonl_errors(tmp_path, second, line, fieldname):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(second) + "\n")
    with pytest.raises(TraceError) as e:
        load_jsonl(path)
    msg = str(e.value)
    assert msg.startswith(f"line {line}: field '{fieldname}'"), msg
    assert "\n" not in msg
    assert isinstance(e.value, ValueError)


def test_jsonl_bad_json(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n{oops\n")
    with pytest.raises(TraceError, match=r"^line 3: invalid JSON"):
        load_jsonl(path)


# ---------------------------------------------------------------------------
# token plans


def test_token_plan_pure_append_and_shared_prefix(swe):
    plans = [program_token_plan(p, 1) for p in swe[:20]]
    spt = swe[0].calls[0].shared_prefix_tokens
    pool = shared_token_pool(spt, 1)
    seen: set[int] = set()
    for p, plan in zip(swe[:20], plans):
        assert len(plan) == p.num_turns
        for k, (c, (prompt, out)) in enumerate(zip(p.calls, plan)):
            assert len(prompt) == c.prompt_tokens and len(out) == c.output_tokens
            assert prompt[:spt] == pool
            if k:
                pp, po = plan[k - 1]
                assert prompt[: len(pp) + len(po)] == pp + po  # pure append: exact prefix
        own = set(plan[-1][0][spt:]) | set(plan[-1][1])
        assert not (own & seen)  # no cross-program token reuse beyond the shared pool
        seen |= own
    assert program_token_plan(swe[3], 1) == plans[3]  # deterministic
    assert program_token_plan(swe[3], 2)[0][0] != plans[3][0][0]


def test_token_plan_partial_reuse_and_vocab():
    calls = [
        TraceCall("q", 0, 0.0, 100, 100, 10, "t", 1.0, shared_prefix_tokens=20),
        TraceCall("q", 1, 1.0, 150, 40, 10, "t", 1.0, shared_prefix_tokens=20),  # keeps 110 = prompt0+out0
        TraceCall("q", 2, 2.0, 90, 60, 5, None, 0.0, shared_prefix_tokens=20),  # reset: keeps 30
    ]
    p = Program("q", calls)
    plan = program_token_plan(p, 0)
    (p0, o0), (p1, o1), (p2, o2) = plan
    assert p1[:110] == p0 + o0 and not set(p1[110:]) & set(p0 + o0)
    assert p2[:30] == p1[:30] and not set(p2[30:]) & set(p1 + o1)
    assert [len(x) for x in (p0, o0, p1, o1, p2, o2)] == [100, 10, 150, 10, 90, 5]
    vplan = program_token_plan(p, 0, vocab_size=1000)
    assert all(0 <= t < 1000 for pr, out in vplan for t in pr + out)
    assert vplan[1][0][:110] == vplan[0][0] + vplan[0][1]
    assert vplan == program_token_plan(p, 0, vocab_size=1000)
    pool = list(range(7, 27))
    assert program_token_plan(p, 0, shared_pool=pool)[0][0][:20] == pool
    with pytest.raises(ValueError):
        program_token_plan(p, 0, shared_pool=pool[:5])


def test_token_plan_hash_ids():
    bs = 4
    parent = Program("g", [
        TraceCall("g", 0, 0.0, 10, 10, 3, "t", 1.0, hash_ids=[1, 2], hash_block_size=bs),
        TraceCall("g", 1, 1.0, 14, 6, 3, None, 0.0, hash_ids=[1, 2, 3], hash_block_size=bs),
    ])
    sub = Program("g:a", [TraceCall("g:a", 0, 0.5, 13, 13, 2, None, 0.0, hash_ids=[7, 2, 9], hash_block_size=bs)],
                  parent_id="g", parent_turn=0)
    other = Program("h", [TraceCall("h", 0, 0.0, 8, 8, 1, None, 0.0, hash_ids=[1, 2], hash_block_size=bs)])
    (a0, ao), (a1, _) = program_token_plan(parent, 5)
    (s0, so), = program_token_plan(sub, 5)
    (h0, _), = program_token_plan(other, 5)
    assert len(a0) == 10 and len(a1) == 14 and len(s0) == 13
    assert a1[:8] == a0[:8] and a1[8:12] != a0[8:10] + ao[:2]
    assert s0[4:8] == a0[4:8]  # same id, same group -> same tokens, any position
    assert s0[:4] != a0[:4]
    assert not set(h0) & set(a0)  # another group: different tokens
    assert a0[8:] != a1[12:]  # tails are fresh
    vp = program_token_plan(sub, 5, vocab_size=100)
    assert vp[0][0][4:8] == program_token_plan(parent, 5, vocab_size=100)[0][0][4:8]


def test_token_plan_speed():
    progs = generate_swebench(500, rate=1.0, seed=3)
    t0 = time.perf_counter()
    total = 0
    for p in progs:
        total += sum(len(x) for x, _ in program_token_plan(p, 0))
    dt = time.perf_counter() - t0
    assert total > 20_000_000
    assert dt < 4.0, dt


# ---------------------------------------------------------------------------
# Claude Code traces


def test_claude_code_totals(claude):
    parents = [p for p in claude if p.parent_id is None]
    subs = [p for p in claude if p.parent_id is not None]
    assert len(parents) == 14 and len(subs) == 6
    assert sum(p.num_turns for p in parents) == 1054
    assert sum(p.num_turns for p in subs) == 56
    calls = [c for p in claude for c in p.calls]
    assert sum(c.prompt_tokens for c in calls) == 82_193_225
    assert sum(c.new_tokens for c in calls) == 2_799_305
    assert sum(c.output_tokens for c in calls) == 373_275
    for p in claude:
        assert p.calls[-1].tool_name is None and p.calls[-1].tool_duration == 0
        assert [c.turn for c in p.calls] == list(range(p.num_turns))
        assert all(len(c.hash_ids) == c.prompt_tokens // 64 for c in p.calls)
    names = {c.tool_name for c in calls}
    assert {"tool", "human", "unknown", "Task:Explore", "Task:Plan"} <= names
    gaps = sorted(c.tool_duration for c in calls if c.tool_name == "tool")
    assert gaps[len(gaps) // 2] == 7.0  # README: tool gap p50 7 s


def test_claude_code_subagents(claude):
    by_id = {p.program_id: p for p in claude}
    s = by_id["trace_0277:agent_001"]
    assert s.parent_id == "trace_0277" and s.parent_turn == 0
    assert s.arrival == pytest.approx(79.224 - 59.750)
    assert by_id["trace_0277"].calls[0].tool_name == "Task:Explore"
    assert by_id["trace_0277"].calls[6].tool_name == "Task:Plan"
    # a subagent's later calls: start + its own t
    assert s.calls[1].arrival > s.arrival


def test_claude_code_scale_and_truncate(traces_dir):
    f = traces_dir / "claude-code" / "trace_0277.json"
    full = load_claude_code(f)
    half = load_claude_code(f, token_scale=0.5)
    assert [p.program_id for p in half] == [p.program_id for p in full]
    for p, q in zip(full, half):
        for a, b in zip(p.calls, q.calls):
            assert b.hash_block_size == 32 and b.hash_ids == a.hash_ids
            assert b.prompt_tokens // 32 == len(b.hash_ids)
            assert abs(b.prompt_tokens - a.prompt_tokens / 2) <= 32
            assert b.output_tokens == round(a.output_tokens * 0.5)
    trunc = load_claude_code(f, max_prompt_tokens=50_000)
    parent = trunc[0]
    assert parent.program_id == "trace_0277" and parent.num_turns == 2  # call 2 has 55,222 tokens
    assert parent.calls[-1].tool_name is None and parent.calls[-1].tool_duration == 0
    assert all(c.prompt_tokens <= 50_000 for p in trunc for c in p.calls)
    assert {p.parent_turn for p in trunc[1:]} == {0}  # the Plan subagent (after turn 6) is dropped
    assert load_claude_code(f, max_prompt_tokens=1000) == []


def test_claude_code_round_trip_and_tokens(tmp_path, traces_dir):
    progs = load_claude_code(traces_dir / "claude-code" / "trace_0291.json")
    path = tmp_path / "cc.jsonl"
    save_jsonl(progs, path)
    assert load_jsonl(path) == progs
    parent, sub = progs[0], progs[1]
    plan = program_token_plan(parent, 0)
    for (pa, _), (pb, _), cb in zip(plan, plan[1:], parent.calls[1:]):
        reused = cb.prompt_tokens - cb.new_tokens
        assert pb[:reused] == pa[:reused]
    sp = program_token_plan(sub, 0)
    assert not set(sp[0][0]) & set(plan[0][0])  # subagents share no block with the parent


# ---------------------------------------------------------------------------
# SWE-smith trajectories

SMITH_README = {  # instance prefix: (calls, first prompt, last prompt, sum output, tool time s)
    "django-money__django-money": (24, 704, 11161, 3198, 5.13),
    "marshmallow-code__apispec": (21, 650, 8579, 2135, 4.88),
    "mozillazg__python-pinyin": (32, 659, 31360, 2425, 8.30),
    "marshmallow-code__marshmallow": (24, 757, 14816, 3237, 5.45),
    "luozhouyang__python-string-similarity": (24, 666, 23246, 10493, 5.71),
}


def test_swe_smith(smith):
    assert len(smith) == 5
    assert sum(p.num_turns for p in smith) == 125
    for p in smith:
        key = next(k for k in SMITH_README if p.program_id.startswith(k + "."))
        n, first, last, out, tool = SMITH_README[key]
        assert p.num_turns == n
        assert abs(p.calls[0].prompt_tokens - first) <= 3 and abs(p.calls[-1].prompt_tokens - last) <= 3
        assert abs(sum(c.output_tokens for c in p.calls) - out) <= 3
        assert round(sum(c.tool_duration for c in p.calls), 2) == tool
        assert p.calls[-1].tool_name is None and p.calls[-1].tool_duration == 0
        assert {c.tool_name for c in p.calls[:-1]} <= {"bash", "str_replace_editor", "submit"}
        assert p.messages is not None and p.messages[0]["role"] == "system"
        for k, c in enumerate(p.calls):
            m = p.messages[c.message_index]
            assert m["role"] == "assistant"
            if c.tool_name is not None:
                assert m["tool_calls"][0]["function"]["name"] == c.tool_name
            if k:
                prev = p.calls[k - 1]
                assert c.new_tokens == c.prompt_tokens - prev.prompt_tokens - prev.output_tokens >= 0
        assert all(c.shared_prefix_tokens == p.calls[0].shared_prefix_tokens > 0 for c in p.calls)


def test_swe_smith_count_tokens_and_round_trip(tmp_path, traces_dir, smith):
    words = load_swe_smith(traces_dir, count_tokens=lambda s: len(s.split()))
    assert [p.num_turns for p in words] == [p.num_turns for p in smith]
    assert words[0].calls[-1].prompt_tokens != smith[0].calls[-1].prompt_tokens
    path = tmp_path / "ss.jsonl"
    save_jsonl(smith, path)
    assert load_jsonl(path) == sorted(smith, key=lambda p: p.arrival)


# ---------------------------------------------------------------------------
# registry and arrivals


def test_load_workload_generated():
    a = load_workload("swebench", 30, 1.0, 4)
    assert a == generate_swebench(30, 1.0, 4)
    assert load_workload("bfcl", 10, 2.0, 4) == generate_bfcl(10, 2.0, 4)
    with pytest.raises(ValueError, match="swebench, bfcl, claude-code, swe-smith"):
        load_workload("nope", 10, 1.0, 0)


def test_load_workload_recorded(traces_dir, tmp_path):
    w = load_workload("claude-code", 40, 0.5, 9, path=traces_dir)
    tops = [p for p in w if p.parent_id is None]
    assert len(tops) == 40
    ids = [p.program_id for p in w]
    assert len(set(ids)) == len(ids) and all("#" in i for i in ids)
    by_id = {p.program_id: p for p in w}
    for p in w:
        assert all(c.program_id == p.program_id for c in p.calls)
        if p.parent_id is not None:
            parent = by_id[p.parent_id]
            assert p.program_id.startswith(p.parent_id + ":")
            assert p.arrival - parent.arrival > 0  # recorded offset kept
    assert [p.arrival for p in w] == sorted(p.arrival for p in w)
    assert w == load_workload("claude-code", 40, 0.5, 9, path=traces_dir)

    s = load_workload("swe-smith", 12, 1.0, 0, path=traces_dir)
    assert len(s) == 12 and len({p.program_id for p in s}) == 12
    path = tmp_path / "g.jsonl"
    save_jsonl(generate_bfcl(5, 1.0, 0), path)
    j = load_workload(str(path), 8, 1.0, 0)
    assert sorted(int(p.program_id.rsplit("#", 1)[1]) for p in j) == list(range(8))


def test_load_workload_selects_long_sessions_and_first_turns(traces_dir):
    every = load_workload("claude-code", None, 0.5, 9, path=traces_dir)
    tops = sorted(p.num_turns for p in every if p.parent_id is None)
    n = tops[-1]
    long = load_workload("claude-code", None, 0.5, 9, path=traces_dir, min_turns=n)
    assert [p.num_turns for p in long if p.parent_id is None] == [n] * tops.count(n)
    assert all(p.parent_id is None or any(q.program_id == p.parent_id for q in long) for p in long)
    with pytest.raises(ValueError, match=f"no session has {n + 1} turns .the longest has {n}."):
        load_workload("claude-code", None, 0.5, 9, path=traces_dir, min_turns=n + 1)
    with pytest.raises(ValueError, match="generated"):
        load_workload("swebench", 4, 0.5, 9, min_turns=2)
    firsts = load_workload("claude-code", None, 0.5, 9, path=traces_dir, max_turns=2)
    assert firsts and all(p.num_turns <= 2 for p in firsts)
    assert all(p.parent_turn is None or p.parent_turn < 2 for p in firsts)
    # the first turns are the workload's own (same arrivals, same calls)
    by_id = {p.program_id: p for p in every}
    assert all(p.calls == by_id[p.program_id].calls[:2] for p in firsts)
    assert load_workload("swebench", 5, 1.0, 3, max_turns=1) == [
        type(p)(p.program_id, p.calls[:1]) for p in load_workload("swebench", 5, 1.0, 3)]


def test_first_turns_drops_subagents_launched_after_the_cut():
    from agentserve.workload.load import first_turns

    parent = Program("x", [TraceCall("x", k, float(k), 10 + k, 10, 1, "Task", 1.0) for k in range(4)])
    early = Program("x:a", [TraceCall("x:a", 0, 0.5, 10, 10, 1, None, 0.0)], parent_id="x", parent_turn=0)
    late = Program("x:b", [TraceCall("x:b", 0, 2.5, 10, 10, 1, None, 0.0)], parent_id="x", parent_turn=2)
    assert [p.program_id for p in first_turns([parent, early, late], 2)] == ["x", "x:a"]
    assert [p.num_turns for p in first_turns([parent, early, late], 3)] == [3, 1, 1]


def test_assign_poisson_arrivals_keeps_subagent_offsets():
    parent = Program("x", [TraceCall("x", 0, 0.0, 10, 10, 1, "Task:Explore", 5.0),
                           TraceCall("x", 1, 9.0, 30, 19, 1, None, 0.0)])
    sub = Program("x:a", [TraceCall("x:a", 0, 1.5, 10, 10, 1, None, 0.0)], parent_id="x", parent_turn=0)
    lone = Program("y", [TraceCall("y", 0, 0.0, 10, 10, 1, None, 0.0)])
    out = assign_poisson_arrivals([parent, sub, lone], rate=1.0, seed=0)
    by_id = {p.program_id: p for p in out}
    assert by_id["x:a"].arrival - by_id["x"].arrival == pytest.approx(1.5)
    assert by_id["x"].calls[1].arrival - by_id["x"].arrival == pytest.approx(9.0)
    assert 0 < by_id["x"].arrival < by_id["y"].arrival
    assert parent.arrival == 0.0  # input untouched
    assert out == assign_poisson_arrivals([parent, sub, lone], rate=1.0, seed=0)


def test_tool_time_scale_scales_every_tool_duration():
    from agentserve.workload.load import load_workload

    base = load_workload("swebench", 20, 1.0, 3)
    slow = load_workload("swebench", 20, 1.0, 3, tool_time_scale=30.0)
    assert [p.arrival for p in slow] == [p.arrival for p in base]
    pairs = [(a.tool_duration, b.tool_duration) for p, q in zip(base, slow) for a, b in zip(p.calls, q.calls)]
    assert pairs and all(b == pytest.approx(30.0 * a) for a, b in pairs)
    assert any(a > 0 for a, _ in pairs)


def test_token_scale_applies_to_generated_workloads():
    from agentserve.workload.load import load_workload

    base = load_workload("swebench", 20, 1.0, 3)
    small = load_workload("swebench", 20, 1.0, 3, token_scale=0.1)
    big = sum(c.prompt_tokens for p in base for c in p.calls)
    little = sum(c.prompt_tokens for p in small for c in p.calls)
    assert little == pytest.approx(0.1 * big, rel=0.05)
    for p in small:
        end = 0
        for c in p.calls:  # each prompt still extends the previous prompt and output
            assert 0 <= c.prompt_tokens - c.new_tokens <= end and c.output_tokens >= 1
            end = c.prompt_tokens + c.output_tokens
