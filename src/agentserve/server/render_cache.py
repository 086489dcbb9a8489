"""Chat prompts to token ids, reusing the tokens of the conversation's last turn
(stateful-inference-tool-calling.txt, section 3.4).

An agent re-sends its whole conversation every turn, grown by a small delta,
and BPE-tokenizing it again costs CPU in proportion to its length, while
rendering the chat template costs a small fraction of that (docs/fast-path.md,
'Render and tokenize cache', has the figures). So every request is rendered
in full, and only the tokenization is cached:

* An entry holds a rendered prompt, its token ids, and its *split points*:
  the positions just after an added token (`<|im_start|>`, `<|im_end|>`...).
  Hugging Face tokenizers cut the text at added tokens before pre-tokenizing,
  so the text on either side of one is tokenized independently.
* Entries are found by the message list: each prefix of it (with the tools)
  has a chained digest, and the longest prefix with an entry is taken. The
  digest only *locates* a candidate; nothing is trusted because of it.
* The new prompt is compared with the entry's text character by character.
  The last split point s inside the common prefix is the cut; the window
  from the split point w before it is tokenized anew, and its first tokens
  (those of [w, s)) must equal the cached ones. Then the ids are the cached
  ids up to w plus the window's ids. Any difference, or no split point, is a
  full tokenization (a miss or a fallback), never a guess.
* An identical prompt (a retry) takes the entry's ids as they are.

Entries are kept in an LRU bounded by count and by total tokens. The cache is
called from the HTTP server's worker threads (tokenization stays off the
event loop), so the table is behind a lock and tokenization runs outside it."""

from __future__ import annotations

import bisect
import hashlib
import json
import threading
from array import array
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from agentserve.runner.tokenizer import Tokenizer
from agentserve.server.chat_template import ChatTemplate

DEFAULT_ENTRIES = 256
DEFAULT_MAX_TOKENS = 8 * 2**20  # all entries together: about 4 bytes of ids and 4 of text a token


@dataclass(frozen=True)
class RenderCacheStats:
    """Cumulative counts since the server started, and the table's size now."""

    hits: int = 0  # prompts that extended (or repeated) a cached one: only the delta was tokenized
    misses: int = 0  # no cached prompt for any prefix of the messages: a full tokenization
    fallbacks: int = 0  # a cached prompt was found but could not be used safely: a full tokenization
    reused_tokens: int = 0  # prompt tokens taken from the cache
    tokenized_tokens: int = 0  # prompt tokens the tokenizer produced
    entries: int = 0
    tokens: int = 0  # tokens held by the entries


@dataclass(frozen=True)
class _Entry:
    text: str
    ids: array  # 'i'
    split_tokens: array  # 'q', ascending: token index just after each added token
    split_chars: array  # 'q', ascending: character offset just after it


def common_prefix_length(a: str, b: str) -> int:
    """The length of the longest common prefix of `a` and `b` (compared in C, in halving windows)."""
    n = min(len(a), len(b))
    if (b.startswith(a) if len(a) <= len(b) else a.startswith(b)):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if b.startswith(a[lo:mid], lo):
            lo = mid
        else:
            hi = mid
    return lo


