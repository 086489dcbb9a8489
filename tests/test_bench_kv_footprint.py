"""`python -m benchmarks kv-footprint` on a tiny Gemma 3 GGUF the test writes:
the hybrid cache holds a long conversation in less KV and retains more of
them in one budget, as the KV manager accounts it."""

from __future__ import annotations

import json

from benchmarks import kv_footprint
from tiny_models import hf_gemma3, write_gguf_from_hf


def test_hybrid_retains_more_conversations(tmp_path, capsys):
    path = tmp_path / "g.gguf"
    write_gguf_from_hf(hf_gemma3(layer_types=["sliding_attention"] * 5 + ["full_attention"], window=16,
                                 positions=4096), path, "gemma3")
    out = tmp_path / "fp.json"
    assert kv_footprint.main(["--model", str(path), "--tokens", "1024", "--turn-tokens", "256",
                              "--output-tokens", "32", "--kv-cache-tokens", "4096", "--block-size", "4",
                              "--chunk", "64", "--json", str(out)]) == 0
    rows = {r["layout"]: r for r in json.loads(out.read_text())["results"]}
    full, hyb = rows["full"], rows["hybrid"]
    assert full["pool_bytes"] == hyb["pool_bytes"]
    # full: every layer of 1024 tokens; hybrid: the global layer's, plus two windows of the others'
    assert full["program_bytes"] == 1024 * full["pool_bytes"] // 4096
    assert hyb["program_bytes"] < full["program_bytes"] / 3
    assert full["programs_retained"] == 4
    assert hyb["programs_retained"] >= 3 * full["programs_retained"]
    assert "hybrid/full" in capsys.readouterr().out


def test_a_budget_below_one_conversation_says_so(tmp_path):
    path = tmp_path / "g.gguf"
    write_gguf_from_hf(hf_gemma3(window=16, positions=4096), path, "gemma3")
    try:
        kv_footprint.main(["--model", str(path), "--tokens", "2048", "--kv-cache-tokens", "512",
                           "--block-size", "4"])
    except SystemExit as e:
        assert "does not fit --kv-cache-tokens 512" in str(e)
    else:
        raise AssertionError("no error")
