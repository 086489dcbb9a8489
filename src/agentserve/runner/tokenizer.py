"""Text <-> token ids for the model runner, over Hugging Face `tokenizers`.

One `Tokenizer` type serves both model sources: a Hugging Face folder
(`tokenizer.json` + `tokenizer_config.json`) and a GGUF file, whose vocabulary
is rebuilt from the `tokenizer.ggml.*` metadata so that no second copy of the
tokenizer has to ship with the weights: byte-level BPE here, SentencePiece
(Gemma, Llama 2) in spm_tokenizer.py.

BOS handling lives in this wrapper, not in the backend's post-processor: the
backend is always asked for the raw ids and BOS is prepended only when the model
says so (`add_bos_token`). That keeps "does this model want BOS" one flag that
reads the same for both sources, and chat templates that already write BOS
never get a second one by accident.

`IncrementalDetokenizer` turns a stream of generated ids into text for
streaming; a character split across byte-level or byte-fallback tokens (emoji,
CJK) is held back until its last byte arrives instead of leaking a U+FFFD.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from agentserve.runner.spm_tokenizer import sentencepiece_from_gguf

# llama.cpp's token types (llama_token_type): what `tokenizer.ggml.token_type` holds.
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Split patterns that llama.cpp pairs with `tokenizer.ggml.pre` names (the same
# patterns the models' own tokenizer.json files use).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre() -> pre_tokenizers.PreTokenizer:
    """GPT-2's split (ByteLevel's built-in regex), then bytes -> printable chars."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_pre() -> pre_tokenizers.PreTokenizer:
    """StarCoder-family vocabularies (SmolLM2's included) were trained with every
    digit its own pre-token, so "2024" must never reach BPE as one word."""
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_pre()])


