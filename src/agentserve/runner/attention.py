"""Attention over the paged KV cache for one mixed batch.

A step's tokens are flattened: the decode rows first (one query each), then
each prefill chunk's rows. Every layer writes the new K/V into the cache by
slot, then
* decode rows attend together: their blocks are gathered from the cache into
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
    blocks: torch.Tensor | None  # block table covering [0, start + num_rows); None when start == 0
    mask: torch.Tensor | None  # [num_rows, start + num_rows] bool, True = may attend


@dataclass
class DecodeBatch:
    num_rows: int
    blocks: torch.Tensor  # [rows * max_blocks] block ids, each row padded with block 0
    max_blocks: int
    mask: torch.Tensor | None  # [rows, 1, 1, max_blocks * block_size] bool, True = may attend


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V goes to
    decode: DecodeBatch | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)


def build_metadata(decode_tables: list[list[int]], decode_lens: list[int],
                   prefills: list[tuple[list[int], int, int]], block_size: int,
                   device: torch.device) -> AttentionMetadata:
    """decode_tables/decode_lens: block table and context length (including the
    new token) of each decode row. prefills: (block table, start, num_tokens).
    Tables must cover their context and no more."""
    slots: list[int] = []
    decode = None
    bs = block_size
    if decode_tables:
        nb = max(len(t) for t in decode_tables)
        padded = [t + [0] * (nb - len(t)) for t in decode_tables]
        mask = None
        if any(n != nb * bs for n in decode_lens):
            lens = torch.tensor(decode_lens, dtype=torch.int64)
            mask = (torch.arange(nb * bs)[None, :] < lens[:, None])[:, None, None, :].to(device)
        for t, n in zip(decode_tables, decode_lens):
            slots.append(t[(n - 1) // bs] * bs + (n - 1) % bs)
        decode = DecodeBatch(len(decode_tables), torch.tensor(padded, dtype=torch.int64).view(-1).to(device),
                             nb, mask)
    spans = []
    row = len(decode_tables)
    for table, start, n in prefills:
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
        if start == 0:
            spans.append(PrefillSpan(row, n, 0, None, None))
        else:
            q_pos = torch.arange(start, start + n)
            mask = torch.arange(start + n)[None, :] <= q_pos[:, None]
            spans.append(PrefillSpan(row, n, start, torch.tensor(table, dtype=torch.int64).to(device),
                                     mask.to(device)))
        row += n
    return AttentionMetadata(torch.tensor(slots, dtype=torch.int64).to(device), decode, spans)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, heads, d], k/v [T, kv_heads, d] for the step's new tokens;
    k_cache/v_cache [kv_heads, blocks, block_size, d]. Returns [T, heads * d]."""
    T, H, D = q.shape
    KVH, NB, BS, _ = k_cache.shape
    G = H // KVH
    k_cache.view(KVH, NB * BS, D).index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    v_cache.view(KVH, NB * BS, D).index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    dec = meta.decode
    if dec is not None and not meta.prefills:
        return _decode(q, k_cache, v_cache, dec, scale).reshape(T, H * D)
    out = torch.empty_like(q)
    if dec is not None:
        out[:dec.num_rows] = _decode(q[:dec.num_rows], k_cache, v_cache, dec, scale)
    for sp in meta.prefills:
        a, b = sp.row_start, sp.row_start + sp.num_rows
        qs = q[a:b].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if sp.blocks is None:
            ks = k[a:b].transpose(0, 1).unsqueeze(0)
            vs = v[a:b].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=G > 1)
        else:
            ctx = sp.start + sp.num_rows
            ks = k_cache.index_select(1, sp.blocks).view(1, KVH, -1, D)[:, :, :ctx]
            vs = v_cache.index_select(1, sp.blocks).view(1, KVH, -1, D)[:, :, :ctx]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=sp.mask, scale=scale, enable_gqa=G > 1)
        out[a:b] = o.squeeze(0).transpose(0, 1)
    return out.view(T, H * D)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, dec: DecodeBatch,
            scale: float) -> torch.Tensor:
    """All decode rows at once: gather whole blocks, fold each KV group's query
    heads into the query-length dimension. Returns [rows, heads, d]."""
    B = dec.num_rows
    KVH, _, BS, D = k_cache.shape
    G = q.shape[1] // KVH
    ctx = dec.max_blocks * BS
    # [KVH, B * blocks, BS, D] -> [B, KVH, ctx, D]: per (row, head) one contiguous slab
    kd = k_cache.index_select(1, dec.blocks).view(KVH, B, ctx, D).transpose(0, 1)
    vd = v_cache.index_select(1, dec.blocks).view(KVH, B, ctx, D).transpose(0, 1)
    qd = q.view(B, KVH, G, D)
    od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=dec.mask, scale=scale)
    return od.reshape(B, KVH * G, D)
