"""`python -m benchmarks restart-replay` (benchmarks/restart_replay.py): the `+state` and
`+restart` servers, the replay held while a server restarts, the table's columns, and one live
run with agentserve restarted mid-replay."""

from __future__ import annotations

import json
import threading
import time

import pytest

from agentserve.bench import replay_client as rcl
from agentserve.bench.compare import compare_lines, compare_rows
from agentserve.bench.peers.specs import UnknownServerError, server_spec
from agentserve.workload.trace import Program, TraceCall
from benchmarks import restart_replay as rr

KEY = "restart-key"


def test_state_and_restart_suffixes_of_an_agentserve_name(tmp_path):
    run = rr.run_spec("agentserve-agentserve+state+host+restart:running_share=1", 32768, peers_dir=tmp_path)
    plain = server_spec("agentserve-agentserve+host", 32768, peers_dir=tmp_path)
    s = run.spec
    assert run.restart and s.port == plain.port
    assert run.state_dir.parent == tmp_path / "state" and ":" not in run.state_dir.name
    argv = list(s.argv)
    assert argv[argv.index("--state-dir") + 1] == str(run.state_dir) and "--host-kv-tokens" in argv
    assert argv[argv.index("--policy") + 1] == "agentserve:running_share=1"
    assert s.name == "agentserve-agentserve+state+host+restart:running_share=1"
    assert s.log_path == plain.log_path.with_name("agentserve-agentserve+state+host+restart:running_share=1.log")
    r = rr.run_spec("agentserve-continuum+restart", 32768, peers_dir=tmp_path)
    assert r.restart and r.state_dir is None and "--state-dir" not in r.spec.argv
    p = rr.run_spec("agentserve-continuum", 32768, peers_dir=tmp_path)
    assert not p.restart and p.state_dir is None and p.spec == server_spec("agentserve-continuum", 32768,
                                                                            peers_dir=tmp_path)
    for bad in ("llama.cpp+state", "agentserve-agentserve+disk", "cluster-program+restart", "vllm-cpu+state"):
        with pytest.raises(UnknownServerError):
            rr.run_spec(bad, 32768)


def _result(server, mean_jct, arrivals):
    progs = [{"program_id": f"p{i}", "arrival": t, "completed": True, "jct": mean_jct} for i, t in enumerate(arrivals)]
    return {"server": server, "completed": len(progs), "programs": len(progs), "errors": 0, "mean_jct": mean_jct,
            "p95_jct": 2 * mean_jct, "mean_ttft": 0.1, "throughput_jobs_s": 0.5, "cached_ratio": 0.8,
            "program_results": progs, "turns": []}


def test_rows_add_the_programs_after_a_restart():
    results = [_result("agentserve-agentserve", 20.0, [0.0, 30.0, 60.0, 61.0, 90.0]),
               _result("agentserve-agentserve+state+restart", 21.5, [0.0, 30.0, 60.0, 61.0, 90.0])]
    rows = compare_rows(results)
    lines = compare_lines(rows)
    rr.widen_table(60.0, {"agentserve-agentserve+state+restart": {"at": 60.1, "down_s": 7.25}})(results, rows, lines)
    assert rows[1]["after_mean_jct"] == 21.5 and rows[1]["restarted"] == 7.25 and rows[0]["restarted"] is None
    assert rows[0]["after_done"] == "3/3" and rows[0]["after_s"] == 60.0
    assert results[0]["after_restart"]["restarted"] is None and results[1]["after_restart"]["programs"] == 3
    assert "arrived after 60 s: done" in lines[0] and "restart down s" in lines[0]
    assert lines[1][-3:] == ["3/3", "20.00", "-"] and lines[2][-3:] == ["3/3", "21.50", "7.2"]


def test_restart_flags_are_checked(capsys):
    with pytest.raises(SystemExit):
        rr.main(["--servers", "agentserve-agentserve+restart"])  # --restart-at is required
    assert "--restart-at" in capsys.readouterr().err
    assert rr.main(["--servers", "agentserve-agentserve", "--restart-at", "-1"]) == 2
    assert "--restart-at must be" in capsys.readouterr().err
    assert rr.main(["--servers", "vllm-cpu+state", "--restart-at", "10"]) == 2
    assert "unknown server" in capsys.readouterr().err