def splitting_token_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Added tokens the backend cuts the text at before anything else: matched
    as they are (no stripping of neighbouring spaces, not only as a word), and
    none the start of another, so a match cannot grow past its end."""
    added = tokenizer.backend.get_added_tokens_decoder()
    contents = [t.content for t in added.values()]
    ids = set()
    for i, t in added.items():
        if not t.content or t.lstrip or t.rstrip or t.single_word:
            continue
        if any(c != t.content and c.startswith(t.content) for c in contents):
            continue
        ids.add(i)
    return frozenset(ids)


class RenderCache:
    """`encode_chat(messages, tools)` = `tokenizer.encode(template.render(messages, tools))`,
    with the ids of a cached earlier turn reused (see the module docstring).
    `capacity` 0 turns the cache off (every prompt is tokenized in full, nothing counted)."""

    def __init__(self, template: ChatTemplate, tokenizer: Tokenizer, capacity: int = DEFAULT_ENTRIES,
                 max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if capacity < 0 or max_tokens < 0:
            raise ValueError("capacity and max_tokens must be >= 0")
        self.template = template
        self.tokenizer = tokenizer
        self.capacity = capacity
        self.max_tokens = max_tokens
        self._split_ids = splitting_token_ids(tokenizer)
        self._split_array = np.array(sorted(self._split_ids), dtype=np.int32)
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self._hits = self._misses = self._fallbacks = self._reused = self._tokenized = 0

    @property
    def enabled(self) -> bool:
        return self.capacity > 0 and self.max_tokens > 0 and bool(self._split_ids)

    def stats(self) -> RenderCacheStats:
        with self._lock:
            return RenderCacheStats(self._hits, self._misses, self._fallbacks, self._reused, self._tokenized,
                                    len(self._entries), self._tokens)

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    scope: Hashable = None) -> list[int]:
        """The prompt's token ids. Raises TemplateError as `ChatTemplate.render` does.
        `scope`: the request's prefix-cache salt; entries are reused only within one, so
        the time a tokenization takes tells nothing about another tenant's prompts."""
        text = self.template.render(messages, tools=tools)
        if not self.enabled:
            return self.tokenizer.encode(text)
        keys = prefix_keys(messages, tools, scope)
        with self._lock:
            found = None
            for key in reversed(keys):
                found = self._entries.get(key)
                if found is not None:
                    self._entries.move_to_end(key)
                    break
        ids, entry, reused, outcome = self._encode(found, text)
        with self._lock:
            if outcome == "hit":
                self._hits += 1
            elif outcome == "miss":
                self._misses += 1
            else:
                self._fallbacks += 1
            self._reused += reused
            self._tokenized += len(ids) - reused
            if entry is not found or keys[-1] not in self._entries:
                self._put(keys[-1], entry)
        return ids

    # --- internals -------------------------------------------------------------

    def _encode(self, found: _Entry | None, text: str) -> tuple[list[int], _Entry, int, str]:
        """(ids, the entry for `text`, ids reused, "hit" | "miss" | "fallback")."""
        if found is None:
            ids, entry = self._full(text)
            return ids, entry, 0, "miss"
        if found.text == text:
            return found.ids.tolist(), found, len(found.ids), "hit"
        common = common_prefix_length(found.text, text)
        b = bisect.bisect_right(found.split_chars, common) - 1  # the last split point inside the common prefix
        if b >= 1:
            w_tok, w_char = found.split_tokens[b - 1], found.split_chars[b - 1]
            s_tok = found.split_tokens[b]
            enc = self.tokenizer.backend.encode(text[w_char:], add_special_tokens=False)
            window = enc.ids
            if window[:s_tok - w_tok] == found.ids[w_tok:s_tok].tolist():
                kept = found.ids[:w_tok]
                ids = kept.tolist()
                ids += window
                new = array("i", window)
                toks, chars = self._splits(enc, new, w_tok, w_char)
                entry = _Entry(text, kept + new, found.split_tokens[:b] + toks, found.split_chars[:b] + chars)
                return ids, entry, w_tok, "hit"
        ids, entry = self._full(text)
        return ids, entry, 0, "fallback"

    def _full(self, text: str) -> tuple[list[int], _Entry]:
        enc = self.tokenizer.backend.encode(text, add_special_tokens=False)
        ids = enc.ids
        arr = array("i", ids)
        toks, chars = self._splits(enc, arr, 0, 0)
        return ids, _Entry(text, arr, toks, chars)

    def _splits(self, enc: Any, ids: array, tok0: int, char0: int) -> tuple[array, array]:
        """The split points among `ids` (tokenized from character `char0`, token `tok0` on)."""
        at = np.flatnonzero(np.isin(np.frombuffer(ids, dtype=np.int32), self._split_array)).tolist()
        toks = array("q", [tok0 + j + 1 for j in at])
        chars = array("q", [char0 + enc.token_to_chars(j)[1] for j in at])
        return toks, chars

    def _put(self, key: bytes, entry: _Entry) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._tokens -= len(old.ids)
        if len(entry.ids) > self.max_tokens:
            return
        self._entries[key] = entry
        self._tokens += len(entry.ids)
        while len(self._entries) > self.capacity or self._tokens > self.max_tokens:
            _, gone = self._entries.popitem(last=False)
            self._tokens -= len(gone.ids)


def prefix_keys(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                scope: Hashable = None) -> list[bytes]:
    """A digest per prefix of `messages` (1..n messages), each covering the tools (and the scope) too.
    String fields are hashed as they are (escaping them to JSON costs more than the digest)."""
    h = hashlib.blake2b(json.dumps(tools, ensure_ascii=False, default=str).encode(), digest_size=16)
    if scope is not None:
        h.update(b"\x01scope" + repr(scope).encode("utf-8", "surrogatepass"))
    keys = []
    for m in messages:
        h.update(b"\x00%d" % len(m))
        for k, v in m.items():
            data = (v if isinstance(v, str) else repr(v)).encode("utf-8", "surrogatepass")
            h.update(b"%s\x00%d\x00" % (str(k).encode("utf-8", "surrogatepass"), len(data)))
            h.update(data)
        keys.append(h.copy().digest())
    return keys
