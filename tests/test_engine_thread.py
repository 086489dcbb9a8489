"""The server builds the model and steps it on one thread (engine_thread.py)."""

import threading

import httpx
import pytest

from agentserve.server.app import ServerConfig, create_app
from agentserve.server.engine_thread import EngineThread
from server_fixtures import ServerThread, tiny_llm


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