def _regex_pre(pattern: str) -> pre_tokenizers.PreTokenizer:
    """A model-specific split regex, then the byte mapping without GPT-2's regex."""
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# `tokenizer.ggml.pre` -> (pre-tokenizer factory, BPE ignore_merges). Llama 3's
# tokenizer looks a whole pre-token up in the vocabulary before merging.
_PRE_TOKENIZERS = {
    "default": (_gpt2_pre, False),
    "gpt2": (_gpt2_pre, False),
    "smollm": (_digits_then_gpt2_pre, False),
    "starcoder": (_digits_then_gpt2_pre, False),
    "refact": (_digits_then_gpt2_pre, False),
    "llama-bpe": (lambda: _regex_pre(_LLAMA3_SPLIT), True),
    "llama3": (lambda: _regex_pre(_LLAMA3_SPLIT), True),
    "llama-v3": (lambda: _regex_pre(_LLAMA3_SPLIT), True),
    "qwen2": (lambda: _regex_pre(_QWEN2_SPLIT), False),
}


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the facts the server needs about it:
    which ids are BOS/EOS, and whether the model wants BOS prepended."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None = None,
                 eos_token_ids: Iterable[int] = (), add_bos_token: bool = False,
                 unk_token_id: int | None = None, pad_token_id: int | None = None) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = _unique(eos_token_ids)
        self.add_bos_token = add_bos_token
        self.unk_token_id = unk_token_id
        self.pad_token_id = pad_token_id
        if add_bos_token and bos_token_id is None:
            raise ValueError("tokenizer says add_bos_token but has no BOS token")

    # --- construction -------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> "Tokenizer":
        """Rebuild the tokenizer described by a GGUF file's `tokenizer.ggml.*` keys
        (values as plain Python: lists of str/int, ints, bools)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind is None:
            raise ValueError("GGUF metadata has no tokenizer (tokenizer.ggml.model is missing)")
        builder = _GGUF_TOKENIZERS.get(kind)
        if builder is None:
            raise NotImplementedError(
                f"GGUF tokenizer model {kind!r} is not supported (supported: "
                + ", ".join(f"{k!r} ({what})" for k, (_, what) in _GGUF_TOKENIZERS.items())
                + "); load such a model from its Hugging Face folder (tokenizer.json) instead")
        backend = builder[0](meta)

        def opt_id(key: str) -> int | None:
            v = meta.get(f"tokenizer.ggml.{key}")
            return None if v is None else int(v)

        # EOT/EOM end a turn the same way EOS does (llama.cpp stops on all three).
        eos = [opt_id(k) for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
        add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
        return cls(backend, bos_token_id=opt_id("bos_token_id"),
                   eos_token_ids=[i for i in eos if i is not None],
                   add_bos_token=bool(add_bos),
                   unk_token_id=opt_id("unknown_token_id"), pad_token_id=opt_id("padding_token_id"))

    @classmethod
    def from_file(cls, tokenizer_json: str | Path,
                  tokenizer_config: Mapping[str, Any] | str | Path | None = None, *,
                  eos_token_ids: Iterable[int] = (), bos_token_id: int | None = None) -> "Tokenizer":
        """A Hugging Face `tokenizer.json`, with special tokens and `add_bos_token`
        from `tokenizer_config` (a dict or a path to `tokenizer_config.json`).
        `eos_token_ids`/`bos_token_id` (e.g. from config.json) fill in what the
        tokenizer config does not name; extra EOS ids are added to its own."""
        path = Path(tokenizer_json)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ValueError(f"cannot read tokenizer {path}: {e}") from None
        cfg = _read_tokenizer_config(tokenizer_config)

        def special_id(name: str, required: bool = True) -> int | None:
            content = _token_content(cfg.get(name))
            tid = None if content is None else backend.token_to_id(content)
            if tid is None and content is not None and required:
                raise ValueError(f"{name} {content!r} from tokenizer config is not in {path}")
            return tid

        bos = special_id("bos_token")
        bos = bos if bos is not None else bos_token_id
        eos = [special_id("eos_token"), *eos_token_ids]
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # no flag: trust what the post-processor would add
            add_bos = bos is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos]
        return cls(backend, bos_token_id=bos, eos_token_ids=[i for i in eos if i is not None],
                   add_bos_token=bool(add_bos), unk_token_id=special_id("unk_token", required=False),
                   pad_token_id=special_id("pad_token", required=False))

    # --- encode / decode ----------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (`<|im_start|>`)
        always become their single id; `add_special_tokens` only controls BOS,
        which is added when the model asks for it."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # --- vocabulary ---------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (the model's embedding may have more rows)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    @property
    def bos_token(self) -> str | None:
        return self._token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        """The primary EOS string (the first of `eos_token_ids`)."""
        return self._token(self.eos_token_ids[0]) if self.eos_token_ids else None

    @property
    def eos_tokens(self) -> list[str]:
        return [t for t in map(self._token, self.eos_token_ids) if t is not None]

    @property
    def unk_token(self) -> str | None:
        return self._token(self.unk_token_id)

    @property
    def pad_token(self) -> str | None:
        return self._token(self.pad_token_id)

    @property
    def special_tokens(self) -> list[str]:
        """Every token the backend treats as special (skipped by `decode`)."""
        added = self.backend.get_added_tokens_decoder()
        return [added[i].content for i in sorted(added) if added[i].special]

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
                f"eos={self.eos_tokens!r}, add_bos={self.add_bos_token})")


class IncrementalDetokenizer:
    """Streams text out of generated ids, one id at a time.

    Decoding each new id alone is wrong twice over: a multi-byte character split
    across byte-level tokens decodes to U+FFFD halves, and SentencePiece-style
    decoders drop a leading space at the start of any decode. So each push
    decodes a short window that starts a few tokens back (`prefix`) and emits
    what the window adds beyond the previous decode of that prefix - and only
    once the text no longer ends in U+FFFD, i.e. the character is complete.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: ids before it are emitted and settled
        self._read = 0    # ids before it are emitted
        self._pieces: list[str] = []

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes ("" while a character is partial)."""
        self.ids.append(token_id)
        before = self._decode(self._prefix, self._read)
        now = self._decode(self._prefix)
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        new = now[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self._pieces.append(new)
        return new

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back (an invalid or
        truncated byte sequence decodes to U+FFFD here, as a full decode would)."""
        before = self._decode(self._prefix, self._read)
        new = self._decode(self._prefix)[len(before):]
        self._prefix = self._read = len(self.ids)
        if new:
            self._pieces.append(new)
        return new

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)


