"""Batched token sampling on the device: greedy, temperature, top-k, top-p,
per-request seeds.

Random rows are drawn with the exponential race (argmax of p / E, E ~ Exp(1)),
which samples exactly from p and needs one noise draw per row: a seeded
request's noise for its j-th output token comes from a generator seeded
with (seed, j), so its tokens depend on its seed and its logits only, never
on what else shares the batch, nor on how many of its positions a step
computes. That is what makes speculation exact at any temperature: each
position of a verified draft is sampled as plain decoding would sample it,
and a draft token stands only where it equals that sample (the accepted
output is distributed exactly as without speculation, and with a seed it is
the same output token for token). A request
with a grammar constraint has the tokens its grammar forbids masked out first,
and its matcher advanced with the token drawn (with a draft: each row masked
as if the draft tokens before it stood, the matcher advanced with the tokens
that do). Only the sampled ids cross to
the host."""

from __future__ import annotations

import torch

from agentserve.engine.sampling_params import SamplingParams
from agentserve.runner import native

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


def greedy_ids(logits: torch.Tensor) -> list[int]:
    """logits.argmax(-1) as a list: on the CPU the native vector pass
    (csrc/argmax.c, the same choices), else torch's."""
    lib = native.layer_ops() if logits.device.type == "cpu" and logits.dtype is torch.float32 \
        and logits.dim() == 2 and logits.shape[1] > 0 else None
    if lib is None:
        return logits.argmax(dim=-1).tolist()
    logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.agentserve_argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr())
    return out.tolist()


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._seeded: torch.Generator | None = None  # re-seeded per (seed, output index)
        self._shared = torch.Generator(device=self.device)
        self._shared.seed()
        self._constraints = None  # ConstraintState, made on first use (needs xgrammar)

    def release(self, request_id: str) -> None:
        if self._constraints is not None:
            self._constraints.release(request_id)

    def _constrain(self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str],
                   drafts: list[int | None]) -> None:
        rows = [i for i, p in enumerate(params) if p.constraint is not None]
        if not rows:
            return
        if self._constraints is None:
            from agentserve.runner.structured import ConstraintState
            self._constraints = ConstraintState(logits.shape[1])
        self._constraints.mask(logits, rows, [params[i].constraint for i in rows], [request_ids[i] for i in rows],
                               [drafts[i] for i in rows])

    def _accept(self, tokens: list[int], params: list[SamplingParams], request_ids: list[str],
                drafts: list[int | None]) -> list[int]:
        """Advance the grammar matchers with the tokens that stand: a request's
        rows in order, up to the first whose token differs from the draft token
        it verifies (the scheduler keeps exactly those)."""
        if self._constraints is not None:
            done: set[str] = set()
            for tok, p, rid, d in zip(tokens, params, request_ids, drafts):
                if p.constraint is None or rid in done:
                    continue
                self._constraints.accept(rid, tok)
                if d is None or tok != d:
                    done.add(rid)
        return tokens

    def _generator(self, seed: int, step: int) -> torch.Generator:
        g = self._seeded
        if g is None:
            g = self._seeded = torch.Generator(device=self.device)
        g.manual_seed(_mix(seed, step))
        return g

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str],
               steps: list[int] | None = None, drafts: list[int | None] | None = None) -> list[int]:
        """logits [rows, vocab] float32 -> one token id per row. steps: the
        output index each row samples (seeded rows draw their noise by it;
        None: 0 for every row). drafts: the draft token each row verifies
        (None: the row ends its request's rows); a request's rows are
        consecutive, and a grammar masks each of them as if the draft tokens
        before it had been accepted."""
        drafts = drafts if drafts is not None else [None] * len(params)
        self._constrain(logits, params, request_ids, drafts)
        if all(p.greedy for p in params):
            return self._accept(greedy_ids(logits), params, request_ids, drafts)
        rows = logits.shape[0]
        greedy = torch.tensor([p.greedy for p in params], device=self.device)
        temp = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=self.device)
        scaled = logits / temp[:, None]
        order = None
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params if not p.greedy):
            scaled, order = _truncate(scaled, params, self.device)
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs)
        shared_rows = []
        for i, (p, rid) in enumerate(zip(params, request_ids)):
            if p.greedy:
                noise[i].fill_(1.0)
            elif p.seed is not None:
                noise[i].exponential_(generator=self._generator(p.seed, steps[i] if steps is not None else 0))
            else:
                shared_rows.append(i)
        if shared_rows:
            idx = torch.tensor(shared_rows, device=self.device)
            noise[idx] = torch.empty(len(shared_rows), probs.shape[1], device=self.device).exponential_(
                generator=self._shared)
        drawn = (probs / noise).argmax(dim=-1)
        if order is not None:
            drawn = order.gather(1, drawn[:, None]).squeeze(1)
        out = torch.where(greedy, logits.argmax(dim=-1), drawn)
        assert out.shape[0] == rows
        return self._accept(out.tolist(), params, request_ids, drafts)


def _mix(seed: int, step: int) -> int:
    """A 63-bit generator seed from (seed, output index): splitmix64 of both."""
    x = (seed * 0x9E3779B97F4A7C15 + step + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) >> 1


def _truncate(scaled: torch.Tensor, params: list[SamplingParams], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row and mask what top-k and top-p drop; returns the masked
    sorted logits and the sort order (to map a drawn position back to a token)."""
    vocab = scaled.shape[1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    ranks = torch.arange(vocab, device=device)[None, :]
    drop = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    drop = before >= top_p[:, None]
    drop[:, 0] = False  # the most likely token always stays
    return sorted_logits.masked_fill(drop, float("-inf")), order
