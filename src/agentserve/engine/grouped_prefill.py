"""Grouped prefill: a burst of agents that share a preamble (system prompt,
tool schemas) computes the shared blocks once.

A waiting request whose next prompt block past its prefix hit is one that a
running request is about to compute waits for it, and takes the blocks from
the prefix index once they are committed, instead of computing the same KV
again in the same steps. Requests that share nothing are admitted past it
meanwhile; a leader that is preempted stops being one."""

from __future__ import annotations

from agentserve.engine.request import Request, RequestStatus


def prefill_leaders(running: list[Request], block_size: int) -> list[Request]:
    """Running requests with at least one full block of prompt still to compute."""
    return [r for r in running
            if r.status is RequestStatus.RUNNING and len(r.token_ids) - r.num_computed_tokens > block_size]


def follows(req: Request, hit: int, leaders: list[Request], block_size: int) -> bool:
    """Whether one of `leaders` is about to compute `req`'s next block past
    its prefix hit of `hit` tokens."""
    bs = block_size
    if req.num_tokens - hit <= bs:
        return False  # only the last, partial block is left: always its own
    nxt = req.token_ids[hit:hit + bs]
    for r in leaders:
        # another salt's blocks are never a hit, so its leader is no one to wait for
        if r is not req and r.cache_salt == req.cache_salt and r.num_computed_tokens <= hit \
                and r.num_tokens >= hit + bs and r.token_ids[hit:hit + bs] == nxt:
            return True
    return False
