"""SentencePiece vocabularies from GGUF metadata (`tokenizer.ggml.model` "llama":
Gemma, Llama 2, Mistral v0.1 and their kin), rebuilt as a `tokenizers` BPE.

A GGUF keeps a SentencePiece model as three parallel lists: the pieces (with
U+2581 "▁" standing for a space), a score per piece and llama.cpp's token type
per piece, plus byte pieces `<0x00>`..`<0xFF>` for the bytes of characters the
vocabulary lacks. It holds no merge list, so the merges are derived here: every
piece that can be cut into two pieces of the vocabulary gives the merge
(left, right), and merges are ranked by their piece's priority.

The rebuilt tokenizer reproduces what transformers' GGUF converter builds from
the same file (tests/test_tokenizer_spm.py compares them on thousands of
strings), which differs by family:

* Gemma (architectures gemma, gemma2, gemma3): a piece's priority is its
  position in the file, not its score (Gemma's scores do not follow the order
  its merges were learned in), and pieces of two or more plain spaces (user-
  defined tokens in the file) are respelled with "▁" so the derived merges
  reach them.
* Every other SentencePiece file (Llama 2 style): priority is the score.

Spaces become "▁". Where `tokenizer.ggml.add_space_prefix` is set (the default
for non-Gemma files, as llama.cpp reads them; Gemma files say false) one "▁"
goes in front of the text's first segment unless it starts with a space
already (transformers' Metaspace rule; llama.cpp would add it even then), and
the decoder strips that one leading space. transformers' converter ignores the
flag where it is false (it always adds the prefix to a Llama-style file); here
the file's word holds, as in llama.cpp and SentencePiece itself.

Ties between merges of equal priority go to the longer left part, then to the
piece that comes first in the file.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers

SPACE = "\u2581"  # SentencePiece's visible space

# llama.cpp's token types (llama_token_type).
TOKEN_NORMAL = 1
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

# Architectures whose SentencePiece files rank merges by file position (see above).
GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})


def sentencepiece_from_gguf(meta: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """The `tokenizers` backend for a GGUF whose tokenizer model is "llama"."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    scores = meta.get("tokenizer.ggml.scores")
    types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens) or (scores is not None and len(scores) != len(tokens)):
        raise ValueError(f"GGUF tokenizer: {len(tokens)} tokens but {len(types)} token types"
                         f"{'' if scores is None else f' and {len(scores)} scores'}")
    gemma = meta.get("general.architecture") in GEMMA_ARCHITECTURES
    if gemma:
        pieces = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
        # Position is priority: an earlier piece merges first.
        priority = [float(-i) for i in range(len(pieces))]
    else:
        if scores is None:
            raise ValueError("GGUF SentencePiece tokenizer has no tokenizer.ggml.scores to rank its merges by")
        pieces = tokens
        priority = [float(s) for s in scores]
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", not gemma))
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None

    vocab = {p: i for i, p in enumerate(pieces)}
    if len(vocab) != len(pieces):
        # a shadowed id would decode to nothing: refuse rather than lose text
        seen: set[str] = set()
        dup = next(p for p in pieces if p in seen or seen.add(p))
        raise ValueError(f"GGUF SentencePiece tokenizer lists the piece {dup!r} more than once")
    model = models.BPE(vocab=vocab, merges=derive_merges(pieces, priority), unk_token=unk,
                       fuse_unk=True, byte_fallback=True)
    backend = tokenizers.Tokenizer(model)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.decoder = decoders.Sequence(steps)
    _add_marked_tokens(backend, tokens, types, vocab)
    if backend.get_vocab_size(with_added_tokens=True) != len(pieces):
        raise ValueError("GGUF tokenizer: added tokens do not map onto the vocabulary")
    return backend


def derive_merges(pieces: Sequence[str], priority: Sequence[float]) -> list[tuple[str, str]]:
    """Every (left, right) split of a piece into two pieces of the vocabulary,
    best first: by the piece's priority (higher first), then the longer left part
    (then the longer right part), then the piece's first position in the list."""
    best: dict[str, float] = {}
    first: dict[str, int] = {}
    for i, p in enumerate(pieces):
        best[p] = priority[i]  # a repeated piece takes its last priority
        first.setdefault(p, i)
    merges: list[tuple[str, str]] = []
    # Most priorities belong to one piece (Gemma's positions, Llama's scores), whose
    # splits need no sort: cuts from the right already put the longer left part first.
    ordered = sorted(first, key=lambda p: (-best[p], first[p]))
    for _, group in itertools.groupby(ordered, key=best.__getitem__):
        group = list(group)
        if len(group) == 1:
            merges.extend(_splits(group[0], first))
        else:
            ranked = [(-len(left), -len(right), pos, left, right)
                      for pos, p in enumerate(group) for left, right in _splits(p, first)]
            ranked.sort()
            merges.extend((r[3], r[4]) for r in ranked)
    return merges


def _splits(piece: str, vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """The (left, right) cuts of `piece` into two vocabulary pieces, longer left first."""
    return [(piece[:cut], piece[cut:]) for cut in range(len(piece) - 1, 0, -1)
            if piece[:cut] in vocab and piece[cut:] in vocab]


def _add_marked_tokens(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int],
                       vocab: Mapping[str, int]) -> None:
    """Control tokens (`<bos>`, `<start_of_turn>`) become special tokens, matched
    whole in text and skipped by decode; user-defined ones (`<think>`, Gemma's
    newline runs) are matched whole but stay in decoded text. A user-defined
    piece that was respelled (Gemma's space runs) is reached by merges instead."""
    special = [t for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL]
    user = [t for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED and t in vocab]
    if special:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    if user:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
