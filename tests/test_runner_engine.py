"""The engine around the runner: output processing (stop strings held back
from the stream, stop tokens, finish reasons), sampling parameters, the
sampler's truncation, chat templates, profiles and the CLI's model commands."""

from __future__ import annotations

import json

import pytest
import torch

from agentserve.cli import main as cli_main
from agentserve.cost.cost_model import CostModel
from agentserve.cost.profile import load_profile
from agentserve.engine.llm_engine import _held_back
from agentserve.engine.sampling_params import SamplingParams
from agentserve.llm import LLM
from agentserve.runner.profiling import fit_quadratic, measure_profile, reload_cost_for, tier_costs_for
from agentserve.runner.sampler import Sampler
from agentserve.server.chat_template import ChatTemplate, TemplateError
from tiny_models import DEVICE, byte_tokenizer, hf_llama, loaded, prompt


@pytest.fixture(scope="module")
def hf():
    return hf_llama()


def make_llm(hf, **kw) -> LLM:
    opts = dict(dtype="float32", device=DEVICE, kv_cache_tokens=2048, block_size=4, policy="continuum")
    opts.update(kw)
    return LLM(loaded(hf), **opts)


def _stream(llm: LLM, ids, params):
    req = llm.engine.add_request(ids, params)
    pieces, final = [], None
    while final is None:
        for o in llm.engine.step():
            if o.request_id == req.request_id:
                pieces.append(o.new_text)
                if o.finished:
                    final = o
    return pieces, final


def test_stop_string_ends_output_and_is_never_streamed(hf):
    llm = make_llm(hf)
    free = llm.generate([prompt(1, 9)], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    text = free.text
    assert len(text) > 6
    stop = text[3:6]  # a stop string that appears in the free-running output
    pieces, out = _stream(llm, prompt(1, 9), SamplingParams(max_tokens=40, temperature=0.0, stop=[stop],
                                                             ignore_eos=True))
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]
    assert "".join(pieces) == out.text
    assert llm.kv.num_free_blocks + llm.kv.num_pinned_blocks == llm.kv.num_blocks
    llm.check_integrity()


