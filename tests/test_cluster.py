"""`agentserve cluster` end to end: two engine replicas of the tiny model on a
local Ray, behind the ingress (one cluster for the whole module: it takes
about 20 s to start). Skipped without Ray (`pip install 'agentserve[cluster]'`)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

pytest.importorskip("ray.serve")

from cluster_fixtures import Cluster  # noqa: E402
from server_fixtures import start_tiny_server  # noqa: E402

REPLICA = "x-agentserve-replica"


@pytest.fixture(scope="module")
def cluster():
    c = Cluster().start()
    yield c
    c.stop()


def chat(url: str, messages: list[dict], program: str | None = None, max_tokens: int = 4, **body):
    headers = {"X-Program-Id": program} if program else {}
    return httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": messages,
                                                          "max_tokens": max_tokens, **body},
                      headers=headers, timeout=60)


def events(text: str) -> list:
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_chat_and_stream_through_the_ingress(cluster):
    r = chat(cluster.url, [{"role": "user", "content": "hello"}])
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion" and r.json()["usage"]["completion_tokens"] >= 1
    assert r.headers[REPLICA]
    r = chat(cluster.url, [{"role": "user", "content": "hello"}], stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = events(r.text)
    assert ev[-1] == "[DONE]" and ev[0]["object"] == "chat.completion.chunk"
    assert ev[-2]["choices"][0]["finish_reason"] in ("length", "stop")
    models = httpx.get(cluster.url + "/v1/models", timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"


def test_a_programs_turns_stay_on_one_replica(cluster):
    for program in ("prog-a", "prog-b", "prog-c"):
        msgs = [{"role": "user", "content": f"task for {program}"}]
        seen = set()
        for turn in range(3):
            r = chat(cluster.url, msgs, program=program)
            assert r.status_code == 200, r.text
            seen.add(r.headers[REPLICA])
            msgs = msgs + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or "ok"},
                           {"role": "user", "content": f"turn {turn}"}]
        assert len(seen) == 1, (program, seen)
        for command in ("release", "end"):  # the program's replica answers (and the router forgets it on end)
            r = httpx.post(f"{cluster.url}/v1/programs/{program}/{command}", timeout=30)
            assert r.status_code == 200 and r.headers[REPLICA] in seen, (command, r.text)


def test_the_replay_client_records_each_turns_replica(cluster):
    """`bench run` against a cluster: every turn's record names the replica that answered it, and
    a program's turns share one (what a compare run's JSON is read for)."""
    from agentserve.bench.replay_client import ReplayConfig, replay
    from agentserve.workload.generators import generate_swebench

    programs = generate_swebench(3, 5.0, 1)
    res = replay(programs, ReplayConfig(cluster.url, model="tiny", tokens_per_word=1.0, token_scale=0.005,
                                        time_scale=0.01, progress=False, request_timeout=60))
    assert res["completed"] == 3, res["error_kinds"]
    by: dict[str, set] = {}
    for t in res["turns"]:
        by.setdefault(t["program_id"], set()).add(t["replica"])
    assert all(len(r) == 1 and None not in r for r in by.values()), by


def test_a_burst_of_new_programs_is_spread_over_the_replicas(cluster):
    """The replicas' reports are up to a stats period old; the requests in flight count at once."""
    got: list = []

    def one(i: int) -> None:
        got.append(chat(cluster.url, [{"role": "user", "content": f"burst {i}"}], program=f"burst-{i}",
                        max_tokens=60, ignore_eos=True))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [r.status_code for r in got] == [200] * 8
    assert len({r.headers[REPLICA] for r in got}) == 2


def test_an_id_less_conversation_follows_its_prefix(cluster):
    system = {"role": "system", "content": "You are a careful agent. " * 8}
    msgs = [system, {"role": "user", "content": "an id-less conversation " * 4}]
    first = chat(cluster.url, msgs)
    assert first.status_code == 200
    msgs = msgs + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "and then?"}]
    follow = chat(cluster.url, msgs)
    assert follow.status_code == 200 and follow.headers[REPLICA] == first.headers[REPLICA]


def test_bad_input_gets_the_single_servers_error(cluster):
    server, _, _ = start_tiny_server(api_key=None)
    try:
        for body in (b"{not json", json.dumps({"model": "tiny"}).encode(),
                     json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                 "max_tokens": -1}).encode(),
                     json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).encode(),
                     json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * 70_000}]}).encode()):
            got = httpx.post(cluster.url + "/v1/chat/completions", content=body, timeout=30,
                             headers={"content-type": "application/json"})
            want = httpx.post(server.url + "/v1/chat/completions", content=body, timeout=30,
                              headers={"content-type": "application/json"})
            assert got.status_code == want.status_code and got.status_code in (400, 404, 413), got.text
            assert got.json() == want.json()
        big = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * 70_000}]}).encode()
        got = httpx.post(cluster.url + "/v1/chat/completions", content=iter([big]), timeout=30)  # chunked
        want = httpx.post(server.url + "/v1/chat/completions", content=iter([big]), timeout=30)
        assert got.status_code == want.status_code == 413 and got.json() == want.json()
    finally:
        server.stop()


