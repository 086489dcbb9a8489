"""The paper's agent workloads (`benchmarks/novel_workloads.py`), their runner and
report (`benchmarks/fastpath.py`, `benchmarks/fastpath_report.py`), vLLM's tool template
(`benchmarks/tool_template.py`), and short live runs against the tiny server."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import math

import pytest

from benchmarks import fastpath as fp
from benchmarks import fastpath_report as fr
from benchmarks import novel_workloads as nw

KEY = "fastpath-key"
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def all_prompts(run: nw.AgentRun) -> list[str]:
    return [json.dumps(nw.scripted_prompt(run, k)) for k in range(len(run.turns))]


# ---------------------------------------------------------------------------
# generators


@pytest.mark.parametrize("workload", ["bugfix6", "deepcoding35"])
def test_generators_are_deterministic_per_seed(workload):
    a = nw.novel_runs(workload, 3, seed=1, salt="x")
    assert a == nw.novel_runs(workload, 3, seed=1, salt="x")
    assert [r.run_id for r in a] != [r.run_id for r in nw.novel_runs(workload, 3, seed=2, salt="x")]
    assert a[0] != nw.novel_runs(workload, 1, seed=1, salt="y")[0]
    # run i does not depend on how many runs are drawn
    assert nw.novel_runs(workload, 1, seed=1, salt="x")[0] == a[0]
    assert nw.repeat_agents(4, "s") == nw.repeat_agents(4, "s")


def test_every_prompt_is_unique_across_runs():
    seen: set[str] = set()
    modules = set()
    runs = (nw.novel_runs("bugfix6", 30, 0, "a") + nw.novel_runs("bugfix6", 2, 0, "a-warmup")
            + nw.novel_runs("deepcoding35", 4, 0, "a"))
    for run in runs:
        prompts = all_prompts(run)
        assert not seen & set(prompts)
        seen |= set(prompts)
        if run.workload == "bugfix6":
            modules.add(run.turns[0].call["path"])
            assert run.turns[0].call["path"] in run.turns[0].user  # the task names its own file
    assert len(modules) == 32  # a file name of its own per agent run (warm-up runs too)
    assert len({r.run_id for r in runs}) == len(runs)


def _check_args(tool: dict, args: dict) -> None:
    params = tool["function"]["parameters"]
    assert set(params["required"]) <= set(args) <= set(params["properties"])
    for k, v in args.items():
        assert isinstance(v, {"string": str, "integer": int}[params["properties"][k]["type"]])


def test_scripted_tool_calls_are_well_formed():
    tools = {t["function"]["name"]: t for t in nw.TOOLS}
    assert list(tools) == ["read_file", "search_code", "write_file", "run_command", "get_diagnostics", "summary"]
    for t in nw.TOOLS:
        assert t["type"] == "function" and t["function"]["description"]
        p = t["function"]["parameters"]
        assert p["type"] == "object" and set(p["required"]) <= set(p["properties"])
    bug = nw.bugfix_run(0, 0)
    assert [t.tool for t in bug.turns] == list(tools)  # the paper's six turns, in order
    assert bug.turns[0].user and all(t.user is None for t in bug.turns[1:])
    deep = nw.deepcoding_run(0, 0)
    assert len(deep.turns) == 35 and all(t.user for t in deep.turns)
    assert deep.turns[-1].tool == "summary" and 3 <= sum(t.tool is None for t in deep.turns) <= 6
    for run in (bug, deep, *nw.repeat_agents(0)):
        for k, t in enumerate(run.turns):
            if t.tool is None:
                assert t.call is None and t.result is None
                continue
            _check_args(tools[t.tool], t.call)
            msg = nw.call_message(t.tool, t.call, f"call_{k}")
            assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == t.call
            assert (t.result is None) == (t.tool == "summary")
    # the written fix differs from the read file exactly in the loop bounds
    read, written = bug.turns[0].result, bug.turns[2].call["content"]
    diff = [(a, b) for a, b in zip(read.splitlines(), written.splitlines()) if a != b]
    assert len(diff) == 1 and "for i in range(" in diff[0][0] and len(read.splitlines()) == len(written.splitlines())
    # a scripted prompt: each call answered by a tool message with its id
    msgs = nw.scripted_prompt(bug, 3)
    assert [m["role"] for m in msgs] == ["system", "user"] + ["assistant", "tool"] * 3
    for call, res in zip(msgs[2::2], msgs[3::2]):
        assert res["tool_call_id"] == call["tool_calls"][0]["id"]


def test_dispatch_orders():
    for pattern in nw.REPEAT_PATTERNS:
        order = nw.dispatch_order(pattern, 3, 5, seed=1)
        assert sorted(order) == [(a, t) for a in range(3) for t in range(5)]
        for a in range(3):
            assert [t for b, t in order if b == a] == list(range(5))
    assert nw.dispatch_order("sequential", 3, 5)[:6] == [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 0)]
    assert nw.dispatch_order("round-robin", 3, 5)[:4] == [(0, 0), (1, 0), (2, 0), (0, 1)]
    assert nw.dispatch_order("interleaved", 3, 5, 1) == nw.dispatch_order("interleaved", 3, 5, 1)
    with pytest.raises(ValueError):
        nw.dispatch_order("zigzag", 3, 5)
    with pytest.raises(ValueError):
        nw.novel_runs("bugfix7", 1)


def test_vllm_template_renders_what_agentserve_renders():
    from benchmarks.tool_template import HERMES_CHATML_TOOLS, vllm_tool_args, write_template
    from agentserve.server.chat_template import ChatTemplate

    ours, theirs = ChatTemplate(SMOLLM2_TEMPLATE), ChatTemplate(HERMES_CHATML_TOOLS)
    run = nw.bugfix_run(0, 0)
    msgs = nw.scripted_prompt(run, 5)
    msgs[2]["content"] = "Reading it first."  # content beside a call
    msgs[4]["tool_calls"].append(dict(copy.deepcopy(msgs[4]["tool_calls"][0]), id="second"))  # two calls a turn
    # vLLM hands the template parsed arguments and tools with its own None fields
    vmsgs = copy.deepcopy(msgs)
    for m in vmsgs:
        for c in m.get("tool_calls") or ():
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    vtools = [dict(t, function=dict(t["function"], strict=None), defer_loading=None) for t in run.tools]
    assert theirs.render(vmsgs, tools=vtools) == ours.render(msgs, tools=list(run.tools))
    for m, tools in (([{"role": "user", "content": "hi"}], None), ([{"role": "user", "content": "hi"}], run.tools)):
        assert theirs.render(m, tools=tools and list(tools)) == ours.render(m, tools=tools and list(tools))
    assert "--tool-call-parser" in vllm_tool_args("t.jinja")
    assert "<tool_call>" in write_template(__import__("tempfile").mkdtemp()).read_text()


# ---------------------------------------------------------------------------
# metrics and report on fake data

PROM_BEFORE = """# HELP agentserve:generation_tokens_total Output tokens generated.
# TYPE agentserve:generation_tokens_total counter
agentserve:generation_tokens_total{model_name="m"} 100.0
agentserve:generation_tokens_created{model_name="m"} 1.7e9
agentserve:engine_decode_steps_total{model_name="m"} 90.0
agentserve:spec_draft_tokens_total{model_name="m"} 10.0
agentserve:ttft_seconds_bucket{le="0.1",model_name="m"} 3.0
"""
PROM_AFTER = """agentserve:generation_tokens_total{model_name="m"} 1100.0
agentserve:engine_decode_steps_total{model_name="m"} 590.0
agentserve:spec_draft_tokens_total{model_name="m"} 810.0
agentserve:spec_accepted_tokens_total{model_name="m"} 600.0
agentserve:early_stop_saved_tokens_total{model_name="m"} 250.0
agentserve:request_success_total{finished_reason="stop",model_name="m"} 3.0
agentserve:request_success_total{finished_reason="length",model_name="m"} 4.0
"""


def test_prometheus_deltas_and_fastpath_ratios():
    before, after = fp.parse_prometheus(PROM_BEFORE), fp.parse_prometheus(PROM_AFTER)
    assert before == {"agentserve:generation_tokens": 100.0, "agentserve:engine_decode_steps": 90.0,
                      "agentserve:spec_draft_tokens": 10.0}
    assert after["agentserve:request_success"] == 7.0  # summed over labels
    d = fp.counter_deltas(before, after)
    assert d["agentserve:generation_tokens"] == 1000 and d["agentserve:spec_accepted_tokens"] == 600
    m = fr.fastpath_metrics(d, client_output_tokens=999)
    assert m["passes_per_output_token"] == pytest.approx(0.5)
    assert m["spec_acceptance"] == pytest.approx(0.75)
    assert m["early_stop_saved_tokens"] == 250 and m["early_stop_saved_share"] == pytest.approx(0.2)
    assert m["response_cache_hits"] is None and m["counter_names"]["spec_drafted"] == "agentserve:spec_draft_tokens"
    assert "agentserve:request_success" not in m["counters_of_interest"]
    # no counters at all (a server without /metrics): the client's token count, NaN ratios
    empty = fr.fastpath_metrics({}, 50)
    assert empty["output_tokens_counted"] == 50 and math.isnan(empty["passes_per_output_token"])
    # agentserve's early-stop counters: the max_tokens left is an upper bound of the tokens saved
    for bound in ("tool_call_early_stop_budget_left", "tool_call_early_stop_budget_tokens"):
        es = fr.fastpath_metrics({"agentserve:generation_tokens": 300.0, "agentserve:tool_call_early_stops": 4.0,
                                  f"agentserve:{bound}": 100.0, "agentserve:tool_call_grace_tokens": 2.0}, 0)
        assert (es["early_stops"], es["early_stop_saved_tokens"], es["early_stop_saved_is_bound"]) == (4, 100, True)
        assert es["early_stop_saved_share"] == pytest.approx(0.25)
    # vLLM's names are found too
    v = fr.fastpath_metrics({"vllm:generation_tokens": 40.0, "vllm:spec_decode_num_draft_tokens": 20.0,
                             "vllm:spec_decode_num_accepted_tokens": 5.0}, 0)
    assert v["spec_acceptance"] == pytest.approx(0.25) and v["output_tokens_counted"] == 40


def _turn(run: int, turn: int, latency: float, out: int, expected="read_file", calls=("read_file",), ok=True):
    return {"run_id": f"r{run}", "run": run, "warmup": False, "turn": turn, "expected_tool": expected,
            "t_send": 0.0, "t_end": latency, "latency": latency, "ttft": latency / 4, "prompt_tokens": 100,
            "cached_tokens": 60, "completion_tokens": out, "finish_reason": "tool_calls", "calls": list(calls),
            "call_ok": ok, "max_tokens": 128, "error": None}


def _fake_result(server: str, scale: float) -> dict:
    turns = [_turn(r, k, scale * (k + 1), 40) for r in range(2) for k in range(3)]
    turns[0]["calls"], turns[0]["call_ok"] = [], False
    turns.append(dict(_turn(2, 0, 99.0, 0), error="HTTP 500: boom"))
    runs = [{"run_id": f"r{r}", "wall_s": scale * 6, "error": None, "context_full": False} for r in range(2)]
    runs.append({"run_id": "r2", "wall_s": 99.0, "error": "turn 0: HTTP 500", "context_full": False})
    return {"server": server, "workload": "bugfix6", "turns": turns, "runs": runs, "wall_s": 13.0,
            "counters": {"agentserve:generation_tokens": 240.0, "agentserve:engine_decode_steps": 120.0}}


def test_novel_summary_and_tables():
    rows = fr.with_ratios([fr.summarize_novel(_fake_result("vllm-cpu", 2.0)),
                           fr.summarize_novel(_fake_result("agentserve-continuum", 1.0))])
    vl, ag = rows
    assert ag["reference"] == "agentserve-continuum" and ag["vs_reference"] == pytest.approx(1.0)
    assert ag["median_latency"] == pytest.approx(2.0) and vl["vs_reference"] == pytest.approx(2.0)
    assert (ag["turns"], ag["turns_ok"], ag["errors"]) == (7, 6, 1)
    assert ag["runs_completed"] == 2 and ag["median_run_wall_s"] == pytest.approx(6.0)
    assert ag["call_rate"] == pytest.approx(5 / 6) and ag["cached_ratio"] == pytest.approx(0.6)
    assert ag["mean_output_tokens"] == 40 and ag["passes_per_output_token"] == pytest.approx(0.5)
    text = fr.novel_table(rows)
    assert "agentserve-continuum" in text and "2.00x" in text and "0.500" in text
    assert "-" in text.splitlines()[1]  # no early-stop counters: a dash
    by_turn = fr.per_turn_index(_fake_result("a", 1.0))
    assert [b["turns"] for b in by_turn] == ["1", "2", "3"] and by_turn[2]["median_latency"] == pytest.approx(3.0)
    assert fr.per_turn_index(_fake_result("a", 1.0), 5)[0]["turns"] == "1-5"
    assert "a ms" in fr.turn_index_table([_fake_result("a", 1.0)])


def test_repeat_summary():
    recs = [{"pass": p, "latency": 1.0 if p == 0 else 0.01, "cached_tokens": 90 if p else 0, "prompt_tokens": 100,
             "error": None} for p in range(3) for _ in range(4)]
    res = {"server": "s", "patterns": {"sequential": {"turns": recs, "counters": {
        "agentserve:response_cache_hits": 8.0, "agentserve:response_cache_misses": 4.0}}}}
    (row,) = fr.summarize_repeat(res)
    assert row["cold_median_latency"] == 1.0 and row["repeat_median_latency"] == 0.01
    assert row["repeat_vs_cold"] == pytest.approx(0.01) and row["response_cache_hits"] == 8
    assert row["repeat_cached_ratio"] == pytest.approx(0.9)
    assert "sequential" in fr.repeat_table([row])


def test_tool_stream_and_reply_messages():
    acc = fp.ToolStream(0.0)
    chunks = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
              {"choices": [{"delta": {"content": "Reading."}}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                                      "function": {"name": "read_file", "arguments": ""}}]}}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"path": '}}]}}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"a.py"}'}}]}}]},
              {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
              {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 7}}]
    for i, c in enumerate(chunks):
        acc.feed("data: " + json.dumps(c), 0.1 * (i + 1))
    acc.feed("data: [DONE]", 1.0)
    assert acc.calls == [{"id": "c1", "name": "read_file", "arguments": '{"path": "a.py"}'}]
    assert acc.t_first == pytest.approx(0.2) and acc.finish_reason == "tool_calls" and acc.completion_tokens == 7
    assert fp.call_ok(acc.calls[0], "read_file") and not fp.call_ok(acc.calls[0], "write_file")
    assert not fp.call_ok({"name": "read_file", "arguments": "{oops"}, "read_file")
    msgs = fp.reply_messages(acc, 0, "read_file", "print(1)")
    assert msgs[0]["content"] == "Reading." and msgs[0]["tool_calls"][0]["id"] == "c1"
    assert msgs[1] == {"role": "tool", "tool_call_id": "c1", "content": "print(1)"}
    plain = fp.ToolStream(0.0)
    plain.feed("data: " + json.dumps({"choices": [{"delta": {"content": "I will read it."}}]}), 0.1)
    msgs = fp.reply_messages(plain, 0, "read_file", "print(1)")
    assert "tool_calls" not in msgs[0] and msgs[1] == {"role": "user", "content": "Output of read_file:\nprint(1)"}
    assert fp.reply_messages(plain, 5, "summary", None) == msgs[:1]
    # a call made on a prose turn is answered (unrun), so the next request stays valid
    prose = fp.reply_messages(acc, 9, None, None)
    assert prose[0]["tool_calls"][0]["id"] == "c1"
    assert prose[1] == {"role": "tool", "tool_call_id": "c1", "content": "Not run: answer in prose."}


# ---------------------------------------------------------------------------
# live, against the tiny server (a random model: the scripted program writes a call)


@pytest.fixture(scope="module")
def server():
    from server_fixtures import ScriptedExecutor, ServerThread
    from tiny_models import byte_tokenizer, hf_llama, loaded

    from agentserve.llm import LLM
    from agentserve.server.app import create_app
    from agentserve.server.server_state import ServerConfig

    hf = hf_llama()
    hf.config.max_position_embeddings = 16384  # the byte tokenizer makes bugfix6's prompts ~8k tokens
    llm = LLM(loaded(hf, byte_tokenizer()), dtype="float32", device="cpu", kv_cache_tokens=65536, block_size=16,
              max_num_seqs=8, max_num_batched_tokens=4096)
    scripted = ScriptedExecutor(llm.engine.executor)
    llm.engine.executor = scripted
    opts = {"response_cache": 64} if "response_cache" in {f.name for f in dataclasses.fields(ServerConfig)} else {}
    srv = ServerThread(create_app(llm, ServerConfig(["tiny"], api_key=KEY, max_queue=64, **opts))).start()
    yield srv, scripted, bool(opts)
    srv.stop()


CALL = '<tool_call>{"name": "read_file", "arguments": {"path": "a.py"}}</tool_call>'


def test_bugfix6_live(server):
    srv, scripted, _ = server
    runs = nw.novel_runs("bugfix6", 2, seed=3, salt="live")
    scripted.script(runs[0].run_id, CALL)  # this run's every reply is one read_file call
    cfg = fp.AgenticConfig(srv.url + "/v1", api_key=KEY, label="tiny", max_tokens=len(CALL) + 2, concurrency=2,
                           tool_choice="auto", progress=False, request_timeout=60)
    res = fp.run_novel(runs, cfg, nw.novel_runs("bugfix6", 1, seed=3, salt="live-warmup"))
    assert res["model"] == "tiny" and res["config"]["max_context"] == 16384
    assert len(res["warmup_turns"]) == 6 and all(t["warmup"] for t in res["warmup_turns"])
    assert len(res["turns"]) == 12 and all(t["error"] is None for t in res["turns"])
    assert [r["turns_done"] for r in sorted(res["runs"], key=lambda r: r["index"])] == [6, 6]
    by = {}
    for t in res["turns"]:
        by.setdefault(t["run_id"], []).append(t)
    called = sorted(by[runs[0].run_id], key=lambda t: t["turn"])
    assert called[0]["calls"] == ["read_file"] and called[0]["call_ok"] and called[0]["finish_reason"] == "tool_calls"
    assert called[1]["calls"] == ["read_file"] and not called[1]["call_ok"]  # turn 1 expects search_code
    for ts in by.values():
        ts.sort(key=lambda t: t["turn"])
        assert [t["expected_tool"] for t in ts] == list(nw.TOOL_NAMES)
        assert ts[1]["prompt_tokens"] > ts[0]["prompt_tokens"] + len(runs[0].turns[0].result) // 2
        assert all(t["cached_tokens"] > 0 for t in ts[1:])  # the conversation's prefix is reused
        assert all(0 <= t["ttft"] <= t["latency"] for t in ts)
    c = res["counters"]
    assert c["agentserve:generation_tokens"] == sum(t["completion_tokens"] for t in res["turns"])
    row = fr.with_ratios([fr.summarize_novel(res)])[0]
    assert 0 < row["passes_per_output_token"] <= 1 and row["call_rate"] == pytest.approx(6 / 12)
    assert row["runs_completed"] == 2 and row["vs_reference"] == 1.0
    json.dumps(res)
    # a context too small for the whole run: it ends early, without errors
    small = dataclasses.replace(cfg, max_context=5000, concurrency=1)
    res = fp.run_novel(nw.novel_runs("bugfix6", 1, seed=3, salt="small"), small)
    (run,) = res["runs"]
    assert run["context_full"] and 1 <= run["turns_done"] < 6 and run["error"] is None
    assert all(t["error"] is None and t["prompt_tokens"] + t["max_tokens"] <= 5000 for t in res["turns"])
    assert fr.summarize_novel(res)["runs_context_full"] == 1


def test_repeat_live_and_cli(server, tmp_path, capsys):
    srv, _, cache_on = server
    cfg = fp.AgenticConfig(srv.url, api_key=KEY, max_tokens=4, progress=False, request_timeout=60)
    res = asyncio.run(fp.run_repeat_async(cfg, ["round-robin"], iterations=1, salt="rep", agents=2, turns=2))
    recs = res["patterns"]["round-robin"]["turns"]
    assert [(r["pass"], r["agent"], r["turn"]) for r in recs] == [(p, a, t) for p in (0, 1) for t in (0, 1)
                                                                  for a in (0, 1)]
    assert all(r["error"] is None for r in recs)
    repeats = [r for r in recs if r["pass"] == 1]
    assert all(r["cached_tokens"] > 0 for r in repeats)
    (row,) = fr.summarize_repeat(res)
    if cache_on:
        assert row["response_cache_hits"] == 4
    # the command line against the running server
    from benchmarks.agentic import main

    out = tmp_path / "a.json"
    assert main(["--url", srv.url, "--api-key", KEY, "--label", "tiny-as", "--runs", "1",
                 "--warmup", "0", "--max-tokens", "3", "--tool-choice", "required", "--json", str(out),
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "tiny-as" in printed and "median ms/turn" in printed and "by turn" in printed
    saved = json.loads(out.read_text())
    assert saved["workload"] == "bugfix6" and saved["rows"][0]["turns_ok"] == 6
    assert len(saved["results"][0]["turns"]) == 6 and saved["results"][0]["config"]["tool_choice"] == "required"


def test_peer_flags_reach_their_servers(monkeypatch, tmp_path, capsys):
    """--vllm-args goes to vllm-cpu only (after the tool flags, so it wins),
    --agentserve-args to agentserve servers only."""
    from benchmarks import agentic

    seen = {}

    class Missing:
        install_hint = "not here"

        def __init__(self, name):
            self.name = name

        def missing(self):
            return ["x"]

    def spec(name, kv_tokens, vllm_reserved_cpus=None, extra_args=()):
        seen[name] = list(extra_args)
        return Missing(name)

    monkeypatch.setattr(agentic, "server_spec", spec)
    monkeypatch.setattr(agentic, "default_peers_dir", lambda: tmp_path)
    a = agentic.build_parser().parse_args(
        ["--workload", "bugfix6", "--servers", "agentserve-continuum,vllm-cpu",
         "--vllm-args=--no-enable-prefix-caching", "--agentserve-args", "--speculate 0"])
    assert agentic._run_servers(a, "salt") == []
    assert seen["agentserve-continuum"] == ["--speculate", "0"]
    assert seen["vllm-cpu"][-1] == "--no-enable-prefix-caching" and "--tool-call-parser" in seen["vllm-cpu"]
    assert "skipping vllm-cpu" in capsys.readouterr().err
