"""Attention over the paged KV cache for one mixed batch.

A step's tokens are flattened: the decode rows first (one query each), then
each prefill chunk's rows. Every layer writes the new K/V into the cache by
slot, then
* decode rows attend together: their contexts are gathered from the cache into
  one padded [rows, kv_heads, max_ctx, head_dim] batch with a padding mask, and
  the query heads of each KV group are folded into the query-length dimension
  so grouped-query attention needs no K/V repeat;
* each prefill chunk attends alone: a chunk that starts at position 0 attends
  causally to its own K/V; a chunk after a prefix (a cache hit, or an earlier
  chunk) gathers its whole context from the cache and uses an offset causal
  mask.
The metadata (slots, gather indices, masks) is built once per step and shared
by all layers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    row_start: int  # first row of this chunk in the flattened batch
    num_rows: int
    start: int  # position of the chunk's first token
    gather: torch.Tensor | None  # [start + num_rows] context slots; None when start == 0
    mask: torch.Tensor | None  # [num_rows, start + num_rows] bool, True = may attend


@dataclass
class DecodeBatch:
    num_rows: int
    gather: torch.Tensor  # [rows, max_ctx] slots (padded with slot 0)
    mask: torch.Tensor  # [rows, 1, 1, max_ctx] bool, True = may attend


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V goes to
    decode: DecodeBatch | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)


def context_slots(table: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """Slots of positions [0, length) given a block table tensor."""
    offs = torch.arange(block_size, device=table.device)
    return (table[:, None] * block_size + offs).reshape(-1)[:length]


def build_metadata(decode_tables: list[list[int]], decode_lens: list[int],
                   prefills: list[tuple[list[int], int, int]], block_size: int,
                   device: torch.device) -> AttentionMetadata:
    """decode_tables/decode_lens: block table and context length (including the
    new token) of each decode row. prefills: (block table, start, num_tokens)."""
    slot_parts: list[torch.Tensor] = []
    decode = None
    bs = block_size
    if decode_tables:
        nb = max(len(t) for t in decode_tables)
        tables = torch.tensor([t + [0] * (nb - len(t)) for t in decode_tables], dtype=torch.int64)
        lens = torch.tensor(decode_lens, dtype=torch.int64)
        max_ctx = int(lens.max())
        offs = torch.arange(bs, dtype=torch.int64)
        gather = (tables[:, :, None] * bs + offs).reshape(len(decode_tables), -1)[:, :max_ctx]
        mask = torch.arange(max_ctx)[None, :] < lens[:, None]
        last = lens - 1
        slot_parts.append(tables.gather(1, (last // bs)[:, None]).squeeze(1) * bs + last % bs)
        decode = DecodeBatch(len(decode_tables), gather.to(device), mask[:, None, None, :].to(device))
    spans = []
    row = len(decode_tables)
    for table, start, n in prefills:
        t = torch.tensor(table, dtype=torch.int64)
        ctx = context_slots(t, bs, start + n)
        slot_parts.append(ctx[start:])
        if start == 0:
            spans.append(PrefillSpan(row, n, 0, None, None))
        else:
            q_pos = torch.arange(start, start + n)
            mask = torch.arange(start + n)[None, :] <= q_pos[:, None]
            spans.append(PrefillSpan(row, n, start, ctx.to(device), mask.to(device)))
        row += n
    slots = torch.cat(slot_parts) if slot_parts else torch.empty(0, dtype=torch.int64)
    return AttentionMetadata(slots.to(device), decode, spans)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, heads, d], k/v [T, kv_heads, d] for the step's new tokens;
    k_cache/v_cache [slots, kv_heads, d]. Returns [T, heads * d]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    T, H, D = q.shape
    KVH = k.shape[1]
    G = H // KVH
    out = torch.empty_like(q)
    dec = meta.decode
    if dec is not None:
        B = dec.num_rows
        qd = q[:B].view(B, KVH, G, D)
        kd = k_cache[dec.gather].transpose(1, 2)  # [B, KVH, ctx, D]
        vd = v_cache[dec.gather].transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=dec.mask, scale=scale)
        out[:B] = od.reshape(B, H, D)
    for sp in meta.prefills:
        a, b = sp.row_start, sp.row_start + sp.num_rows
        qs = q[a:b].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if sp.gather is None:
            ks = k[a:b].transpose(0, 1).unsqueeze(0)
            vs = v[a:b].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=G > 1)
        else:
            ks = k_cache[sp.gather].transpose(0, 1).unsqueeze(0)  # [1, KVH, ctx, D]
            vs = v_cache[sp.gather].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=sp.mask, scale=scale, enable_gqa=G > 1)
        out[a:b] = o.squeeze(0).transpose(0, 1)
    return out.view(T, H * D)
