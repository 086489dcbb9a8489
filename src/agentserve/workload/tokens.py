"""Concrete token ids for a Program, so a simulator's prefix cache can verify content.

`program_token_plan(program, seed)` returns, per call, (prompt_ids, output_ids):

* Without `hash_ids`: call 0's prompt = the workload-wide shared pool's first
  `shared_prefix_tokens` tokens + fresh tokens. Call k+1's prompt keeps the
  first `prompt_{k+1} - new_{k+1}` tokens of (prompt_k + output_k), then fresh
  tokens; so a pure append (new == prompt_{k+1} - prompt_k - output_k) starts
  with prompt_k + output_k exactly. (If the kept part is shorter than the
  shared prefix, the shared tokens are filled in before the fresh ones.)
* With `hash_ids`: the prompt is built from them exactly: block id h is a fixed
  run of `hash_block_size` tokens (same id -> same tokens within one program
  group, i.e. a program and its subagents, whose ids share one numbering), then
  the `prompt mod block` tail is fresh. `shared_prefix_tokens` is not applied
  (the ids already say what is shared). Outputs are fresh.
* Fresh tokens are unique to the program (no accidental cross-program hits).

Token ids: with `vocab_size=None` (the default, what the simulator wants) they
are large non-negative Python ints (< 2**104) built from contiguous ranges in
per-program namespaces (64-bit hashes of (seed, kind, name)), which makes plans
cheap. With an int `vocab_size` every id is < vocab_size: fresh and block
tokens are drawn from seeded RNGs (collisions of a whole block are
astronomically unlikely), e.g. to replay against a real model.
"""

from __future__ import annotations

import hashlib
import random
from typing import Sequence

from .trace import Program

_COUNTER_BITS = 40


def _namespace(rng_seed: int | str, kind: str, name: str) -> int:
    h = hashlib.blake2b(f"{rng_seed}\0{kind}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big")


class _Fresh:
    """Fresh token ids for one program: a contiguous range per request."""

    def __init__(self, rng_seed: int | str, name: str, vocab_size: int | None) -> None:
        self.vocab_size = vocab_size
        if vocab_size is None:
            self.next = _namespace(rng_seed, "fresh", name) << _COUNTER_BITS
        else:
            self.rng = random.Random(f"{rng_seed}\0fresh\0{name}")
            self.population = range(vocab_size)

    def take(self, n: int) -> list[int]:
        if n <= 0:
            return []
        if self.vocab_size is None:
            start = self.next
            self.next += n
            return list(range(start, start + n))
        return self.rng.choices(self.population, k=n)


def shared_token_pool(n: int, rng_seed: int | str, vocab_size: int | None = None) -> list[int]:
    """The workload-wide shared prefix pool (first n tokens); depends only on the seed."""
    if vocab_size is None:
        base = _namespace(rng_seed, "shared", "") << _COUNTER_BITS
        return list(range(base, base + n))
    return random.Random(f"{rng_seed}\0shared").choices(range(vocab_size), k=n)


class _Blocks:
    """Token runs of hash-block ids within one program group."""

    def __init__(self, rng_seed: int | str, group: str, vocab_size: int | None) -> None:
        self.rng_seed = rng_seed
        self.group = group
        self.vocab_size = vocab_size
        self.base = _namespace(rng_seed, "blocks", group) << _COUNTER_BITS
        self.cache: dict[tuple[int, int], list[int]] = {}

    def get(self, h: int, bs: int) -> list[int]:
        key = (h, bs)
        run = self.cache.get(key)
        if run is None:
            if self.vocab_size is None:
                start = h * bs
                if start < 0 or start + bs > (1 << _COUNTER_BITS):
                    raise ValueError(f"hash id {h} out of range for block size {bs}")
                run = list(range(self.base + start, self.base + start + bs))
            else:
                r = random.Random(f"{self.rng_seed}\0block\0{self.group}\0{h}")
                run = r.choices(range(self.vocab_size), k=bs)
            self.cache[key] = run
        return run


def program_token_plan(
    program: Program,
    rng_seed: int | str,
    vocab_size: int | None = None,
    shared_pool: Sequence[int] | None = None,
) -> list[tuple[list[int], list[int]]]:
    """Per call of `program`: (prompt_ids, output_ids), len == prompt_tokens / output_tokens.

    `rng_seed` is the workload seed: the same seed gives the same shared pool for
    every program and the same tokens for the same program (and group) id.
    `shared_pool` overrides the generated pool (must be at least as long as the
    largest shared_prefix_tokens). Build plans program by program (a plan holds
    every prompt in full)."""
    calls = program.calls
    need_shared = max((c.shared_prefix_tokens for c in calls), default=0)
    if shared_pool is None:
        shared: Sequence[int] = shared_token_pool(need_shared, rng_seed, vocab_size) if need_shared else []
    else:
        if len(shared_pool) < need_shared:
            raise ValueError(f"shared_pool has {len(shared_pool)} tokens, program needs {need_shared}")
        shared = shared_pool
    fresh = _Fresh(rng_seed, program.program_id, vocab_size)
    blocks: _Blocks | None = None
    plan: list[tuple[list[int], list[int]]] = []
    prev_prompt: list[int] = []
    prev_output: list[int] = []
    for k, c in enumerate(calls):
        if c.hash_ids is not None:
            if blocks is None:
                blocks = _Blocks(rng_seed, program.group_id, vocab_size)
            bs = c.hash_block_size
            prompt: list[int] = []
            for h in c.hash_ids:
                prompt += blocks.get(h, bs)
            prompt += fresh.take(c.prompt_tokens - len(prompt))
        else:
            s = min(c.shared_prefix_tokens, c.prompt_tokens)
            if k == 0:
                keep = 0
            else:
                keep = min(c.prompt_tokens - c.new_tokens, len(prev_prompt) + len(prev_output))
            if keep <= len(prev_prompt):
                prompt = prev_prompt[:keep]
            else:
                prompt = prev_prompt + prev_output[: keep - len(prev_prompt)]
            if keep < s:
                prompt += shared[keep:s]
            prompt += fresh.take(c.prompt_tokens - len(prompt))
        if len(prompt) != c.prompt_tokens:
            raise ValueError(
                f"{program.program_id} turn {c.turn}: built {len(prompt)} prompt tokens, "
                f"expected {c.prompt_tokens} (hash_ids longer than the prompt?)"
            )
        output = fresh.take(c.output_tokens)
        plan.append((prompt, output))
        prev_prompt, prev_output = prompt, output
    return plan
