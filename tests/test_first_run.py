"""A first run that just works: the README's first command installs what a
forced tool call needs, and a server without it answers a forced call with a
400 that says how to install it, never with free text."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import httpx
import pytest

from server_fixtures import start_tiny_server

ROOT = Path(__file__).resolve().parent.parent
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
           {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def test_the_readmes_first_command_installs_the_structured_extra():
    readme = (ROOT / "README.md").read_text()
    first = next(line for line in readme.splitlines() if "pip install" in line)
    assert re.search(r"-e '?\.\[[^\]]*structured[^\]]*\]'?", first), first
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^structured = \[[^\]]*"xgrammar', pyproject, re.M)


@pytest.fixture
def server_without_xgrammar(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    srv, llm, _ = start_tiny_server(api_key=None)
    srv.llm, srv.engine = llm, srv.app.state.server.engine
    yield srv
    srv.stop()


def test_a_forced_call_without_xgrammar_is_a_400_that_says_how_to_install_it(server_without_xgrammar):
    srv = server_without_xgrammar
    body = {"model": "tiny", "max_tokens": 8, "tools": WEATHER, "messages": [{"role": "user", "content": "time?"}]}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        for stream in (False, True):
            r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "tool_choice": choice, "stream": stream},
                           timeout=30)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert "pip install 'agentserve[structured]'" in err["message"]
            assert (err["param"], err["code"]) == ("tool_choice", "structured_output_unavailable")
    # nothing reached the engine; an unforced choice still runs
    assert srv.llm.scheduler.stats.prefill_tokens == 0
    r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "tool_choice": "auto"}, timeout=30)
    assert r.status_code == 200
    deadline = time.monotonic() + 10
    while srv.engine.call_sync(lambda: srv.llm.engine.has_unfinished):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    srv.engine.call_sync(srv.llm.check_integrity)
