"""`python -m benchmarks sched`: the steady state it measures the scheduler in is the
one asked for (running requests, pins, a queue), for pinning policies and not."""

from __future__ import annotations

import json

from benchmarks.sched_overhead import main, measure


def test_the_steady_state_holds_the_requests_pins_and_queue_asked_for():
    r = measure("continuum", running=16, pins=40, waiting=6, steps=40, warmup=10, context=64, output=8)
    assert r.running == 16 and r.waiting >= 5
    assert r.pins >= 40  # every program outside the running ones is pinned between its turns
    assert 0 < r.schedule_us <= r.median_us
    plain = measure("vllm-fcfs", running=16, pins=40, waiting=6, steps=40, warmup=10, context=64, output=8)
    assert plain.running == 16 and plain.pins == 0  # a policy that does not pin holds none


def test_cli_table_json_and_errors(tmp_path, capsys):
    out = tmp_path / "sched.json"
    assert main(["--policies", "continuum", "--running", "8", "--pins", "10", "--waiting", "2",
                     "--steps", "20", "--context", "64", "--output", "8", "--json", str(out)]) == 0
    assert "continuum" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["args"]["running"] == 8 and data["results"][0]["policy"] == "continuum"
    assert main(["--policies", "nope"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err
