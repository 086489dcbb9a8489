"""Attention over the paged KV cache for one mixed batch.

A step's tokens are flattened: the decode rows first (one query each), then
each prefill chunk's rows. Every layer writes the new K/V into the cache by
slot, then attends with one of two mechanisms:

The native kernel (csrc/paged_attention.c, loaded by runner/native.py; the
default on the CPU when it builds): decode rows and prefill chunks after a
prefix read K/V block by block where they lie in the cache, with an online
softmax, so a step costs what attention must read once, not a padded copy of
every sequence's context, and no [rows, context] mask is ever built. In
bfloat16 (with AVX512-BF16) every prefill chunk, however long, goes through it:
its big-tile path (bfloat16 dot products for the scores, float32 weighted V)
runs causal chunks of every length faster than torch's flash kernel
(docs/kernels.md, 'Native attention for prefill chunks'). In float32 a chunk of
GEMM_CHUNK_ROWS rows or more attends with torch's flash kernel instead:
causally to its own new K/V, plus, after a prefix, to the prefix's blocks,
merged by log-sum-exp.

On CUDA (meta.gpu, runner/triton_ops.py) the decode rows attend on a Triton
kernel that reads each row's blocks in place, and prefill chunks take the torch
path below; without Triton, decode rows take it too.

The torch path (fallback: no compiler, CUDA, AGENTSERVE_ATTENTION=torch):
* decode rows attend together: their blocks are gathered from the cache into
  one padded [rows, kv_heads, max_ctx, head_dim] batch with a padding mask, and
  the query heads of each KV group are folded into the query-length dimension
  so grouped-query attention needs no K/V repeat;
* each prefill chunk attends alone: a chunk that starts at position 0 attends
  causally to its own K/V; a chunk after a prefix (a cache hit, or an earlier
  chunk) gathers its whole context from the cache and uses an offset causal
  mask.
The metadata (slots, segments or gather indices and masks) is built once per
step and shared by all layers.

Sliding windows (Mistral, Gemma 3's local layers): `paged_attention(...,
window=W)` lets a query at position p see the keys at positions j with
p - W < j <= p, the W positions ending at its own. This is transformers' rule
exactly (masking_utils: `sliding_window_overlay` keeps kv_idx > q_idx -
sliding_window, and-ed with the causal kv_idx <= q_idx; its sliding-window
cache likewise keeps the last W - 1 keys beside the new one); window None is
full causal attention. A step's metadata lays itself out once per window it is
asked for (`AttentionMetadata.for_window`, cached on it), so layers of two
kinds share one metadata. On the native path the kernel reads only the blocks
inside each row's window (a decode row on a window-W layer reads W keys at any
context) and masks the rest of a chunk's rows; chunks whose context exceeds the
window go through it even where they would otherwise use torch's flash kernel,
which has no window mask. On the torch path decode rows and chunks after a
prefix gather only the blocks from their window's first one, with a mask, and
a fresh chunk longer than the window attends to its own K/V with a mask."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from agentserve.runner import native, triton_ops
from agentserve.runner.attention_metadata import (  # noqa: F401  (the step's layout, re-exported for callers)
    AttentionMetadata,
    DecodeBatch,
    GpuDecode,
    NativeSegments,
    PrefillSpan,
    build_metadata,
    use_native,
)

# The kernel splits a context into partitions of at least this many tokens when
# there are fewer (row tile, head) items than cores to keep busy.
MIN_PARTITION_TOKENS = 256


def _native_attention(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      segs: NativeSegments, scale: float, window: int | None) -> None:
    lib = native.paged_attention_kernel()
    KVH, NB, BS, D = k_cache.shape
    G = q.shape[1] // KVH
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    rc = lib.agentserve_paged_attention(
        1 if q.dtype is torch.bfloat16 else 0, ptr(q), ptr(out), ptr(k_cache), ptr(v_cache),
        NB, BS, KVH, G, D, *segs.args, scale, torch.get_num_threads(), MIN_PARTITION_TOKENS, window or 0)
    if rc != 0:
        raise RuntimeError(f"native paged attention refused its arguments (code {rc}: head_dim <= 256, "
                           f"block_size <= 128, at most 16 query heads per KV head and a window >= 0 "
                           f"are supported)")


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
    """q [T, heads, d], k/v [T, kv_heads, d] for the step's new tokens;
    k_cache/v_cache [kv_heads, blocks, block_size, d]. Writes k/v into the cache,
    then attends: with window None causally (a query at position p sees keys
    0..p), with a sliding window W the keys j with p - W < j <= p (W keys, its
    own included; transformers' sliding-window mask). Returns [T, heads * d]."""
    T, H, D = q.shape
    KVH, NB, BS, _ = k_cache.shape
    G = H // KVH
    if meta.gpu is not None:  # a negative slot (a captured graph's padding row) is skipped
        triton_ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    else:  # a 16-bit cache under float32 compute (--kv-dtype): the K/V are rounded as they are written
        k_cache.view(KVH, NB * BS, D).index_copy_(1, meta.slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
        v_cache.view(KVH, NB * BS, D).index_copy_(1, meta.slot_mapping, v.transpose(0, 1).to(v_cache.dtype))
    if meta.kernel:
        return attend_native(q, k, v, k_cache, v_cache, meta, scale, window)
    k, v = _as_cached(k, k_cache), _as_cached(v, v_cache)
    if window is not None:
        meta = meta.for_window(window)
    dec, gpu = meta.decode, meta.gpu
    rows = dec.num_rows if dec is not None else gpu.num_rows if gpu is not None else 0
    if rows and not meta.prefills:
        return _decode_rows(q, k_cache, v_cache, meta, scale).reshape(T, H * D)
    out = torch.empty_like(q)
    if rows:
        out[:rows] = _decode_rows(q[:rows], k_cache, v_cache, meta, scale)
    for sp in meta.prefills:
        a, b = sp.row_start, sp.row_start + sp.num_rows
        qs = q[a:b].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if sp.blocks is None:
            out[a:b] = _fresh_chunk(q[a:b], k[a:b], v[a:b], scale, G, sp.mask)
            continue
        else:
            ctx = sp.start + sp.num_rows - sp.kv_start
            ks = k_cache.index_select(1, sp.blocks).view(1, KVH, -1, D)[:, :, :ctx].to(q.dtype)
            vs = v_cache.index_select(1, sp.blocks).view(1, KVH, -1, D)[:, :, :ctx].to(q.dtype)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=sp.mask, scale=scale, enable_gqa=G > 1)
        out[a:b] = o.squeeze(0).transpose(0, 1)
    return out.view(T, H * D)


def attend_cached(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, window: int | None = None) -> torch.Tensor:
    """Attention once the step's K/V are in the cache, for a step with no long
    chunk (meta.prefills empty): the native kernel's (meta.kernel) or the Triton
    decode kernel's (meta.gpu, decode rows only). Returns [T, heads * d]."""
    if meta.kernel:
        return attend_native(q, None, None, k_cache, v_cache, meta, scale, window)
    if meta.gpu is None or meta.prefills or meta.decode is not None:
        raise ValueError("attend_cached takes a native step or a decode-only step on the GPU")
    T, H, D = q.shape
    return _decode_rows(q, k_cache, v_cache, meta.for_window(window), scale).view(T, H * D)


def _decode_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float) -> torch.Tensor:
    """The decode rows (the first rows of q): on the Triton kernel in place, or
    gathered for torch's SDPA. Returns [rows, heads, d]."""
    gpu = meta.gpu
    if gpu is None:
        return _decode(q, k_cache, v_cache, meta.decode, scale)
    splits = triton_ops.decode_splits(gpu.num_rows, k_cache.shape[0], q.device)
    return triton_ops.paged_decode(q, k_cache, v_cache, gpu.tables, gpu.lens, scale, meta.window, splits)


