"""`agentserve bench compare`: the table's ratios, and one live run with agentserve
itself (the peers are tested where installed, in test_bench_peers.py)."""

from __future__ import annotations

import json

import pytest

from agentserve.bench.compare import compare_rows, format_compare
from agentserve.cli import main as cli_main


def _result(server, mean_jct):
    return {"server": server, "completed": 4, "programs": 4, "errors": 0, "mean_jct": mean_jct, "p95_jct": 2 * mean_jct,
            "mean_ttft": 0.1, "throughput_jobs_s": 0.5, "cached_ratio": 0.8}


def test_rows_are_ratios_to_continuum():
    rows = compare_rows([_result("vllm-cpu", 30.0), _result("agentserve-continuum", 20.0)])
    assert [r["jct_vs_ref"] for r in rows] == [1.5, 1.0]
    table = format_compare(rows)
    assert "1.50x" in table and "mean JCT / agentserve-continuum" in table
    # without continuum in the run: the ratio to its first server, named in the header
    rows = compare_rows([_result("cluster-pow2", 30.0), _result("cluster-program", 20.0)])
    assert [r["jct_vs_ref"] for r in rows] == [1.0, 20.0 / 30.0]
    assert "mean JCT / cluster-pow2" in format_compare(rows) and "nan" not in format_compare(rows)


def test_unknown_server_is_a_one_line_error(capsys):
    assert cli_main(["bench", "compare", "--servers", "nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_live_compare_with_agentserve(tmp_path, smollm_path, capsys):
    out = tmp_path / "c.json"
    rc = cli_main(["bench", "compare", "--servers", "agentserve-continuum", "--programs", "2", "--rate", "2",
                   "--token-scale", "0.01", "--time-scale", "0.05", "--kv-tokens", "4096", "--no-progress",
                   "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert row["server"] == "agentserve-continuum" and row["done"] == "2/2" and row["jct_vs_ref"] == 1.0
    assert "mean JCT / agentserve-continuum" in capsys.readouterr().out
    assert "agentserve:prefix_hit_tokens" in data["results"][0]["final_metrics"]  # the server's page, kept


def test_json_keeps_the_servers_done_when_a_later_one_is_stopped(tmp_path, monkeypatch):
    """A sitting can last hours: --json is rewritten after each server, so stopping the run
    during its last server keeps the ones measured before it."""
    import argparse
    from types import SimpleNamespace

    from agentserve.bench import compare

    def fake_each(specs, run, errors):
        yield specs[0], dict(_result("agentserve-agentserve", 10.0), p50_jct=9.0, p90_jct=12.0), None
        raise KeyboardInterrupt  # stopped while the second server ran

    monkeypatch.setattr(compare, "each_server", fake_each)
    specs = [SimpleNamespace(name=n, max_model_len=8192, describe=lambda n=n: {"name": n})
             for n in ("agentserve-agentserve", "llama-server")]
    out = tmp_path / "c.json"
    a = argparse.Namespace(servers="agentserve-agentserve,llama-server", kv_tokens=4096, model="smollm2",
                           llama_server_slots=8, llama_server_kv="unified", vllm_reserved_cpus="0", vllm_block_size=128, workload="swebench", programs=2, rate=1.0,
                           seed=0, min_turns=None, max_turns=None, clamp="auto", max_output_tokens=None,
                           token_scale=0.1, time_scale=0.1, progress=False, json=str(out), plot=None, report=None)
    with pytest.raises(KeyboardInterrupt):
        compare.cmd_compare(a, specs_of=lambda *args, **kw: specs)
    data = json.loads(out.read_text())
    assert [r["server"] for r in data["results"]] == ["agentserve-agentserve"]
    assert data["rows"][0]["jct_vs_ref"] == 1.0


def test_returning_turns_ttft_and_prefetches_are_reported():
    from agentserve.bench.compare import prefetch_summary
    from agentserve.bench.replay_results import summarize

    turns = [{"program_id": "p", "turn": k, "error": None, "ttft": ttft, "latency": ttft + 1.0, "prompt_tokens": 10,
              "cached_tokens": 0, "completion_tokens": 2} for k, ttft in enumerate([3.0, 0.5, 1.5])]
    r = summarize(turns, [{"program_id": "p", "arrival": 0.0, "completed": True, "jct": 9.0, "start": 0.0,
                           "end": 9.0}], {"server": "agentserve-agentserve+host"})
    assert r["mean_ttft_returning"] == 1.0 and r["mean_ttft"] == pytest.approx(5.0 / 3)
    assert "1.000" in format_compare(compare_rows([r]))
    metrics = "\n".join(f'agentserve:prefetch_{k}_total{{model_name="m"}} {v}' for k, v in
                        [("issued", 4.0), ("used", 2.0), ("late", 1.0), ("wasted", 1.0), ("wasted_blocks", 9.0),
                         ("cancelled", 3.0), ("stage_cancelled", 5.0)])
    assert prefetch_summary(metrics) == "issued 4, used 2, late 1, wasted 1, cancelled 3"
    assert prefetch_summary(metrics.replace(" 4.0", " 0.0").replace(" 3.0", " 0.0")) == ""  # none: no line
    assert prefetch_summary(None) == ""
