"""The failover benchmark's pure parts: counters from /metrics, per-turn accounting
(cut streams, duplicates, losses) and the re-prefill cost, from fake records."""

import json

from benchmarks import cluster_failover as cf


def rec(pid, turn, t_send, prompt=100, cached=0, out=5, error=None):
    return {"program_id": pid, "turn": turn, "t_send": t_send, "prompt_tokens": prompt, "cached_tokens": cached,
            "completion_tokens": out, "error": error}


def result(turns, programs, mean_jct=2.0):
    return {"turns": turns, "program_results": programs, "mean_jct": mean_jct}


CUT = "error event: the engine replica serving this stream failed; retry the request"


def test_parse_counters():
    text = ("# HELP agentserve:cluster_retries_total x\nagentserve:cluster_retries_total 3\n"
            "agentserve:cluster_failed_streams_total 1\nagentserve:cluster_replicas_answering 2\n")
    assert cf.parse_counters(text) == {"retries": 3.0, "failed_streams": 1.0, "unavailable": 0.0}


def test_turn_counts_and_report():
    killed = result([rec("a", 0, 0.0), rec("a", 1, 5.0, cached=60), rec("b", 0, 1.0),
                     rec("b", 1, 6.0, out=0, error=CUT), rec("c", 0, 2.0), rec("c", 0, 2.0),
                     rec("c", 1, 7.0, out=0)],
                    [{"turns": 2, "completed": True}, {"turns": 3, "completed": False},
                     {"turns": 2, "completed": True}])
    c = cf.turn_counts(killed)
    assert (c["programs"], c["completed"], c["turns_planned"], c["turns_sent"]) == (3, 2, 7, 6)
    assert (c["turns_error"], c["streams_cut"], c["other_errors"]) == (1, 1, 0)
    assert (c["duplicates"], c["lost"], c["not_sent"]) == (1, 1, 1)
    base = result([rec("a", 0, 0.0), rec("a", 1, 3.0, cached=90), rec("b", 0, 4.5), rec("c", 1, 4.0, cached=50)],
                  [{"turns": 2, "completed": True}, {"turns": 1, "completed": True}], mean_jct=1.5)
    rep = cf.build_report(killed, 4.0, "SERVE_REPLICA::agentserve#EngineReplica#x", {"retries": 1.0},
                          {"retries": 3.0, "failed_streams": 1.0}, base, 3.0)
    assert rep["killed"]["after_kill"] == {"turns": 2, "prompt_tokens": 200, "uncached_tokens": 140}
    assert rep["baseline"]["after_kill"] == {"turns": 2, "prompt_tokens": 200, "uncached_tokens": 60}
    assert rep["extra_uncached_tokens"] == 80
    assert rep["ingress"] == {"retries": 2.0, "failed_streams": 1.0, "unavailable": 0.0}
    text = cf.format_report(rep)
    assert "streams cut by the kill" in text and "+80 uncached" in text and "did not resend" in text
    json.dumps(rep)


def test_resent_turns_are_not_duplicates():
    """A cut turn the client sent again: one failed record, one answered: no duplicate, one resend."""
    r = result([rec("a", 0, 0.0), rec("a", 1, 2.0, out=0, error=CUT), {**rec("a", 1, 2.5), "attempt": 1}],
               [{"turns": 2, "completed": True}])
    c = cf.turn_counts(r)
    assert (c["turns_sent"], c["turns_ok"], c["streams_cut"], c["turns_resent"], c["duplicates"]) == (2, 2, 1, 1, 0)
    assert c["responses_per_turn"] == 1.0
    rep = cf.build_report(r, 1.0, "v", {}, {}, client_retries=2)
    assert "did not resend" not in cf.format_report(rep) and "turns resent by the client" in cf.format_report(rep)


def test_report_without_kill_or_baseline():
    r = result([rec("a", 0, 0.0)], [{"turns": 1, "completed": True}])
    rep = cf.build_report(r, None, None, {}, {})
    assert rep["killed"]["after_kill"]["turns"] == 0 and "baseline" not in rep
    assert "no replica was killed" in cf.format_report(rep)


def test_shared_disk_run_beside_todays_kill():
    """--shared-disk-kv: the second cluster's kill run (its replicas share a disk KV directory)
    set beside today's: uncached tokens after each kill, the replicas' shared_kv counters."""
    today = result([rec("a", 0, 0.0), rec("a", 1, 5.0, cached=10), rec("b", 1, 6.0, cached=20)],
                   [{"turns": 2, "completed": True}, {"turns": 2, "completed": True}])
    shared = result([rec("a", 0, 0.0), rec("a", 1, 5.2, cached=90), rec("b", 1, 6.1, cached=80)],
                    [{"turns": 2, "completed": True}, {"turns": 2, "completed": True}], mean_jct=1.8)
    rep = cf.build_report(today, 4.0, "v", {}, {})
    metrics = cf.parse_prometheus(
        'agentserve:shared_kv_blocks_imported_total{replica="r1",model_name="m"} 6.0\n'
        'agentserve:shared_kv_blocks_imported_total{replica="r2",model_name="m"} 4.0\n'
        'agentserve:shared_kv_blocks_written_total{replica="r1",model_name="m"} 30.0\n')
    cf.shared_report(rep, shared, 4.1, {"retries": 0.0}, {"retries": 1.0}, metrics)
    assert rep["killed"]["after_kill"]["uncached_tokens"] == 170
    assert rep["shared"]["after_kill"] == {"turns": 2, "prompt_tokens": 200, "uncached_tokens": 30}
    assert rep["shared_saved_tokens"] == 140 and rep["shared"]["ingress"]["retries"] == 1.0
    assert (rep["shared"]["shared_kv_blocks_imported"], rep["shared"]["shared_kv_blocks_written"],
            rep["shared"]["shared_kv_files_rejected"]) == (10.0, 30.0, 0.0)
    text = cf.format_report(rep)
    assert "kill+shared" in text.splitlines()[0]
    assert "30 uncached prompt tokens after its kill against 170 without (+140 fewer)" in text
    assert "10 blocks reloaded" in text
    json.dumps(rep)