def attend_native(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                  window: int | None = None) -> torch.Tensor:
    """The native path (meta.kernel), once the step's K/V are in the cache;
    `window` as in paged_attention. The step's own k and v are read only by
    long chunks on matrix kernels (meta.prefills); without those they may be
    None, under any window. Returns [T, heads * d]."""
    T, H, D = q.shape
    G = H // k_cache.shape[0]
    if q.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the native attention kernel takes float32 or bfloat16, not {q.dtype}")
    if meta.prefills and (k is None or v is None):
        raise ValueError("long chunks on matrix kernels need the step's own k and v")
    if window is not None:
        meta = meta.for_window(window)
    k, v = _as_cached(k, k_cache), _as_cached(v, v_cache)
    q = q.contiguous()
    out = torch.empty_like(q)
    if meta.native is not None:
        if q.dtype is k_cache.dtype:
            _native_attention(q, out, k_cache, v_cache, meta.native, scale, meta.window)
        else:  # a bfloat16 cache under float32 compute: the kernel reads q in the cache's dtype
            low = torch.empty(q.shape, dtype=k_cache.dtype)
            _native_attention(q.to(k_cache.dtype), low, k_cache, v_cache, meta.native, scale, meta.window)
            out.copy_(low)
    for sp in meta.prefills:  # long chunks: matrix-multiply kernels
        a, b = sp.row_start, sp.row_start + sp.num_rows
        if sp.blocks is None:
            out[a:b] = _fresh_chunk(q[a:b], k[a:b], v[a:b], scale, G)
        else:
            out[a:b] = _chunk_after_prefix(q[a:b], k[a:b], v[a:b], k_cache, v_cache, sp, scale)
    return out.view(T, H * D)


