"""Step-time cost model (pure Python, no torch): what the simulator's executor
charges a step, and the Prefill-Reload(r) the policies price a pin with on a
real server (runner/profiling.py reads it from a measured profile).

Prefill follows the CacheTTL paper's offline profile (Sec 5.2): the time to
prefill a context of L tokens is fitted as t(L) = a*L^2 + b*L + c. The same
coefficients price any chunk: computing tokens [s, s+n) costs the marginal
b*n + a*((s+n)^2 - s^2), so a prompt prefilled in chunks costs t(L) plus one
extra c per extra step.

One engine step (a forward pass over the scheduled chunks) is modelled as

    compute = sum over chunks of  b*n + a*((s+n)^2 - s^2)       (FLOP-bound)
    memory  = decode_weight_read_s                               (weights, read once per step,
              + kv_read_s_per_token * sum over chunks of (s+n)    shared by the batch; KV read
                                                                  by attention)
    forward = step_overhead_s + per_seq_overhead_s*(num_chunks-1) + max(compute, memory)

so a decode batch is memory-bound (weights + KV), a large prefill chunk is
compute-bound, and a decode token also pays its FLOPs once the batch is large.

On a model with sliding-window layers (the profile's `model.num_global_layers`
< `num_layers`, window W), a and kv_read are split by layer kind: a share g of
the layers (the global ones) as above, the other 1 - g attend to at most W
positions, so their attention costs a*(w(s+n) - w(s)) with w(x) = x^2 up to W
and W*(2x - W) past it (linear in the context past the window: each query
reads W keys), and a chunk's KV read is g*(s+n) + (1-g)*min(s+n, W+n-1).
What a token costs to re-prefill at a long context is then the model's, not
a full-attention model's of the same size.
Host<->device copies are priced at the profile's copy bandwidth:

    step = max(forward, spill + offload_copy) + load_copy + disk_load

offloads run on a copy stream overlapped with the forward pass; loads must land
before the forward pass reads them, so they add. With a disk tier, a spill (a
host slot written to the SSD at the profile's disk write bandwidth) runs before
the offload that reuses its slot, and a disk reload reads the SSD at the disk
read bandwidth and then copies to the device. Every term is non-decreasing
in tokens, context, sequences and blocks.

That is the step of an executor that runs its copies in the step. One that
overlaps them with compute (engine/executor.py) takes `forward` a step and
puts the step's copies on two links of their own, each one batch after the
other: the host link (`host_copy_time` = stage + offload_copy + load_copy,
where stage copies the spills' host slots out before an offload may reuse
them) and the disk link (`disk_copy_time` = spill + disk_load + the reads of a
prefetch's disk -> host stages), which starts a batch once the host link has
staged its spills. A request whose reloads are
on a link waits until they land there (sim/executor.py); nobody waits for a
spill, so a slow disk no longer holds up host reloads.
"""

from __future__ import annotations

import os

from agentserve.engine.scheduler_output import SchedulerOutput
from agentserve.cost.profile import Profile, load_profile

__all__ = ["CostModel"]


