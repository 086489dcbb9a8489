"""What the server learned survives a restart (`serve --state-dir`, server/learned_state.py):
the objects' export and import, the SQLite file written atomically and read back, and a file
that cannot be used (corrupt, foreign, another schema version, another model) moved aside
with one log line while the server starts cold."""

from __future__ import annotations

import logging
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agentserve.clock import SimClock
from agentserve.engine.scheduler import Scheduler
from agentserve.engine.scheduler_config import SchedulerConfig
from agentserve.engine.step_time import StepTimeModel
from agentserve.kv.manager import KVCacheManager
from agentserve.policy.tool_stats import ToolDurationStats
from agentserve.policy.ttl import EtaEstimator, QueueDelayWindow
from agentserve.server import learned_state as ls

IDENTITY = {"model": "tiny-llama (llama layers=2 hidden=64 heads=4/2 vocab=320)", "runner": "cpu float32 fp32"}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def scheduler(policy: str = "agentserve") -> Scheduler:
    return Scheduler(SchedulerConfig(), KVCacheManager(64, 4), policy, SimClock(), lambda n: 0.001 * n)


def teach(s: Scheduler, seed: int = 0) -> None:
    """Give `s` something learned: durations of three tools past the TTL model's K, finished
    programs for eta, queueing delays, and steps for the step-time fit."""
    rng = random.Random(seed)
    stats = s.policy.tool_stats
    for _ in range(400):
        tool = rng.choice(["bash", "search", "edit"])
        stats.record(tool, rng.expovariate(1 / {"bash": 2.0, "search": 0.5, "edit": 8.0}[tool]))
    for _ in range(40):
        s.policy.eta.add_program(rng.randint(1, 30))
        s.policy.queue_delays.add(rng.random())
    for _ in range(120):
        p = rng.choice([0, 0, 32, 128, 256])
        d = rng.randint(0 if p else 1, 8)
        s.step_model.observe(p, p * p // 2, d, d * rng.randint(10, 900), 0.005 + 2e-5 * p + 1e-3 * d + 1e-4 * rng.random())


class _Req:
    def __init__(self, tool: str, tokens: int) -> None:
        self.tool_name, self.num_computed_tokens, self.ttl_hint = tool, tokens, None


def predictions(s: Scheduler) -> list:
    """What the learned state decides: each tool's TTL by Eq. 2 and its regime (at a given pin cost:
    the KV pressure that sets it is the load of the moment, not kept), eta, the step time of a few steps."""
    pol = s.policy
    out = [pol.model.decide(t, r) for t in ("bash", "search", "edit", "get_weather", "never-seen") for r in (0.01, 3.0)]
    out += [pol.eta.value(), pol.queue_delays.mean(), pol.tool_stats.global_mean(), pol.tool_stats.tools()]
    out += [pytest.approx(s.step_model.predict(p, p * p // 2, d, d * 500), rel=1e-9)
            for p, d in ((0, 4), (128, 0), (256, 8))]
    out.append(pytest.approx(s.step_model.margin))
    return out


# --- the objects' state ------------------------------------------------------------------------


def test_tool_stats_round_trip_keeps_windows_order_and_versions_fresh():
    a = ToolDurationStats(max_samples_per_tool=50, max_global_samples=120)
    rng = random.Random(1)
    for _ in range(300):
        a.record(rng.choice("xyz"), rng.random())
    b = ToolDurationStats(max_samples_per_tool=50, max_global_samples=120)
    b.record("old", 1.0)
    b.import_state(a.export_state())
    assert b.tools() == a.tools() and "old" not in b.tools()
    for t in a.tools():
        assert b.samples(t) == a.samples(t) and b.sorted_samples(t) == a.sorted_samples(t)
        assert b.mean(t) == pytest.approx(a.mean(t))
    assert b.global_samples() == a.global_samples() and b.global_mean() == pytest.approx(a.global_mean())
    assert b.version("x") > 0  # a changed window gets a new version (cached sorted tuples are rebuilt)
    small = ToolDurationStats(max_samples_per_tool=10, max_global_samples=20, max_tools=2)
    small.import_state(a.export_state())  # smaller windows keep the newest samples, the latest tools
    assert small.tools() == a.tools()[-2:]
    assert small.samples(a.tools()[-1]) == a.samples(a.tools()[-1])[-10:]
    assert small.global_samples() == a.global_samples()[-20:]


@pytest.mark.parametrize("bad", [{"tools": [["t", [1.0, -2.0]]], "global": []},
                                 {"tools": [["t", [float("nan")]]], "global": []},
                                 {"tools": [["", [1.0]]], "global": []},
                                 {"tools": [["t", [1.0]]], "global": [[1.0]]},
                                 {"tools": [["t", [1.0]]]}])
def test_tool_stats_refuse_malformed_state_and_change_nothing(bad):
    s = ToolDurationStats()
    s.record("keep", 3.0)
    with pytest.raises(ValueError):
        s.import_state(bad)
    assert s.tools() == ["keep"] and s.global_samples() == (3.0,)


def test_eta_and_queue_windows_round_trip():
    eta, q = EtaEstimator(window=8), QueueDelayWindow(window=8)
    for n in (1, 3, 7, 2, 9, 4, 12, 5, 6, 30):
        eta.add_program(n)
        q.add(n / 10)
    eta2, q2 = EtaEstimator(window=8), QueueDelayWindow(window=8)
    eta2.import_state(eta.export_state())
    q2.import_state(q.export_state())
    assert eta2.value() == eta.value() and len(eta2) == 8 and eta2.num_pairs() == eta.num_pairs()
    assert q2.mean() == pytest.approx(q.mean())
    for bad in ([0], [2.5], ["3"], [True]):
        with pytest.raises(ValueError):
            eta2.import_state(bad)
    with pytest.raises(ValueError):
        q2.import_state([float("inf")])
    assert eta2.value() == eta.value() and q2.mean() == pytest.approx(q.mean())


def test_step_time_round_trip_predicts_the_same():
    s = scheduler()
    teach(s)
    m = StepTimeModel()
    m.import_state(s.step_model.export_state())
    assert m.ready and m.margin == s.step_model.margin
    for p, a, d, k in ((0, 0, 4, 2000), (200, 20000, 3, 900), (512, 131072, 0, 0)):
        assert m.predict(p, a, d, k) == pytest.approx(s.step_model.predict(p, a, d, k), rel=1e-9)
    assert m.max_chunk(100, 0.05) == s.step_model.max_chunk(100, 0.05)
    with pytest.raises(ValueError):
        m.import_state({"prefill": [[1.0, 2.0]], "decode": [], "ratios": []})  # too few features
    assert m.predict(10, 55, 1, 10) == pytest.approx(s.step_model.predict(10, 55, 1, 10), rel=1e-9)


def test_policy_import_is_all_or_nothing():
    s = scheduler()
    teach(s)
    before = predictions(s)
    state = ls.export_learned(s)
    state["step_time"]["decode"].append([1.0, 0, 0, 0, 0, 0, 0, -1.0])  # negative seconds
    with pytest.raises(ValueError):
        ls.import_learned(s, state)
    state = ls.export_learned(scheduler())  # a fresh one's (empty) state, with a bad eta
    state["policy"]["eta"] = [3, 0]
    with pytest.raises(ValueError):
        ls.import_learned(s, state)
    assert predictions(s) == before


# --- the file ----------------------------------------------------------------------------------


def test_file_round_trip_gives_the_same_predictions(tmp_path):
    a = scheduler()
    teach(a)
    path = tmp_path / "state.sqlite"
    ls.write_state(path, ls.export_learned(a), IDENTITY)
    b = scheduler()
    keeper = ls.LearnedState(path, IDENTITY)
    assert keeper.load(b)
    assert predictions(b) == predictions(a)
    assert b.policy.solve(_Req("bash", 64))[1].regime == "tool"  # learned, not the cold-start default
    assert scheduler().policy.solve(_Req("bash", 64))[1].regime == "default"
    # the tables an operator can query
    con = sqlite3.connect(path)
    means = dict(con.execute("SELECT tool, avg(seconds) FROM tool_samples JOIN tools USING (position) "
                             "GROUP BY tool"))
    con.close()
    assert means["edit"] == pytest.approx(a.policy.tool_stats.mean("edit"))


def test_a_policy_without_a_ttl_model_keeps_the_tool_statistics(tmp_path):
    a = scheduler("vllm-fcfs")
    a.policy.tool_stats.record("bash", 2.0)
    path = tmp_path / "s.sqlite"
    ls.write_state(path, ls.export_learned(a), IDENTITY)
    b = scheduler("continuum")  # another policy takes up the tool statistics; eta stays its own
    assert ls.LearnedState(path, IDENTITY).load(b)
    assert b.policy.tool_stats.samples("bash") == (2.0,) and len(b.policy.eta) == 0


def _cold(path: Path, identity=IDENTITY) -> tuple[bool, Scheduler]:
    s = scheduler()
    return ls.LearnedState(path, identity).load(s), s


def _one_warning(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("content, tag, why", [
    (b"", "corrupt", "empty"),
    (b"\x00garbage" * 100, "corrupt", "not an SQLite database"),
    ("truncated", "corrupt", "SQLite cannot"),
    ("foreign", "foreign", "not an agentserve state file"),
    ("bad values", "corrupt", "values the server refuses"),
])
def test_an_unusable_file_is_moved_aside_and_the_server_starts_cold(tmp_path, caplog, content, tag, why):
    path = tmp_path / "s.sqlite"
    if content == "truncated":
        a = scheduler()
        teach(a)
        ls.write_state(path, ls.export_learned(a), IDENTITY)
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2] + b"\xff" * 4096)
    elif content == "foreign":
        con = sqlite3.connect(path)
        con.execute("CREATE TABLE meta (key TEXT, value TEXT)")
        con.commit()
        con.close()
    elif content == "bad values":
        ls.write_state(path, ls.export_learned(scheduler()), IDENTITY)
        con = sqlite3.connect(path)
        con.execute("INSERT INTO tools VALUES (0, 'bash')")
        con.execute("INSERT INTO tool_samples VALUES (0, 0, -5.0)")
        con.commit()
        con.close()
    else:
        path.write_bytes(content)
    caplog.set_level(logging.INFO, "agentserve")
    loaded, s = _cold(path)
    assert not loaded and s.policy.tool_stats.tools() == []
    line = _one_warning(caplog)
    assert why in line and str(path) in line and "starting cold" in line
    (moved,) = tmp_path.glob(f"s.sqlite.{tag}-*")
    assert moved.name in line and not path.exists()


def test_another_schema_version_is_moved_aside(tmp_path, caplog):
    path = tmp_path / "s.sqlite"
    ls.write_state(path, ls.export_learned(scheduler()), IDENTITY)
    con = sqlite3.connect(path)
    con.execute(f"PRAGMA user_version = {ls.SCHEMA_VERSION + 1}")
    con.close()
    caplog.set_level(logging.INFO, "agentserve")
    assert not _cold(path)[0]
    assert f"schema version {ls.SCHEMA_VERSION + 1}" in _one_warning(caplog)
    assert list(tmp_path.glob(f"s.sqlite.schema-v{ls.SCHEMA_VERSION + 1}-*"))


def test_another_model_is_moved_aside_another_runner_drops_only_the_step_fit(tmp_path, caplog):
    a = scheduler()
    teach(a)
    path = tmp_path / "s.sqlite"
    ls.write_state(path, ls.export_learned(a), IDENTITY)
    caplog.set_level(logging.INFO, "agentserve")
    loaded, s = _cold(path, {**IDENTITY, "runner": "cuda bfloat16 native"})
    assert loaded and s.policy.tool_stats.tools() == a.policy.tool_stats.tools() and s.step_model.num_samples == 0
    assert any("step-time fit was learned on cpu float32 fp32" in r.getMessage() for r in caplog.records)
    caplog.clear()
    other = {**IDENTITY, "model": "SmolLM2-135M-Instruct.Q4_1.gguf (llama layers=30 hidden=576 heads=9/3 vocab=49152)"}
    loaded, s = _cold(path, other)
    assert not loaded and s.policy.tool_stats.tools() == []
    line = _one_warning(caplog)
    assert "learned with 'tiny-llama" in line and "SmolLM2" in line
    assert list(tmp_path.glob("s.sqlite.other-model-*"))


def test_a_failed_write_leaves_the_last_file(tmp_path, monkeypatch, caplog):
    a = scheduler()
    teach(a)
    path = tmp_path / "s.sqlite"
    keeper = ls.LearnedState(path, IDENTITY)
    assert keeper._write(ls.export_learned(a))
    good = path.read_bytes()

    def broken(*args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ls.os, "replace", broken)
    teach(a, seed=5)
    assert not keeper._write(ls.export_learned(a)) and keeper.failures == 1
    assert "No space left" in _one_warning(caplog)
    assert path.read_bytes() == good and [p.name for p in tmp_path.iterdir()] == ["s.sqlite"]


_WRITER = """
import random, sys
sys.path.insert(0, {tests!r})
from test_learned_state import IDENTITY, scheduler, teach
from agentserve.server import learned_state as ls
s = scheduler()
for i in range(10 ** 6):
    teach(s, seed=i)
    ls.write_state({path!r}, ls.export_learned(s), IDENTITY)
    print(i, flush=True)
"""


def test_a_writer_killed_at_any_moment_never_leaves_a_torn_file(tmp_path):
    path = tmp_path / "s.sqlite"
    code = _WRITER.format(tests=str(Path(__file__).parent), path=str(path))
    rng = random.Random(3)
    for _ in range(6):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline()  # one file written at least
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        state = ls.read_state(path, IDENTITY)  # whole: never torn, never half-written
        assert len(state["policy"]["tool_stats"]["global"]) >= 400
        loaded, s = _cold(path)
        assert loaded and s.step_model.ready
        assert not list(tmp_path.glob(".s.sqlite.*.tmp"))  # load cleans a write cut short


def test_saved_at_the_interval_by_a_writer_thread_and_at_close(tmp_path):
    path = tmp_path / "s.sqlite"
    s = scheduler()
    keeper = ls.LearnedState(path, IDENTITY, interval=10.0)
    keeper.tick(0.0, s)
    s.policy.tool_stats.record("bash", 1.0)
    keeper.tick(9.0, s)
    assert keeper._pending is None and not path.exists()
    keeper.tick(10.5, s)
    keeper._pending.result(10)
    assert ls.read_state(path, IDENTITY)["policy"]["tool_stats"]["tools"] == [["bash", [1.0]]]
    s.policy.tool_stats.record("bash", 2.0)
    keeper.close(s)
    assert ls.read_state(path, IDENTITY)["policy"]["tool_stats"]["tools"] == [["bash", [1.0, 2.0]]]
    assert keeper.saves == 2


# --- a server restarted ------------------------------------------------------------------------


def _start(path: Path):
    from server_fixtures import start_tiny_server

    srv, llm, scripted = start_tiny_server(api_key=None, config={
        "api_keys": {"key-a": "alice", "key-b": "bob"}, "state_file": str(path)})
    srv.llm, srv.scripted, srv.engine = llm, scripted, srv.app.state.server.engine
    return srv


def _chat(srv, key: str, pid: str, messages: list, end: bool = False) -> dict:
    r = httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}", "X-Program-Id": pid},
                   json={"model": "tiny", "messages": messages, "max_tokens": 120, "temperature": 0,
                         "end_program": end, "tools": [{"type": "function", "function": {
                             "name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]},
                   timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_restarted_server_takes_up_what_it_learned_and_keeps_tenants_out_of_the_file(tmp_path, caplog):
    pytest.importorskip("transformers")
    path = tmp_path / "learned-state.sqlite"
    srv = _start(path)
    try:
        for key, tenant in (("key-a", "alice"), ("key-b", "bob")):
            pid = f"{tenant}-secret-program"
            srv.scripted.script_turns(f"{tenant}/{pid}", CALL_TEXT, "It is sunny.")
            msgs = [{"role": "user", "content": "Weather in Paris?"}]
            first = _chat(srv, key, pid, msgs)
            assert first["choices"][0]["finish_reason"] == "tool_calls"
            time.sleep(0.2)  # the tool runs
            call = first["choices"][0]["message"]["tool_calls"][0]
            _chat(srv, key, pid, msgs + [first["choices"][0]["message"],
                                         {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}], end=True)
        sched = srv.llm.scheduler
        learned = srv.engine.call_sync(lambda: sched.policy.tool_stats.samples("get_weather"))
        assert len(learned) == 2 and min(learned) >= 0.2  # measured over HTTP: finish to next arrival
        srv.engine.call_sync(lambda: teach(sched))  # and more, past the TTL model's cold start
        before = srv.engine.call_sync(lambda: predictions(sched))
        assert srv.engine.call_sync(lambda: len(sched.policy.eta)) == 42  # the two programs above and teach's
    finally:
        srv.stop()  # the lifespan's end saves the file
    data = path.read_bytes()
    for secret in (b"alice", b"bob", b"secret-program", b"Paris", b"sunny"):
        assert secret not in data  # no tenant, program or prompt in the file
    caplog.set_level(logging.INFO, "agentserve")
    srv = _start(path)
    try:
        sched = srv.llm.scheduler
        assert srv.engine.call_sync(lambda: predictions(sched)) == before
        assert any("learned state loaded from" in r.getMessage() and "4 tool(s)" in r.getMessage()
                   for r in caplog.records)
    finally:
        srv.stop()


def test_a_server_given_a_corrupt_file_starts_cold_and_serves(tmp_path, caplog):
    pytest.importorskip("transformers")
    path = tmp_path / "learned-state.sqlite"
    path.write_bytes(b"SQLite format 3\x00" + os.urandom(3000))
    caplog.set_level(logging.INFO, "agentserve")
    srv = _start(path)
    try:
        srv.scripted.script("alice/p", "hello")
        r = _chat(srv, "key-a", "p", [{"role": "user", "content": "hi"}], end=True)
        assert r["choices"][0]["message"]["content"] == "hello"
    finally:
        srv.stop()
    assert "starting cold" in _one_warning(caplog)
    assert list(tmp_path.glob("learned-state.sqlite.corrupt-*"))
    assert ls.read_state(path, ls.model_identity(srv.llm))["policy"]["tool_stats"]["tools"] == []  # a new file


def test_serve_flags(tmp_path, capsys):
    from agentserve.cli import main

    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["serve", "--state-dir", str(blocker / "sub"), "--port", "1"]) == 2
    assert "--state-dir" in capsys.readouterr().err
    assert main(["serve", "--state-dir", str(tmp_path), "--state-save-interval", "0"]) == 2
    assert "--state-save-interval" in capsys.readouterr().err


def test_each_cluster_replica_has_its_own_file(tmp_path):
    from argparse import Namespace

    from agentserve.cli_serve import state_file

    assert state_file(Namespace(state_dir=None)) is None
    assert state_file(Namespace(state_dir=str(tmp_path / "d"))) == str(tmp_path / "d" / ls.FILE_NAME)
    assert state_file(Namespace(state_dir=str(tmp_path), state_name="replica-1")) == str(tmp_path / "replica-1.sqlite")
    pytest.importorskip("ray")
    from agentserve.router.replica import state_name

    rid = Namespace(unique_id="abc123")
    assert state_name(Namespace(rank=Namespace(rank=1, node_rank=0, local_rank=1), replica_id=rid)) == "replica-1"
    assert state_name(Namespace(rank=0, replica_id=rid)) == "replica-0"
    assert state_name(Namespace(replica_id=rid)) == "replica-abc123"