def _as_cached(x: torch.Tensor | None, cache: torch.Tensor) -> torch.Tensor | None:
    """The step's own K or V as the cache holds them (rounded to a 16-bit cache's
    dtype), so a chunk reads its own tokens as every later step will."""
    if x is None or x.dtype is cache.dtype:
        return x
    return x.to(cache.dtype).to(x.dtype)


def _fresh_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, G: int,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """A chunk at position 0 attends to its own K/V: causally, or by `mask`
    ([n, n], a sliding window's). Returns [n, heads, d]."""
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale,
                                       enable_gqa=G > 1)
    return o.squeeze(0).transpose(0, 1)


def _chunk_after_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, sp: PrefillSpan, scale: float) -> torch.Tensor:
    """A long chunk after a prefix, without a [rows, context] mask: attention to
    the prefix (every row sees all of it; the KV group's query heads folded into
    the query length) and causal attention to the chunk itself, merged with
    their log-sum-exps. Returns [n, heads, d]."""
    n, H, D = q.shape
    KVH = k_cache.shape[0]
    G = H // KVH
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    kp = k_cache.index_select(1, sp.blocks).view(1, KVH, -1, D)[:, :, :sp.start].to(q.dtype)
    vp = v_cache.index_select(1, sp.blocks).view(1, KVH, -1, D)[:, :, :sp.start].to(q.dtype)
    qf = q.view(n, KVH, G, D).permute(1, 2, 0, 3).reshape(1, KVH, G * n, D)
    o1, lse1 = flash(qf, kp, vp, 0.0, False, scale=scale)
    o1 = o1.view(KVH, G, n, D).permute(2, 0, 1, 3).reshape(n, H, D)
    lse1 = lse1.view(KVH, G, n).permute(2, 0, 1).reshape(n, H)
    qs = q.transpose(0, 1).unsqueeze(0)
    ks = k.repeat_interleave(G, dim=1).transpose(0, 1).unsqueeze(0)
    vs = v.repeat_interleave(G, dim=1).transpose(0, 1).unsqueeze(0)
    o2, lse2 = flash(qs, ks, vs, 0.0, True, scale=scale)
    o2 = o2.squeeze(0).transpose(0, 1)
    lse2 = lse2.squeeze(0).transpose(0, 1)
    m = torch.maximum(lse1, lse2)
    w1 = (lse1 - m).exp().unsqueeze(-1)
    w2 = (lse2 - m).exp().unsqueeze(-1)
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).to(q.dtype)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, dec: DecodeBatch,
            scale: float) -> torch.Tensor:
    """All decode rows at once: gather whole blocks, fold each KV group's query
    heads into the query-length dimension. Returns [rows, heads, d]."""
    B = dec.num_rows
    KVH, _, BS, D = k_cache.shape
    G = q.shape[1] // KVH
    ctx = dec.max_blocks * BS
    # [KVH, B * blocks, BS, D] -> [B, KVH, ctx, D]: per (row, head) one contiguous slab
    kd = k_cache.index_select(1, dec.blocks).view(KVH, B, ctx, D).transpose(0, 1).to(q.dtype)
    vd = v_cache.index_select(1, dec.blocks).view(KVH, B, ctx, D).transpose(0, 1).to(q.dtype)
    qd = q.view(B, KVH, G, D)
    od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=dec.mask, scale=scale)
    return od.reshape(B, KVH * G, D)