# --- helpers -----------------------------------------------------------------

def _unique(ids: Iterable[int]) -> list[int]:
    """In order, without repeats (EOS ids gathered from several files overlap)."""
    return list(dict.fromkeys(int(i) for i in ids))


def byte_level_tokenizer(specials: Iterable[str] = (), eos: str | None = None) -> Tokenizer:
    """A byte-level BPE with no merges: ids 0..255 are the bytes, then `specials`
    (`eos` among them is the EOS). For models with no tokenizer of their own: the
    random-weight models `agentserve profile` times, and the tests' tiny models."""
    backend = tokenizers.Tokenizer(models.BPE(vocab={ch: b for b, ch in enumerate(_byte_chars())}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = list(specials)
    backend.add_special_tokens(specials)
    eos_ids = [256 + specials.index(eos)] if eos is not None else []
    return Tokenizer(backend, eos_token_ids=eos_ids)


def _byte_chars() -> list[str]:
    """ByteLevel's character for each byte, in byte order: printable bytes stand
    for themselves, the others map to U+0100 upward in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _byte_level_bpe_from_gguf(meta: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """GPT-2-style BPE: the tokens are already in the byte->unicode spelling, the
    merges are "a b" strings, and control tokens become special tokens so chat
    markers like `<|im_start|>` encode to their single id."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre_name = meta.get("tokenizer.ggml.pre") or "default"
    if pre_name not in _PRE_TOKENIZERS:
        raise ValueError(f"GGUF pre-tokenizer {pre_name!r} is not supported "
                         f"(supported: {', '.join(sorted(_PRE_TOKENIZERS))})")
    make_pre, ignore_merges = _PRE_TOKENIZERS[pre_name]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = make_pre()
    backend.decoder = decoders.ByteLevel()
    _add_gguf_added_tokens(backend, tokens, meta.get("tokenizer.ggml.token_type") or [])
    if backend.get_vocab_size(with_added_tokens=True) != len(vocab):
        raise ValueError("GGUF tokenizer: added tokens do not map onto the vocabulary")
    return backend


# `tokenizer.ggml.model` -> (backend builder, what it is).
_GGUF_TOKENIZERS = {
    "gpt2": (_byte_level_bpe_from_gguf, "byte-level BPE: SmolLM2, Llama 3, Qwen2/3, ..."),
    "llama": (sentencepiece_from_gguf, "SentencePiece with byte fallback: Gemma, Llama 2, Mistral v0.1, ..."),
}


def _add_gguf_added_tokens(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens -> special (skipped on decode); user-defined ones (`<think>`)
    -> added but not special, so they stay in decoded text. Both are matched
    whole in the input, never split by BPE."""
    special = [t for t, ty in zip(tokens, types) if ty == _TOKEN_CONTROL]
    user = [t for t, ty in zip(tokens, types) if ty == _TOKEN_USER_DEFINED]
    if special:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    if user:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _read_tokenizer_config(cfg: Mapping[str, Any] | str | Path | None) -> dict[str, Any]:
    if cfg is None:
        return {}
    if isinstance(cfg, Mapping):
        return dict(cfg)
    path = Path(cfg)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"tokenizer config not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"tokenizer config {path} is not valid JSON: {e}") from None


def _token_content(value: Any) -> str | None:
    """tokenizer_config writes a special token as a string or as a serialized
    AddedToken dict ({"content": ...})."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None