def test_metrics_carry_the_replica_label_and_health_is_ok(cluster):
    for program in ("m1", "m2", "m3", "m4"):
        chat(cluster.url, [{"role": "user", "content": program}], program=program)
    text = httpx.get(cluster.url + "/metrics", timeout=30).text
    types = [ln for ln in text.splitlines() if ln.startswith("# TYPE agentserve:num_requests_running ")]
    assert len(types) == 1
    samples = [ln for ln in text.splitlines() if ln.startswith("agentserve:num_requests_running{")]
    replicas = {ln.split('replica="', 1)[1].split('"', 1)[0] for ln in samples}
    assert len(replicas) == 2, samples
    assert "agentserve:cluster_replicas_answering 2" in text
    counters = {ln.split('counter="', 1)[1].split('"', 1)[0]: float(ln.rsplit(" ", 1)[1])
                for ln in text.splitlines() if ln.startswith("agentserve:router_counters{")}
    assert counters["affinity"] >= 6 and counters["placements"] >= 4, counters  # the programs' turns above
    assert httpx.get(cluster.url + "/health", timeout=30).json() == {"status": "ok"}


def test_a_client_that_leaves_aborts_its_request_on_the_replica(cluster):
    long = {"model": "tiny", "messages": [{"role": "user", "content": "a stream nobody reads"}],
            "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", cluster.url + "/v1/chat/completions", json=long, timeout=60,
                      headers={"X-Program-Id": "leaver"}) as s:
        replica = s.headers[REPLICA]
        for n, _ in enumerate(s.iter_lines()):
            if n > 10:
                break  # close the connection mid-stream
    deadline = time.monotonic() + 20
    while True:  # the replica counts it as aborted (it would take seconds more to finish)
        text = httpx.get(cluster.url + "/metrics", timeout=30).text
        prefix = f'agentserve:request_success_total{{replica="{replica}"'
        aborted = [ln for ln in text.splitlines() if ln.startswith(prefix) and 'finished_reason="abort"' in ln]
        if aborted and float(aborted[0].rsplit(" ", 1)[1]) >= 1:
            break
        assert time.monotonic() < deadline, "the replica did not abort the abandoned request"
        time.sleep(0.2)


def test_a_killed_replica_fails_over(cluster):
    """Kill the replica serving a program mid-run: its stream that had begun ends with an error
    event and [DONE]; its request that had no output yet is retried on the other replica; the
    next requests, the program's next turn included, succeed."""
    import ray

    msgs = [{"role": "user", "content": "a program that outlives its replica"}]
    r = chat(cluster.url, msgs, program="survivor")
    assert r.status_code == 200
    victim = r.headers[REPLICA]
    long = {"model": "tiny", "messages": msgs, "max_tokens": 900, "ignore_eos": True}
    streaming, out = threading.Event(), {}

    def stream():
        with httpx.stream("POST", cluster.url + "/v1/chat/completions", timeout=120,
                          headers={"X-Program-Id": "survivor"}, json={**long, "stream": True}) as s:
            text = ""
            for chunk in s.iter_text():
                text += chunk
                if text.count("data: ") >= 5:
                    streaming.set()
            out["stream"] = text

    def whole():
        out["whole"] = httpx.post(cluster.url + "/v1/chat/completions", json=long, timeout=120,
                                  headers={"X-Program-Id": "survivor"})

    threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
    for t in threads:
        t.start()
    assert streaming.wait(60)
    ray.kill(cluster.replica_actor(victim), no_restart=False)
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a request hung after its replica died"
    ev = events(out["stream"])
    assert ev[-1] == "[DONE]" and ev[-2]["error"]["code"] == "replica_failed"
    assert all("error" not in e for e in ev[:-2])
    whole = out["whole"]
    assert whole.status_code == 200, whole.text
    assert whole.headers[REPLICA] != victim and whole.json()["usage"]["completion_tokens"] == 900
    for i in range(4):
        r = chat(cluster.url, [{"role": "user", "content": f"after the kill {i}"}])
        assert r.status_code == 200, r.text
    r = chat(cluster.url, msgs + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "next"}],
             program="survivor")
    assert r.status_code == 200 and r.headers[REPLICA] != victim, r.text
    cluster.wait_healthy(90)  # Ray restarted the replica


def test_what_counts_as_output_for_failover():
    from agentserve.router.ingress import carries_output

    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
    text = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
    assert not carries_output(role)
    assert carries_output(text) and carries_output(role + text)
    assert carries_output(b"data: [DONE]\n\n") and carries_output(b'data: {"error": {"message": "x"}}\n\n')
    assert carries_output(b'data: {"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n')