class CostModel:
    def __init__(self, profile: Profile | str | os.PathLike[str], block_size: int = 16,
                 block_share: float = 1.0) -> None:
        """`block_share`: the share of a block of every layer that one block of
        the KV pool holds (the hybrid layout's blocks hold the global layers'
        count of layers): what a block copy moves."""
        if not isinstance(profile, Profile):
            profile = load_profile(profile)
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.profile = profile
        self.block_size = block_size
        p = profile
        self._a = p.prefill_a_s_per_token2
        self._b = p.prefill_b_s_per_token
        self._c = p.step_overhead_s
        self._per_seq = p.per_seq_overhead_s
        self._weights = p.decode_weight_read_s
        self._kv_read = p.kv_read_s_per_token
        self._copy_latency = p.host_copy_latency_s
        self._copy_s_per_token = p.kv_bytes_per_token / p.host_copy_bandwidth_bytes_s
        self._copy_s_per_block = self._copy_s_per_token * block_size * block_share
        self.block_bytes = block_bytes = round(p.kv_bytes_per_token * block_size * block_share)
        self._disk_write_s_per_block = block_bytes / p.disk_write_bandwidth_bytes_s
        self._disk_read_s_per_block = block_bytes / p.disk_read_bandwidth_bytes_s
        m = p.model
        self._window = m.sliding_window if m.window_layers else 0  # 0: every layer global
        self._g = m.global_share

    def _attention(self, start: int, end: int) -> float:
        """The attention (quadratic) term of computing tokens [start, end)."""
        full = end * end - start * start
        w = self._window
        if not w:
            return self._a * full
        return self._a * (self._g * full + (1.0 - self._g) * (_windowed_sq(end, w) - _windowed_sq(start, w)))

    def _kv_read_tokens(self, end: int, num_tokens: int) -> float:
        """Tokens of KV (every layer's, on average) a chunk of `num_tokens` ending at `end` reads."""
        w = self._window
        if not w:
            return end
        return self._g * end + (1.0 - self._g) * min(end, w + num_tokens - 1)

    # ---- estimates used by policies (TTL model's Prefill-Reload(r)) ----

    def prefill_time(self, num_tokens: int, start: int = 0) -> float:
        """Time to prefill `num_tokens` tokens in one pass, after `start` tokens
        that already have KV. With start=0 this is the paper's t(L) = a*L^2 + b*L + c."""
        if num_tokens <= 0:
            return 0.0
        return self._c + self._b * num_tokens + self._attention(start, start + num_tokens)

    def reload_time(self, num_tokens: int) -> float:
        """Time to copy `num_tokens` tokens of KV from the host tier to the device."""
        if num_tokens <= 0:
            return 0.0
        return self._copy_latency + num_tokens * self._copy_s_per_token

    def disk_reload_time(self, num_tokens: int) -> float:
        """Time to read `num_tokens` tokens of KV from the disk tier and copy them to the device."""
        if num_tokens <= 0:
            return 0.0
        n = -(-num_tokens // self.block_size)
        return n * self._disk_read_s_per_block + self.copy_blocks_time(n)

    def tier_reloads(self) -> dict:
        """The reload time of each tier below the device, nearest first (PolicyContext.tier_reload)."""
        return {"host": self.reload_time, "disk": self.disk_reload_time}

    def copy_blocks_time(self, num_blocks: int) -> float:
        """Time for one batch of `num_blocks` block copies (either direction)."""
        if num_blocks <= 0:
            return 0.0
        return self._copy_latency + num_blocks * self._copy_s_per_block

    def decode_step_time(self, num_seqs: int, context_tokens: int) -> float:
        """A step of `num_seqs` decodes, each with `context_tokens` tokens of KV
        before the new one (a convenience for estimates and sanity checks)."""
        if num_seqs <= 0:
            return 0.0
        s = context_tokens
        compute = num_seqs * (self._b + self._attention(s, s + 1))
        memory = self._weights + self._kv_read * num_seqs * self._kv_read_tokens(s + 1, 1)
        return self._c + self._per_seq * (num_seqs - 1) + max(compute, memory)

    # ---- the executor's step ----

    def forward_time(self, output: SchedulerOutput) -> float:
        """The forward pass over `output.chunks` (no copies); 0 when there are none."""
        chunks = output.chunks
        if not chunks:
            return 0.0
        a, b = self._a, self._b
        compute = 0.0
        context = 0
        if self._window:
            for ch in chunks:
                e = ch.start + ch.num_tokens
                compute += b * ch.num_tokens + self._attention(ch.start, e)
                context += self._kv_read_tokens(e, ch.num_tokens)
        else:
            for ch in chunks:
                s = ch.start
                e = s + ch.num_tokens
                compute += b * ch.num_tokens + a * (e * e - s * s)
                context += e
        memory = self._weights + self._kv_read * context
        return self._c + self._per_seq * (len(chunks) - 1) + max(compute, memory)

    def host_copy_time(self, output: SchedulerOutput) -> float:
        """The host link's time for a step's copies: the spills' host slots
        copied out (staged for the disk link), then offloads, then reloads."""
        return (self.copy_blocks_time(len(output.blocks_to_spill))
                + self.copy_blocks_time(len(output.blocks_to_offload))
                + self.copy_blocks_time(len(output.blocks_to_load)))

    def disk_copy_time(self, output: SchedulerOutput) -> float:
        """The disk link's time for a step's copies: the staged spills written,
        then the disk reloads read and copied to the device, then the disk ->
        host stages read (into host memory: no device copy)."""
        n = len(output.blocks_to_load_disk)
        return (len(output.blocks_to_spill) * self._disk_write_s_per_block
                + (n + len(output.blocks_to_stage)) * self._disk_read_s_per_block + self.copy_blocks_time(n))

    def step_time(self, output: SchedulerOutput) -> float:
        """Modelled wall time of one engine step: copies plus forward pass."""
        forward = self.forward_time(output)
        offload = self.copy_blocks_time(len(output.blocks_to_offload))
        load = self.copy_blocks_time(len(output.blocks_to_load))
        spill = len(output.blocks_to_spill) * self._disk_write_s_per_block
        n = len(output.blocks_to_load_disk)
        disk_load = (n + len(output.blocks_to_stage)) * self._disk_read_s_per_block + self.copy_blocks_time(n)
        return max(forward, spill + offload) + load + disk_load


def _windowed_sq(x: int, window: int) -> int:
    """x^2 up to `window`, then growing linearly (W*(2x - W)): twice the
    query-key pairs of x causal positions whose queries read at most `window`
    keys, as the quadratic term counts them."""
    return x * x if x <= window else window * (2 * x - window)
