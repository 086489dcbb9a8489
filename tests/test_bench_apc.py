"""The APC eviction analysis (benchmarks/apc.py): a hand-checked tiny trace, the
infinite-cache bound, the multi-turn / cross-program split, and the CLI."""

from __future__ import annotations

import json

import pytest

from agentserve.workload.load import load_workload
from agentserve.workload.trace import Program, TraceCall
from benchmarks.apc import INFINITE, ROW_KEYS, STRATEGIES, apc_table, call_order, reuse_profile
from benchmarks.apc_cli import format_table, main


def _call(pid, turn, arrival, prompt, new, out=1, shared=0, dur=0.0):
    return TraceCall(program_id=pid, turn=turn, arrival=arrival, prompt_tokens=prompt, new_tokens=new,
                     output_tokens=out, tool_name="t" if dur else None, tool_duration=dur,
                     shared_prefix_tokens=shared)


def _tiny_trace() -> list[Program]:
    """Block size 4; S1 S2 = the 8-token shared system prompt.

    t=0   A0: S1 S2 a1          (+1 output token)
    t=1   B0: S1 S2 b1          (+1)  program B, turn 0
    t=1.5 B1: S1 S2 b1 b2       (+1)  B's next turn: B0 + its output + 3 new tokens
    t=2   C0: c1 c2 c3          (+1)  an unrelated program (no shared prompt)
    t=3   D0: d1 d2 d3          (+1)  another one
    t=4   E0: S1 S2 e1          (+1)  a new program with the shared prompt
    """
    return [
        Program("A", [_call("A", 0, 0.0, 12, 12, shared=8)]),
        Program("B", [_call("B", 0, 1.0, 12, 12, shared=8, dur=0.5), _call("B", 1, 1.5, 16, 3, shared=8)]),
        Program("C", [_call("C", 0, 2.0, 12, 12)]),
        Program("D", [_call("D", 0, 3.0, 12, 12)]),
        Program("E", [_call("E", 0, 4.0, 12, 12, shared=8)]),
    ]


def _by_strategy(rows):
    return {(r["kv_blocks"], r["strategy"]): r for r in rows}


def test_tiny_trace_known_answer():
    """A 6-block cache. Hits per call (tokens), worked by hand:

    A0: nothing cached: 0.
    B0: S1 S2 (first computed by A): 8 cross-program.
    B1: S1 S2 b1; a match leaves the last prompt token (16 tokens -> at most 3
        blocks): S1 S2 cross (A computed them), b1 multi-turn (B did): 12.
        It computes S1 S2 b1 b2 + an output block: 5 blocks, 2 of them new,
        from the 2 empty blocks, so nothing is evicted. Cached now (hits):
        S1(2) S2(2) b1(1) a1(0) b2(0); 1 empty block. Freeing releases a
        request's tail first, so LRU order (oldest first): a1, b2, b1, S2, S1.
    C0: 0. Needs 4 blocks: the empty one + 3 evictions: LRU a1 b2 b1; LFU the
        3 fewest hits, a1(0) b2(0) b1(1): the same. LRU order now S2 S1 c3 c2 c1.
    D0: 0. Needs 4: 1 empty + 3 evictions. LRU: S2, S1, c3 (the shared prompt
        is gone). LFU: hits S=2 against c=0: c3, c2, c1 (the shared prompt stays).
    E0: S1 S2 e1: infinite and LFU hit S1 S2 (8 cross-program), LRU 0.
        (The hit frees the prompt's room too: E0 needs 4 blocks, with 1 empty
        LRU evicts 3 more, LFU, with 2 hits, 1.)

    Totals (prompt tokens 12+12+16+12+12+12 = 76):
      infinite 28 = 4 multi + 24 cross; LFU 28 (4 + 24); LRU 20 (4 + 16).
    Leaf-LRU at C0 evicts leaves a1, b2, then b1 (a leaf once b2 is gone),
    and at D0 S2 (a leaf since a1 and b1 went), c3, then S1: like LRU, 20."""
    rows = apc_table(_tiny_trace(), [6], block_size=4, strategies=["lru", "lfu", "leaf-lru"])
    t = _by_strategy(rows)
    inf = t[(None, INFINITE)]
    assert inf["prompt_tokens"] == 76
    assert (inf["hit_tokens"], inf["multi_turn_tokens"], inf["cross_program_tokens"]) == (28, 4, 24)
    lfu = t[(6, "lfu")]
    assert (lfu["hit_tokens"], lfu["multi_turn_tokens"], lfu["cross_program_tokens"]) == (28, 4, 24)
    assert lfu["loss_pp"] == 0.0 and lfu["loss_multi_turn_share"] is None
    for s in ("lru", "leaf-lru"):
        r = t[(6, s)]
        assert (r["hit_tokens"], r["multi_turn_tokens"], r["cross_program_tokens"]) == (20, 4, 16), s
        assert r["loss_pp"] == pytest.approx(100 * 8 / 76)
        assert r["loss_cross_program_pp"] == pytest.approx(100 * 8 / 76)
        assert r["loss_multi_turn_pp"] == 0.0 and r["loss_multi_turn_share"] == 0.0
    # evictions: C0 and D0 3 each, then E0 3 (LRU) or 1 (LFU)
    assert t[(6, "lru")]["evictions"] == 9 and t[(6, "lfu")]["evictions"] == 7
    assert inf["hit_ratio"] == pytest.approx(28 / 76)
    # a cache big enough never evicts: it is the infinite cache
    big = _by_strategy(apc_table(_tiny_trace(), [64], block_size=4, strategies=STRATEGIES))
    for s in STRATEGIES:
        assert big[(64, s)]["hit_tokens"] == 28 and big[(64, s)]["evictions"] == 0


