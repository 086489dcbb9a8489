"""`python -m benchmarks soak`: the response bookkeeping against servers that lose,
duplicate or fail answers (an in-memory transport), the figures' arithmetic,
and the 60-second soak itself: the command starts `agentserve serve` on a
tiny GGUF model and its misbehaving programs must leave nothing behind."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.soak import passed, rss_mb, run_soak, slope_per_min
from benchmarks.soak_client import SoakClients, SoakConfig, StreamCheck

ROOT = Path(__file__).resolve().parents[1]


def _sse(*events: str) -> list[str]:
    return [f"data: {e}" for e in events]


CHUNK = json.dumps({"id": "c1", "choices": [{"delta": {"content": "hi"}, "finish_reason": None}]})
FINISH = json.dumps({"id": "c1", "choices": [{"delta": {}, "finish_reason": "stop"}]})
USAGE = json.dumps({"id": "c1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}})


@pytest.mark.parametrize("events, outcome", [
    (_sse(CHUNK, FINISH, USAGE, "[DONE]"), "complete"),
    (_sse(CHUNK, FINISH, USAGE), "lost"),  # no [DONE]: the stream was cut
    (_sse(CHUNK), "lost"),
    ([], "lost"),
    (_sse(CHUNK, FINISH, FINISH, USAGE, "[DONE]"), "duplicated"),
    (_sse(CHUNK, FINISH, USAGE, "[DONE]", "[DONE]"), "duplicated"),
    (_sse(CHUNK, FINISH.replace("c1", "c2"), USAGE, "[DONE]"), "duplicated"),  # chunks of two responses
    (_sse(CHUNK, json.dumps({"error": {"message": "engine failed"}}), "[DONE]"), "error"),
])
def test_stream_outcomes(events, outcome):
    check = StreamCheck()
    for line in events:
        check.feed(line)
    assert check.outcome() == outcome


def test_figures_arithmetic():
    assert slope_per_min([(0, 100.0), (60, 101.0), (120, 102.0)]) == pytest.approx(1.0)
    assert slope_per_min([(0, 5.0), (30, 5.0), (60, 5.0), (90, 5.0)]) == 0.0
    assert slope_per_min([(0, 1.0), (1, 2.0)]) is None
    assert 1 < rss_mb(os.getpid()) < 100_000 and rss_mb(2**22 + 12345) is None


class _Server:
    """An in-memory server whose chat answers are good, cut, doubled, 500s or never come."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.n = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text="agentserve:kv_cache_blocks 10\nagentserve:kv_cache_free_blocks 10\n"
                                            "agentserve:pinned_blocks 0\nagentserve:kv_integrity_failures 0\n")
        if request.url.path == "/v1/models":
            ok = request.headers.get("authorization") in (None, "Bearer k0")
            return httpx.Response(200 if ok else 401, json={"data": [{"id": "m"}]})
        try:
            body = json.loads(request.content)
        except ValueError:
            body = None
        if not isinstance(body, dict) or body.get("model") != "m" or not isinstance(body.get("messages"), list) or \
                body.get("n") or (body.get("max_tokens") or 1) < 0 or (body.get("max_tokens") or 1) > 10**6 or \
                len(body.get("program_id") or "") > 256 or any(m.get("role") == "wizard" for m in body["messages"]):
            return httpx.Response(500 if self.mode == "500-on-invalid" else 400, json={"error": {"message": "bad"}})
        self.n += 1
        rid = "dup" if self.mode == "same-id" else f"c{self.n}"
        if self.mode == "never":
            raise httpx.ReadTimeout("no answer", request=request)
        if not body.get("stream"):
            return httpx.Response(200, json={"id": rid, "choices": [
                {"message": {"content": "ok"}, "finish_reason": "stop"}]})
        events = [json.dumps({"id": rid, "choices": [{"delta": {"content": "o"}, "finish_reason": None}]})] * 5
        events += [json.dumps({"id": rid, "choices": [{"delta": {}, "finish_reason": "stop"}]})]
        if self.mode == "double-finish":
            events += events[-1:]
        events += [json.dumps({"id": rid, "choices": [], "usage": {"prompt_tokens": 1}})]
        if self.mode != "cut":
            events += ["[DONE]"]
        return httpx.Response(200, text="".join(f"data: {e}\n\n" for e in events),
                              headers={"content-type": "text/event-stream"})


