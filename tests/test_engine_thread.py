"""The server builds the model and steps it on one thread (engine_thread.py),
and that thread checks the block accounting whenever it runs out of work."""

import logging
import threading
import time

import httpx
import pytest

from agentserve.server.app import create_app
from agentserve.server.engine_thread import EngineThread
from agentserve.server.server_state import ServerConfig
from server_fixtures import ServerThread, start_tiny_server, tiny_llm


def test_runs_jobs_in_order_on_its_own_thread():
    t = EngineThread(name="t-test")
    seen = []
    futs = [t.submit(lambda i=i: seen.append((i, threading.current_thread().name))) for i in range(5)]
    for f in futs:
        f.result(5)
    assert seen == [(i, "t-test") for i in range(5)]
    assert t.run(lambda: t.run(lambda: 7)) == 7  # a job may call run() on its own thread without deadlock
    t.close()


def test_an_exception_reaches_the_caller_and_the_thread_goes_on():
    t = EngineThread()
    with pytest.raises(ValueError, match="bad model"):
        t.run(lambda: (_ for _ in ()).throw(ValueError("bad model")))
    assert t.run(lambda: 3) == 3
    t.close()


def test_closed_thread_refuses_new_jobs():
    t = EngineThread()
    t.close()
    t._thread.join(5)
    with pytest.raises(RuntimeError, match="has exited"):
        t.submit(lambda: None)


def test_server_steps_on_the_thread_that_built_the_model():
    home = EngineThread(name="home-test")
    built_on = []

    def build():
        built_on.append(threading.current_thread().name)
        return tiny_llm()

    llm = home.run(build)
    app = create_app(llm, ServerConfig(["tiny"]), thread=home)
    server = ServerThread(app).start()
    try:
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3},
                       timeout=30)
        assert r.status_code == 200, r.text
        engine = app.state.server.engine
        assert engine.call_sync(lambda: threading.current_thread().name) == "home-test"
        assert built_on == ["home-test"]
    finally:
        server.stop()


def _wait_for(pred, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _complete(server, text: str, max_tokens: int = 3) -> None:
    r = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": "Bearer test-key"},
                   json={"model": "tiny", "prompt": text, "max_tokens": max_tokens}, timeout=30)
    assert r.status_code == 200, r.text


def test_block_accounting_is_checked_once_each_time_the_engine_goes_idle():
    server, llm, _ = start_tiny_server()
    engine = server.app.state.server.engine
    try:
        time.sleep(0.1)
        assert engine.integrity_checks == 0  # never had work
        _complete(server, "hello")
        _wait_for(lambda: engine.integrity_checks == 1)
        time.sleep(0.3)
        assert engine.integrity_checks == 1  # once per idle period, not on every idle wake
        _complete(server, "again", max_tokens=1)  # done in the step that admits it
        _wait_for(lambda: engine.integrity_checks == 2)
        assert engine.integrity_failures == 0
    finally:
        server.stop()


def test_a_failed_integrity_check_is_logged_counted_and_serving_goes_on(caplog):
    server, llm, _ = start_tiny_server()
    engine = server.app.state.server.engine

    def broken() -> None:
        raise AssertionError("block 7 is free and held by request r-1")

    llm.scheduler.check_integrity = broken
    try:
        with caplog.at_level(logging.ERROR, logger="agentserve.server"):
            _complete(server, "hello")
            _wait_for(lambda: engine.integrity_failures == 1)
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert any("KV BLOCK ACCOUNTING IS BROKEN" in r.getMessage()
                   and "block 7 is free and held by request r-1" in r.getMessage() and r.exc_info
                   for r in errors), caplog.text
        _complete(server, "still serving")
        _wait_for(lambda: engine.integrity_failures == 2)
        metrics = httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer test-key"}, timeout=30).text
        assert 'agentserve:kv_integrity_failures_total{model_name="tiny"} 2.0' in metrics
        snap = engine.call_sync(engine._snapshot)
        assert snap.kv_integrity_failures == 2
    finally:
        server.stop()