def _program(pid: str, arrival: float, turns: int, sleep: float = 0.05) -> Program:
    calls, prompt = [], 120
    for k in range(turns):
        last = k == turns - 1
        calls.append(TraceCall(pid, k, arrival + k * sleep, prompt, prompt if k == 0 else 40, 6,
                               None if last else "bash", 0.0 if last else sleep, shared_prefix_tokens=60))
        prompt += 46
    return Program(pid, calls)


@pytest.fixture(scope="module")
def server():
    from server_fixtures import start_tiny_server

    srv, _, _ = start_tiny_server(api_key=KEY)
    yield srv
    srv.stop()


def test_a_restart_in_the_middle_holds_the_turns_and_splits_the_programs(server):
    """No turn is sent while the restart runs, the programs arriving from then on are summed up
    apart, and a run that is not restarted gets the same split."""
    calls = []

    def restart() -> float:
        assert threading.current_thread() is not threading.main_thread()  # off the event loop
        calls.append(time.perf_counter())
        time.sleep(0.4)
        return 0.4

    def cfg(**kw):
        return rcl.ReplayConfig(server.url, model="tiny", api_key=KEY, tokens_per_word=6.0, progress=False,
                                request_timeout=30, **kw)

    progs = [_program("before", 0.0, 4, sleep=0.15), _program("after", 0.35, 2), _program("later", 0.5, 2)]
    record: dict = {}
    res = rcl.replay(progs, cfg(retry_failed_turns=2, beside=rr.restart_in_the_middle(0.2, restart, record)))
    assert res["completed"] == 3 and len(calls) == 1
    after = rr.after_restart(res, 0.2, record)
    at = after["restarted"]["at"]
    assert at == pytest.approx(0.2, abs=0.1) and after["restarted"]["down_s"] == 0.4
    assert not [t for t in res["turns"] if at < t["t_send"] < at + 0.4]  # held while down
    assert (after["since_s"], after["programs"], after["completed"]) == (0.2, 2, 2)
    jcts = {p["program_id"]: p["jct"] for p in res["program_results"]}
    assert after["mean_jct"] == pytest.approx((jcts["after"] + jcts["later"]) / 2)
    # no restart: the same split, nothing held
    after = rr.after_restart(rcl.replay(progs, cfg()), 0.2, None)
    assert after["programs"] == 2 and after["restarted"] is None
    # every program over before its time: the restart never runs
    calls.clear()
    record = {}
    res = rcl.replay(progs[:1], cfg(beside=rr.restart_in_the_middle(60.0, restart, record)))
    assert res["completed"] == 1 and not calls and rr.after_restart(res, 60.0, record)["programs"] == 0
    assert rr.after_restart(res, 60.0, record)["restarted"] is None


def test_live_restart_with_and_without_learned_state(tmp_path, smollm_path, monkeypatch):
    """`+state+restart`: the server restarted mid-replay takes up what it learned (its state file, in
    a directory of its own under the peers dir, emptied when the run starts); every program completes."""
    monkeypatch.setenv("AGENTSERVE_PEERS_DIR", str(tmp_path))
    stale = tmp_path / "state" / "agentserve-agentserve+state+restart"
    stale.mkdir(parents=True)
    (stale / "learned-state.sqlite").write_bytes(b"from an earlier run")
    out = tmp_path / "c.json"
    rc = rr.main(["--servers", "agentserve-agentserve+state+restart", "--programs", "4", "--rate", "1",
                  "--token-scale", "0.01", "--time-scale", "0.1", "--kv-tokens", "4096", "--restart-at", "1.5",
                  "--no-progress", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    # seed 0's programs arrive at 0, 0.32, 1.67 and 1.70 s: the last two after the restart
    assert row["done"] == "4/4" and row["restarted"] > 0 and row["after_done"] == "2/2" and row["after_s"] == 1.5
    assert data["results"][0]["after_restart"]["restarted"]["down_s"] == row["restarted"]
    log = (tmp_path / "logs" / "agentserve-agentserve+state+restart.log").read_text()
    assert "# restarted:" in log and "learned state saved to" in log and "learned state loaded from" in log
    assert "starting cold" not in log.split("# restarted:")[1]  # the restart took up the first run's file
    assert not list(stale.glob("*.corrupt-*"))  # the stale file was removed, not met
