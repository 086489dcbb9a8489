"""Random-weight models of a known shape (runner/random_model.py) and the host
tier's copies in runs of slots (runner/kv_cache.py write_host / read_host)."""

from __future__ import annotations

import pytest
import torch

from agentserve.cli import main as cli_main
from agentserve.runner.checkpoint import check_weights, expected_shapes
from agentserve.runner.config import ModelConfig
from agentserve.runner.kv_cache import PagedKVCache, _runs, read_host, write_host
from agentserve.runner.loader import load_model
from agentserve.runner.profiling import profile_name
from agentserve.runner.random_model import SHAPES


def test_a_random_model_has_every_weight_of_its_shape():
    m = load_model("random:smollm2-135m")
    assert m.config.num_layers == SHAPES["smollm2-135m"]["num_hidden_layers"] and m.config.tie_word_embeddings
    assert {k: tuple(v.shape) for k, v in m.weights.items()} == expected_shapes(m.config)
    check_weights(m.config, m.weights, m.source)
    w = m.weights["model.layers.0.mlp.down_proj.weight"]
    assert w.dtype is torch.bfloat16 and 0.015 < w.float().std().item() < 0.025
    assert m.tokenizer.backend.decode(m.tokenizer.backend.encode("héllo <|im_end|>").ids,
                                      skip_special_tokens=False) == "héllo <|im_end|>"
    assert m.tokenizer.eos_token_ids == [257]


def test_a_random_model_generates_and_names_its_profile():
    from agentserve.engine.sampling_params import SamplingParams
    from agentserve.llm import LLM

    llm = LLM("random:smollm2-135m", dtype="float32", device="cpu", kv_cache_tokens=256, max_model_len=256)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    assert profile_name(llm) == "random-smollm2-135m-cpu-float32"


def test_an_unknown_shape_is_a_one_line_error(capsys):
    with pytest.raises(ValueError, match="unknown random model shape 'nope': one of llama3.1-8b"):
        load_model("random:nope")
    assert cli_main(["profile", "--model", "random:nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown random model shape" in err[0]


def test_runs_of_consecutive_slots():
    assert _runs([4, 5, 6, 9, 2, 3]) == [(0, 4, 3), (3, 9, 1), (4, 2, 2)]
    assert _runs([]) == []


def test_host_copies_round_trip_through_scattered_slots():
    cfg = ModelConfig(num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1, vocab_size=10)
    c = PagedKVCache(cfg, 8, 2, 6, torch.float32, torch.device("cpu"))
    c.device_kv.normal_()
    want = c.gather([0, 1, 2, 3]).clone()
    write_host(c.host_kv, c.gather([0, 1, 2, 3]), [5, 1, 2, 0])
    assert torch.equal(c.host_kv[1], want[:, :, :, 1]) and torch.equal(c.host_kv[5], want[:, :, :, 0])
    got = read_host(c.host_kv, [5, 1, 2, 0], c.device)
    assert torch.equal(got, want)
    assert c.load([(5, 6), (0, 7)]) == []
    assert torch.equal(c.device_kv[:, :, :, 6], want[:, :, :, 0]) and torch.equal(c.device_kv[:, :, :, 7], want[:, :, :, 3])


def test_the_tier_copy_benchmark_prints_its_table_and_writes_json(tmp_path, capsys):
    import json

    from benchmarks.tier_copy_speed import main

    out = tmp_path / "copies.json"
    assert main(["--device", "cpu", "--blocks", "4", "--repeats", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["exact"] and res["shape"] == "smollm2-135m" and len(res["rows"]) == 2
    assert all(r[k] > 0 for r in res["rows"] for k in r if k != "path")
    assert "| block-major (the runner's) |" in capsys.readouterr().out
    assert main(["--device", "cpu", "--blocks", "0"]) == 2
