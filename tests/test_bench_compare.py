"""`agentserve bench compare`: the table's ratios, and one live run with agentserve
itself (the peers are tested where installed, in test_bench_peers.py)."""

from __future__ import annotations

import json

import pytest

from agentserve.bench.compare import compare_rows, format_compare, router_summary
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


def test_router_summary_reads_a_clusters_decisions():
    page = ('# TYPE agentserve:router_counters gauge\n'
            'agentserve:router_counters{deployment="d",counter="affinity"} 40\n'
            'agentserve:router_counters{deployment="d",counter="escapes"} 2.0\n'
            'agentserve:router_counters{deployment="d",counter="programs_remembered"} 9\n')
    assert router_summary(page) == "affinity 40, escapes 2"
    assert router_summary(None) == "" and router_summary("agentserve:x 1\n") == ""


def test_rows_add_the_programs_after_a_restart():
    plain = dict(_result("agentserve-agentserve", 20.0), after_restart={
        "since_s": 60.0, "programs": 3, "completed": 3, "mean_jct": 21.0, "restarted": None})
    warm = dict(_result("agentserve-agentserve+state+restart", 22.0), after_restart={
        "since_s": 60.0, "programs": 3, "completed": 3, "mean_jct": 21.5, "restarted": {"at": 60.1, "down_s": 7.25}})
    rows = compare_rows([plain, warm])
    assert rows[1]["after_mean_jct"] == 21.5 and rows[1]["restarted"] == 7.25 and rows[0]["restarted"] is None
    table = format_compare(rows).splitlines()
    assert "arrived after 60 s: done" in table[0] and "restart down s" in table[0]
    assert table[1].split()[-3:] == ["3/3", "21.00", "-"] and table[2].split()[-3:] == ["3/3", "21.50", "7.2"]
    assert "arrived after" not in format_compare(compare_rows([_result("x", 1.0)]))


def test_restart_flags_are_checked(capsys):
    assert cli_main(["bench", "compare", "--servers", "agentserve-agentserve+restart"]) == 2
    assert "+restart needs --restart-at" in capsys.readouterr().err
    assert cli_main(["bench", "compare", "--servers", "agentserve-agentserve", "--restart-at", "-1"]) == 2
    assert "--restart-at" in capsys.readouterr().err
    assert cli_main(["bench", "compare", "--servers", "vllm-cpu+state"]) == 2
    assert "unknown server" in capsys.readouterr().err


def test_live_restart_with_and_without_learned_state(tmp_path, smollm_path, monkeypatch):
    """`+state+restart`: the server restarted mid-replay takes up what it learned (its state file, in
    a directory of its own under the peers dir, emptied when the run starts); every program completes."""
    monkeypatch.setenv("AGENTSERVE_PEERS_DIR", str(tmp_path))
    stale = tmp_path / "state" / "agentserve-agentserve+state+restart"
    stale.mkdir(parents=True)
    (stale / "learned-state.sqlite").write_bytes(b"from an earlier run")
    out = tmp_path / "c.json"
    rc = cli_main(["bench", "compare", "--servers", "agentserve-agentserve+state+restart", "--programs", "4",
                   "--rate", "1", "--token-scale", "0.01", "--time-scale", "0.1", "--kv-tokens", "4096",
                   "--restart-at", "1.5", "--no-progress", "--json", str(out)])
    assert rc == 0
    (row,) = json.loads(out.read_text())["rows"]
    # seed 0's programs arrive at 0, 0.32, 1.67 and 1.70 s: the last two after the restart
    assert row["done"] == "4/4" and row["restarted"] > 0 and row["after_done"] == "2/2" and row["after_s"] == 1.5
    log = (tmp_path / "logs" / "agentserve-agentserve+state+restart.log").read_text()
    assert "# restarted:" in log and "learned state saved to" in log and "learned state loaded from" in log
    assert "starting cold" not in log.split("# restarted:")[1]  # the restart took up the first run's file
    assert not list(stale.glob("*.corrupt-*"))  # the stale file was removed, not met