def test_call_order_tool_time_and_decode_time():
    progs = _tiny_trace()
    assert [(t, progs[i].program_id, k) for t, i, k in call_order(progs)] == [
        (0.0, "A", 0), (1.0, "B", 0), (1.5, "B", 1), (2.0, "C", 0), (3.0, "D", 0), (4.0, "E", 0)]
    # one output token at 2 tokens/s: B1 arrives 0.5 s later
    assert (1.0 + 0.5 + 0.5, 1, 1) in call_order(progs, decode_tps=2.0)
    with pytest.raises(ValueError):
        call_order(progs, decode_tps=-1.0)


@pytest.fixture(scope="module")
def swebench_rows():
    programs = load_workload("swebench", 6, 2.0, 3)
    prof: dict = {}
    rows = apc_table(programs, [1100, 2000], 16, STRATEGIES, seed=3, profile=prof)
    return programs, rows, prof


def test_infinite_bounds_every_strategy(swebench_rows):
    _, rows, _ = swebench_rows
    inf = rows[0]
    assert inf["strategy"] == INFINITE and inf["kv_blocks"] is None
    assert len(rows) == 1 + 2 * len(STRATEGIES)
    for r in rows[1:]:
        assert r["hit_tokens"] <= inf["hit_tokens"]
        assert r["multi_turn_tokens"] <= inf["multi_turn_tokens"]
        assert r["cross_program_tokens"] <= inf["cross_program_tokens"]
        assert r["loss_pp"] >= 0.0
    assert any(r["evictions"] > 0 for r in rows[1:])  # the sizes do put the cache under pressure
    assert inf["hit_ratio"] > 0.5  # agent traces reuse most of their prompts


def test_multi_plus_cross_is_total(swebench_rows):
    _, rows, prof = swebench_rows
    for r in rows:
        assert set(r) == set(ROW_KEYS)
        assert r["multi_turn_tokens"] + r["cross_program_tokens"] == r["hit_tokens"]
        assert r["multi_turn_ratio"] + r["cross_program_ratio"] == pytest.approx(r["hit_ratio"])
        assert r["loss_multi_turn_pp"] + r["loss_cross_program_pp"] == pytest.approx(r["loss_pp"])
        assert r["prompt_tokens"] == prof["prompt_tokens"]
    # every program shares the system prompt: some hits are cross-program
    assert rows[0]["cross_program_tokens"] > 0 and rows[0]["multi_turn_tokens"] > 0
    text = format_table(rows)
    assert "infinite" in text and "leaf-lru" in text


def test_huge_cache_matches_infinite(swebench_rows):
    programs, rows, prof = swebench_rows
    big = apc_table(programs, [prof["unique_blocks"] + 2 * prof["max_call_blocks"]], 16, ["lru"], seed=3)
    assert big[1]["hit_tokens"] == rows[0]["hit_tokens"] == big[0]["hit_tokens"]
    assert big[1]["evictions"] == 0
    assert reuse_profile(programs, 16, seed=3) == prof


def test_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "apc.json"
    assert main(["--workload", "swebench", "--programs", "3", "--kv-blocks", "1100,3000",
                 "--strategies", "lru,arc", "--rate", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "infinite" in printed and "arc" in printed
    doc = json.loads(out.read_text())
    for k in ("workload", "programs", "seed", "rate", "block_size", "decode_tps", "kv_blocks", "strategies",
              "profile", "rows"):
        assert k in doc
    assert doc["kv_blocks"] == [1100, 3000] and doc["strategies"] == ["lru", "arc"]
    assert [(r["kv_blocks"], r["strategy"]) for r in doc["rows"]] == [
        (None, "infinite"), (1100, "lru"), (1100, "arc"), (3000, "lru"), (3000, "arc")]
    for r in doc["rows"]:
        assert set(r) == set(ROW_KEYS)
    for k in ("program_blocks_p50", "active_programs_p50", "inter_turn_gap_p50", "working_set_blocks",
              "max_call_blocks", "unique_blocks"):
        assert k in doc["profile"]


def test_cli_rejects_unknown_strategy(capsys):
    assert main(["--programs", "1", "--strategies", "lru,fifo"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m benchmarks apc: error: unknown strategy fifo")