def _soak_against(mode: str, **cfg) -> SoakClients:
    async def go() -> SoakClients:
        transport = httpx.MockTransport(_Server(mode))
        async with httpx.AsyncClient(transport=transport, base_url="http://soak.test") as client:
            c = SoakConfig(model="m", programs=6, duration_s=0.5, tool_s=(0.0, 0.01), p_invalid=0.3, **cfg)
            clients = SoakClients(c, client, "t")
            await clients.run(time.monotonic() + c.duration_s)
            return clients
    return asyncio.run(go())


def test_the_tally_sees_what_a_server_gets_wrong():
    good = _soak_against("good").tally
    assert good.requests > 20 and good.complete + good.dropped == good.requests
    assert good.lost == good.duplicated == good.server_errors == 0 and good.dropped > 0
    assert good.programs_ended > 0 and good.programs_quiet >= 0
    assert good.invalid_sent > 0 and set(good.invalid_status) <= {400}
    cut = _soak_against("cut", p_disconnect=0.0).tally
    assert cut.lost > 0 and cut.duplicated == 0 and cut.examples
    assert _soak_against("double-finish", p_disconnect=0.0).tally.duplicated > 0
    same = _soak_against("same-id").tally
    assert same.duplicated == same.requests - same.dropped - 1  # every answer after the first reuses its id
    assert _soak_against("500-on-invalid").tally.server_errors > 0
    assert _soak_against("never").tally.lost > 0


def test_a_key_the_server_does_not_take_is_reported_at_once():
    async def go():
        transport = httpx.MockTransport(_Server("good"))
        cfg = SoakConfig(model="m", programs=1, duration_s=1, keys=["k0", "k1"])
        import benchmarks.soak as soak
        real = soak.httpx.AsyncClient
        soak.httpx.AsyncClient = lambda **kw: real(transport=transport, **kw)
        try:
            await run_soak("http://soak.test", cfg, None, 1.0, 1.0, 0.0)
        finally:
            soak.httpx.AsyncClient = real
    with pytest.raises(RuntimeError, match="only one key"):
        asyncio.run(go())


def test_a_sixty_second_soak_leaves_nothing_behind(tmp_path):
    """The CI version of the measured soak: `python -m benchmarks soak` starts a server on a tiny GGUF model."""
    pytest.importorskip("gguf")
    sys.path.insert(0, str(ROOT / "tests"))
    from gguf_fixtures import write_tiny_gguf

    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model)
    out = tmp_path / "soak.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "soak", "--model", str(model),
                           "--programs", "16", "--duration", "60", "--sample-s", "5", "--settle-s", "90",
                           "--p-disconnect", "0.15", "--p-quiet", "0.1", "--p-invalid", "0.15",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout and "leaked blocks   0" in proc.stdout
    result = json.loads(out.read_text())
    f, t = result["figures"], result["tally"]
    assert f["leaked_blocks"] == 0 and f["lost"] == 0 and f["duplicated"] == 0 and f["server_errors"] == 0
    assert f["integrity_failures"] == 0 and f["invalid_not_4xx"] == 0 and passed(result)
    assert result["end"]["pinned_blocks"] == 0 and result["end"]["free"] == result["start"]["free"]
    # the misbehaviour really happened
    assert t["dropped_by_client"] > 0 and t["programs_quiet"] > 0 and t["invalid_sent"] > 0
    assert t["complete"] > 50 and t["programs_ended"] > 10
    rss = [s["rss_mb"] for s in result["samples"] if s.get("rss_mb")]
    assert len(rss) >= 10 and f["rss_peak_mb"] >= f["rss_start_mb"] > 50
    assert (tmp_path / "soak.server.log").exists()