def test_outputs_carry_deltas_and_the_whole_output_only_when_finished(hf):
    """One request record, shared: the engine keeps no map of its own (the
    scheduler's registry and the request's own output state), and a step's
    output costs its new tokens, not a copy of everything so far."""
    llm = make_llm(hf)
    req = llm.engine.add_request(prompt(3, 9), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert llm.engine.get(req.request_id) is req and llm.scheduler.requests[req.request_id] is req
    outs = []
    while not outs or not outs[-1].finished:
        outs.extend(o for o in llm.engine.step() if o.request_id == req.request_id)
        if not outs[-1].finished:
            assert req.block_table is not None and len(req.block_table) > 0  # its KV is on the request
    *mid, last = outs
    assert mid and all(o.token_ids == [] and o.text == "" and not o.finished for o in mid)
    assert last.token_ids == [t for o in outs for t in o.new_token_ids] == req.output_token_ids
    assert last.text == "".join(o.new_text for o in outs) and len(last.token_ids) == 12
    assert last.request is req
    # finished: gone from the registry; its blocks were handed on (pinned for the program or freed)
    assert llm.engine.get(req.request_id) is None and not llm.engine.has_unfinished
    assert req.block_table is None
    llm.check_integrity()
    # an aborted request leaves nothing behind either
    r2 = llm.engine.add_request(prompt(4, 9), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    llm.engine.step()
    assert r2.block_table is not None
    assert llm.engine.abort(r2.request_id) and not llm.engine.abort(r2.request_id)
    assert r2.block_table is None and llm.engine.get(r2.request_id) is None
    llm.check_integrity()


def test_held_back_suffix():
    assert _held_back("hello wor", ["world"]) == 3
    assert _held_back("hello", ["xyz"]) == 0
    assert _held_back("ab", ["abc", "b"]) == 2


def test_stop_token_and_length_finish_reasons(hf):
    llm = make_llm(hf)
    free = llm.generate([prompt(2, 7)], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    tok = free.token_ids[4]
    out = llm.generate([prompt(2, 7)], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[tok],
                                                      ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.stop_reason == tok
    assert out.token_ids == free.token_ids[:free.token_ids.index(tok) + 1]


def test_eos_ends_unless_ignored(hf):
    llm = make_llm(hf)
    free = llm.generate([prompt(3, 5)], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    eos = free.token_ids[2]
    llm.engine.eos_token_ids = frozenset([eos])
    out = llm.generate([prompt(3, 5)], SamplingParams(max_tokens=30, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos and len(out.token_ids) == 3


def test_abort_frees_kv(hf):
    llm = make_llm(hf)
    req = llm.engine.add_request(prompt(4, 30), SamplingParams(max_tokens=50, temperature=0.0))
    llm.engine.step()
    assert llm.kv.num_free_blocks < llm.kv.num_blocks
    assert llm.engine.abort(req.request_id)
    assert not llm.engine.abort(req.request_id)
    assert llm.kv.num_free_blocks == llm.kv.num_blocks
    llm.check_integrity()


def test_request_that_cannot_fit_is_refused_and_nothing_leaks(hf):
    llm = make_llm(hf, kv_cache_tokens=64, max_model_len=1024)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.engine.add_request(prompt(5, 60), SamplingParams(max_tokens=20))
    assert not llm.engine.has_unfinished
    llm.check_integrity()


@pytest.mark.parametrize("kw, msg", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(stop=["x"] * 17), "stop")])
def test_sampling_params_are_validated(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_top_k_and_top_p_only_draw_from_the_kept_tokens():
    s = Sampler(torch.device("cpu"))
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, -1.0]] * 3)
    seen_k, seen_p = set(), set()
    for i in range(200):
        toks = s.sample(logits, [SamplingParams(temperature=1.0, top_k=2),
                                 SamplingParams(temperature=1.0, top_p=0.6),
                                 SamplingParams(temperature=0.0)], [f"a{i}", f"b{i}", f"c{i}"])
        seen_k.add(toks[0])
        seen_p.add(toks[1])
        assert toks[2] == 0
    assert seen_k == {0, 1}
    assert seen_p == {0}  # token 0 alone holds 66% of the mass
    s.release("a0")


def test_chat_template_renders_chatml_and_hermes_tools():
    t = ChatTemplate(None)
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    text = t.render([{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": None,
                      "tool_calls": [{"id": "1", "type": "function",
                                      "function": {"name": "calc", "arguments": "{\"x\": 1}"}}]},
                     {"role": "tool", "tool_call_id": "1", "content": "2"}], tools=tools)
    assert text.startswith("<|im_start|>system\n") and "<tools>" in text and '"name": "calc"' in text
    assert '<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>' in text
    assert "<tool_response>\n2\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    with pytest.raises(TemplateError):
        t.render([])
    with pytest.raises(TemplateError, match="image_url"):
        t.render([{"role": "user", "content": [{"type": "image_url"}]}])
    boom = ChatTemplate("{{ raise_exception('no system role') }}")
    with pytest.raises(TemplateError, match="no system role"):
        boom.render([{"role": "user", "content": "x"}])


def test_chat_with_tools_parses_hermes_calls(hf):
    llm = make_llm(hf)
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, temperature=0.0),
                   tools=[{"type": "function", "function": {"name": "calc"}}], program_id="prog")
    assert out.output.num_prompt_tokens > 100  # the tools block was rendered into the prompt
    assert out.tool_calls == []  # a random model writes no call


def test_fit_quadratic_recovers_coefficients():
    xs = [64, 128, 256, 512, 1024]
    a, b, c = fit_quadratic(xs, [2e-7 * x * x + 1e-3 * x + 0.01 for x in xs])
    assert a == pytest.approx(2e-7, rel=1e-6) and b == pytest.approx(1e-3, rel=1e-6)
    assert c == pytest.approx(0.01, rel=1e-5)


def test_profile_is_written_in_the_simulators_format_and_used_for_reload_cost(hf, tmp_path):
    llm = make_llm(hf, kv_cache_tokens=4096, block_size=16, max_num_batched_tokens=256)
    prof, raw = measure_profile(llm, [16, 32, 64, 128], [1, 2, 4], (32, 96), copy_blocks=8)
    path = tmp_path / "p.json"
    prof.dump(path)
    loaded_prof = load_profile(path)
    assert loaded_prof.model.num_layers == 2 and loaded_prof.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    cost = CostModel(loaded_prof, 16)
    assert cost.prefill_time(128) > cost.prefill_time(16) > 0
    assert set(raw["prefill"]) == {16, 32, 64, 128}
    fn = reload_cost_for(str(path), llm, host_tier=False)
    assert fn(1000) == pytest.approx(cost.prefill_time(1000))
    with pytest.raises(Exception, match="profile"):
        reload_cost_for(str(tmp_path / "missing.json"), llm, host_tier=False)
    assert "disk" not in raw and loaded_prof.disk_read_bandwidth_bytes_s == 3e9  # no disk tier: the default


def test_profile_measures_the_disk_tier_through_its_files(hf, tmp_path):
    disk_dir = tmp_path / "kv"
    llm = make_llm(hf, kv_cache_tokens=4096, block_size=16, max_num_batched_tokens=256, host_kv_tokens=1024,
                   disk_kv_bytes=1 << 20, disk_kv_dir=str(disk_dir))
    (disk_dir / "notes.txt").write_text("not ours")
    prof, raw = measure_profile(llm, [16, 32, 64], [1, 2], (32, 96), copy_blocks=8)
    assert raw["disk"]["write_bytes_per_s"] > 0 and raw["disk"]["read_bytes_per_s"] > 0
    assert prof.disk_read_bandwidth_bytes_s == raw["disk"]["read_bytes_per_s"]
    assert prof.disk_write_bandwidth_bytes_s == raw["disk"]["write_bytes_per_s"]
    assert sorted(p.name for p in disk_dir.iterdir()) == ["notes.txt"]  # its block files are gone, nothing else
    prefill, reloads = tier_costs_for(None, llm)  # no profile saved: logged estimates, a tier's reload below prefill
    assert 0 < reloads["host"](1000) < reloads["disk"](1000)


def test_cli_generate_and_errors(capsys, tmp_path):
    bad = tmp_path / "x.txt"
    bad.write_text("hello")
    assert cli_main(["generate", "hi", "--model", str(bad)]) == 2
    assert "is not a model" in capsys.readouterr().err
    assert cli_main(["generate", "hi", "--model", str(tmp_path / "nope.gguf")]) == 2
    assert "model not found" in capsys.readouterr().err
    assert cli_main(["generate", "hi", "--temperature", "-3"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert cli_main(["profile", "--contexts", "100"]) == 2
    assert "--contexts" in capsys.readouterr().err


def test_cli_generate_runs_the_default_model(capsys, smollm_path):
    assert cli_main(["generate", "--chat", "What is the capital of France?", "--max-tokens", "12",
                     "--kv-cache-tokens", "2048"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out and "prompt tokens" in captured.err


def test_tiny_tokenizer_roundtrip():
    tok = byte_tokenizer()
    ids = tok.encode("a<|im_end|>é")
    assert 257 in ids and tok.decode(ids) == "aé"
    assert json.dumps(tok.decode(tok.encode("x y"))) == '"x y"'


WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "calc", "parameters": {
        "type": "object", "properties": {"expr": {"type": "string", "maxLength": 12}}, "required": ["expr"]}}},
]


@pytest.mark.parametrize("choice", ["required", "get_weather", "calc"])
def test_required_tool_choice_forces_a_valid_call_even_from_a_random_model(hf, choice):
    pytest.importorskip("xgrammar")
    llm = make_llm(hf, kv_cache_tokens=4096)
    out = llm.chat([{"role": "user", "content": "weather?"}], SamplingParams(max_tokens=200, temperature=0.0),
                   tools=WEATHER_TOOLS, tool_choice=choice)
    assert len(out.tool_calls) == 1, out.output.text
    call = out.tool_calls[0]
    if choice != "required":
        assert call.name == choice
    if call.name == "get_weather":
        assert set(call.arguments) == {"city", "unit"} and call.arguments["unit"] in ("c", "f")
        assert len(call.arguments["city"]) <= 10  # a random model would never close the string itself
    else:
        assert set(call.arguments) == {"expr"} and len(call.arguments["expr"]) <= 12
    assert out.output.finish_reason == "stop"
    llm.check_integrity()
    with pytest.raises(ValueError, match="not among the tools"):
        llm.chat([{"role": "user", "content": "x"}], tools=WEATHER_TOOLS, tool_choice="nope")


def test_kv_cache_copies_report_failures():
    from agentserve.runner.config import ModelConfig
    from agentserve.runner.kv_cache import PagedKVCache
    cfg = ModelConfig(num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1, vocab_size=10)
    cache = PagedKVCache(cfg, 4, 2, 3, torch.float32, torch.device("cpu"))
    cache.device_kv.normal_()
    assert cache.offload([(1, 0), (3, 2)]) == []
    cache.device_kv[:, :, :, 0].zero_()
    assert cache.load([(2, 0)]) == []
    assert torch.equal(cache.device_kv[:, :, :, 0], cache.device_kv[:, :, :, 3])
    cache.host_kv = torch.zeros(3, 2, 2, 1, 2, cfg.head_dim + 1)  # a copy that cannot run
    assert cache.offload([(1, 0), (2, 1)]) == [0, 1]
    assert cache.load([(0, 2)]) == [0]


def test_a_profile_names_the_models_layer_kinds():
    from agentserve.runner.config import FULL, SLIDING, ModelConfig
    from agentserve.runner.profiling import model_spec

    def cfg(**kw):
        return ModelConfig(num_layers=6, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1,
                           vocab_size=10, **kw)

    gemma = model_spec(cfg(sliding_window=512, layer_types=[SLIDING] * 5 + [FULL], arch="gemma3"), 2)
    assert (gemma.global_layers, gemma.window_layers, gemma.sliding_window) == (1, 5, 512)
    mistral = model_spec(cfg(sliding_window=4096), 2)  # every layer windowed
    assert (mistral.global_layers, mistral.window_layers, mistral.sliding_window) == (0, 6, 4096)
    llama = model_spec(cfg(), 2)
    assert (llama.num_global_layers, llama.window_layers, llama.sliding_window) == (None, 0, 0)
