"""The engine's garbage-collector policy (engine/gc_policy.py): what applying it
does to the process's collector, when its controller runs full collections,
and that the server and `python -m benchmarks sched` apply it through the same function."""

from __future__ import annotations

import gc
import logging

import httpx
import pytest

from agentserve.engine import gc_policy
from agentserve.engine.gc_policy import (ENGINE, NO_AUTO_FULL, POLICIES, PYTHON_DEFAULT, GCController, GCPolicy,
                                         apply_gc_policy, restore_gc)


@pytest.fixture(autouse=True)
def collector_restored():
    """Every test leaves the collector as CPython runs it, whatever it asserted."""
    before = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    yield
    restore_gc()
    gc.set_threshold(*before)
    assert gc.get_freeze_count() == 0


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_engine_policy_freezes_the_start_up_heap_and_stops_automatic_full_collections(caplog):
    t0, t1, _ = gc.get_threshold()
    with caplog.at_level(logging.INFO, logger="agentserve.engine"):
        ctl = apply_gc_policy(ENGINE, FakeClock())
    assert isinstance(ctl, GCController) and ctl.policy is ENGINE
    assert gc.get_freeze_count() > 0  # the start-up heap is in the permanent generation
    assert gc.get_threshold() == (t0, t1, NO_AUTO_FULL)  # young collections as CPython's; no automatic full one
    assert any("gc policy engine" in r.getMessage() and "froze" in r.getMessage() for r in caplog.records)
    restore_gc()
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == (t0, t1, 10)


def test_the_heap_is_frozen_once_a_process_not_per_call(monkeypatch):
    freezes = []
    real_freeze = gc.freeze
    monkeypatch.setattr(gc_policy.gc, "freeze", lambda: (freezes.append(1), real_freeze()))
    apply_gc_policy(ENGINE, FakeClock())
    apply_gc_policy(ENGINE, FakeClock())  # another engine in the process: nothing frozen again
    assert len(freezes) == 1
    saved = gc.get_threshold()
    restore_gc()
    assert gc.get_threshold() != saved  # CPython's thresholds back, the ones before the first apply


def test_python_policy_leaves_the_collector_alone():
    before = gc.get_threshold()
    ctl = apply_gc_policy(PYTHON_DEFAULT, FakeClock())
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before
    assert not ctl.on_idle() and not ctl.maybe_collect()  # CPython runs its own full collections


def test_young_threshold_is_set_when_asked():
    apply_gc_policy(GCPolicy("test", freeze=False, young_threshold=5000, manual_full=False), FakeClock())
    assert gc.get_threshold()[0] == 5000


def test_full_collections_run_when_idle_at_most_so_often_and_as_a_busy_backstop(monkeypatch):
    collections = []
    monkeypatch.setattr(gc_policy.gc, "collect", lambda *a: collections.append(a) or 0)
    clock = FakeClock()
    ctl = GCController(GCPolicy("test", idle_full_interval_s=60, busy_full_interval_s=600), clock)
    assert not ctl.on_idle()  # just started: nothing is due
    clock.t = 61
    assert ctl.on_idle() and len(collections) == 1 and ctl.full_collections == 1
    clock.t = 100
    assert not ctl.on_idle()  # the last one was 39 s ago
    clock.t = 600
    assert not ctl.maybe_collect()  # busy: only once 600 s passed without one
    clock.t = 661
    assert ctl.maybe_collect() and len(collections) == 2
    assert not ctl.maybe_collect()


def test_the_policies_by_name():
    assert POLICIES == {"engine": ENGINE, "python": PYTHON_DEFAULT}
    assert ENGINE.freeze and ENGINE.manual_full and not PYTHON_DEFAULT.freeze and not PYTHON_DEFAULT.manual_full


def test_bench_sched_applies_the_same_policy_and_puts_the_collector_back(monkeypatch):
    from benchmarks import sched_overhead

    applied = []
    real = sched_overhead.apply_gc_policy
    monkeypatch.setattr(sched_overhead, "apply_gc_policy", lambda p, clock: applied.append(p) or real(p, clock))
    r = sched_overhead.measure("continuum", running=8, pins=10, waiting=2, steps=20, warmup=5, context=64, output=8)
    assert applied == [ENGINE] and r.gc == "engine"
    assert gc.get_freeze_count() == 0 and gc.get_threshold()[2] != NO_AUTO_FULL
    assert r.median_us <= r.p99_us <= r.max_us and r.mean_us > 0
    r = sched_overhead.measure("continuum", running=8, pins=10, waiting=2, steps=20, warmup=5, context=64, output=8,
                               gc_policy=PYTHON_DEFAULT)
    assert applied[-1] is PYTHON_DEFAULT and r.gc == "python"


def test_the_server_applies_its_policy_at_start_and_restores_it_at_stop():
    from agentserve.server.app import create_app
    from agentserve.server.server_state import ServerConfig
    from server_fixtures import ServerThread, tiny_llm

    app = create_app(tiny_llm(), ServerConfig(["tiny"], gc_policy=ENGINE))
    engine = app.state.server.engine
    assert engine.gc is None and gc.get_freeze_count() == 0  # applied when the engine starts, not before
    server = ServerThread(app).start()
    try:
        assert engine.gc is not None and engine.gc.policy is ENGINE
        assert gc.get_freeze_count() > 0 and gc.get_threshold()[2] == NO_AUTO_FULL
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200, r.text
    finally:
        server.stop()
    assert engine.gc is None and gc.get_freeze_count() == 0 and gc.get_threshold()[2] != NO_AUTO_FULL


def test_serve_takes_the_policy_by_name():
    import argparse

    from agentserve.cli_serve import add_serve

    p = argparse.ArgumentParser()
    add_serve(p.add_subparsers())
    assert p.parse_args(["serve"]).gc == "engine"
    assert p.parse_args(["serve", "--gc", "python"]).gc == "python"
