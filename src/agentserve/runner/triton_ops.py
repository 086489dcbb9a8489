"""The Triton kernels of runner/triton_kernels.py as calls on tensors, and
whether a CUDA device runs them (`unavailable`): Triton installed (it ships
with torch's CUDA builds), AGENTSERVE_ATTENTION not `torch`, and a first small
decode on the device agreeing with torch's attention. Where they do not run,
CUDA keeps the portable path (torch's SDPA over gathered blocks, torch's small
ops), and the model says why in one log line.

`TritonLayerOps` has runner/layer_ops.py's interface, so the model's fused
decode step (`LlamaModel._forward_fused`) runs on a GPU as it does on the CPU,
in bfloat16 or float16; float32 keeps torch's ops (the path checked token for
token against transformers)."""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F


def _kernels():
    """runner/triton_kernels.py, imported on first use (a CPU-only start never pays Triton's import)."""
    from agentserve.runner import triton_kernels
    return triton_kernels

TOKENS_PER_TILE = 64  # keys a decode program reads per step of its online softmax
MAX_SPLITS = 16


def interpreted() -> bool:
    """Triton's CPU interpreter (the tests' way of running the kernels without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _p2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def unavailable(device: torch.device | str) -> str | None:
    """None when the Triton kernels run on `device`; else why not."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the Triton kernels run on CUDA devices, not {device.type}"
    if _kernels().triton is None:
        return "Triton is not installed"
    if os.environ.get("AGENTSERVE_ATTENTION", "auto").strip().lower() == "torch":
        return "AGENTSERVE_ATTENTION=torch"
    return _probe(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _probe(index: int) -> str | None:
    """Compile and run a small decode on the device, against torch's attention."""
    dev = torch.device("cuda", index)
    try:
        g = torch.Generator(device=dev).manual_seed(0)
        kc = torch.randn(2, 4, 16, 64, device=dev, generator=g, dtype=torch.bfloat16)
        vc = torch.randn(2, 4, 16, 64, device=dev, generator=g, dtype=torch.bfloat16)
        q = torch.randn(1, 4, 64, device=dev, generator=g, dtype=torch.bfloat16)
        tables = torch.tensor([[2, 0, 3]], dtype=torch.int32, device=dev)
        lens = torch.tensor([40], dtype=torch.int32, device=dev)
        got = paged_decode(q, kc, vc, tables, lens, 0.125, None, 2).float()
        k = kc[:, [2, 0, 3]].reshape(2, 48, 64)[:, :40].float()
        v = vc[:, [2, 0, 3]].reshape(2, 48, 64)[:, :40].float()
        want = F.scaled_dot_product_attention(q.float().view(2, 2, 64), k, v, scale=0.125).view(1, 4, 64)
        torch.cuda.synchronize(dev)
    except Exception as e:  # a compiler or driver that cannot build the kernels: the portable path
        return f"the Triton kernels failed on {torch.cuda.get_device_name(dev)}: {type(e).__name__}: {e}"
    err = (got - want).abs().max().item()
    if not err < 0.05:
        return f"the Triton decode kernel disagrees with torch's attention on this device (max error {err:.3g})"
    return None


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k/v [T, kv_heads, d] into the caches [kv_heads, blocks, block_size, d] at
    `slots` (block * block_size + offset; negative: skipped)."""
    T, KVH, D = k.shape
    if T == 0:
        return
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("write_kv takes rows of contiguous head dims and two caches of one layout")
    _kernels().write_kv[(T, KVH)](k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                         *k_cache.stride()[:3], BS=k_cache.shape[2], D=D, DP=_p2(D))


def decode_splits(batch: int, kv_heads: int, device: torch.device) -> int:
    """Parts a decode row's context is split into: enough (row, KV head, part)
    programs for two waves over the card's multiprocessors. A function of the
    batch rounded up to a power of two, so a captured graph (runner/cuda_graphs.py)
    and the eager step of the same batch split alike."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    n = 2 * sms // (_p2(batch) * kv_heads)
    return max(1, min(MAX_SPLITS, 1 << (n.bit_length() - 1) if n > 0 else 1))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, scale: float, window: int | None, splits: int) -> torch.Tensor:
    """One query row per sequence: q [B, heads, d]; tables int32 [B, >= blocks
    of the longest row]; lens int32 [B] (context with the new token; 0 gives
    zeros); a sliding window W lets the row see its last W keys. Returns
    [B, heads, d] in q's dtype."""
    B, H, D = q.shape
    KVH, _, BS, _ = k_cache.shape
    G = H // KVH
    if q.stride(2) != 1 or tables.stride(1) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("paged_decode takes contiguous head dims, block tables and caches of one layout")
    out = torch.empty((B, H, D), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    DP = max(16, _p2(D))
    if splits > 1:
        po = torch.empty((B * H * splits, DP), dtype=torch.float32, device=q.device)
        pml = torch.empty((B * H * splits * 2,), dtype=torch.float32, device=q.device)
    else:
        po = pml = out  # not written with one part
    upcast = q.dtype is torch.float32 or k_cache.dtype is torch.float32 or interpreted()
    _kernels().paged_decode[(B, KVH, splits)](
        q, k_cache, v_cache, tables, lens, out, po, pml, float(scale), int(window or 0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3], tables.stride(0), H,
        G=G, GP=max(16, _p2(G)), D=D, DP=DP, BS=BS, TOK=TOKENS_PER_TILE, SPLITS=splits, UPCAST=upcast,
        num_warps=4)
    if splits > 1:
        _kernels().decode_reduce[(B, H)](po, pml, out, out.stride(0), out.stride(1), H, SPLITS=splits,
                                         SP=max(2, _p2(splits)), D=D, DP=DP)
    return out


class TritonLayerOps:
    """runner/layer_ops.py's LayerOps on a CUDA device, in bfloat16 or float16."""

    f32 = False

    @staticmethod
    def create(dtype: torch.dtype, device: torch.device) -> "TritonLayerOps | None":
        if dtype not in (torch.bfloat16, torch.float16) or unavailable(device) is not None:
            return None
        return TritonLayerOps()

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out: torch.Tensor, delta_weight: torch.Tensor | None = None) -> torch.Tensor:
        """h += delta (in place, when given; RMSNorm(delta) * delta_weight where
        that is given); returns out = RMSNorm(h) * weight."""
        T, dim = h.shape
        if T:
            delta = None if delta is None else delta.contiguous()
            dw = weight if delta_weight is None else delta_weight
            _kernels().add_rms_norm[(T,)](h, h if delta is None else delta, dw, weight, out, dim, float(eps),
                                          HAS_DELTA=delta is not None, HAS_DW=delta_weight is not None,
                                          BLOCK=_p2(dim), num_warps=8 if dim > 2048 else 4)
        return out

    def rope_kv(self, qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor,
                sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slots: torch.Tensor, qk_norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
        """Norms q and k per head (with `qk_norm` [heads + kv_heads, head_dim]),
        rotates them; k and v go into the cache at `slots` (negative: skipped);
        returns q [T, heads, head_dim] in the cache's dtype."""
        qkv = qkv.contiguous()
        T = qkv.shape[0]
        q = torch.empty(T, heads, head_dim, dtype=k_cache.dtype, device=qkv.device)
        if T:
            if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
                raise ValueError("rope_kv takes two caches of one layout")
            half = head_dim // 2
            _kernels().rope_kv[(T, heads + 2 * kv_heads)](
                qkv, q, k_cache, v_cache, cos, sin, positions, slots, qkv if qk_norm is None else qk_norm,
                float(eps), qkv.stride(0), *k_cache.stride()[:3], H=heads, KVH=kv_heads, D=head_dim, HALF=half,
                HP=_p2(half), BS=k_cache.shape[2], HAS_NORM=qk_norm is not None)
        return q

    def _gated(self, gu: torch.Tensor, gelu: bool) -> torch.Tensor:
        gu = gu.contiguous()
        T, two = gu.shape
        out = torch.empty(T, two // 2, dtype=gu.dtype, device=gu.device)
        if T:
            block = 1024
            _kernels().gated_act[(T, -(-(two // 2) // block))](gu, out, two // 2, GELU=gelu, BLOCK=block)
        return out

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        return self._gated(gu, False)

    def gelu_tanh_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """gu [T, 2I] (gate then up) -> [T, I] = F.gelu(gate, approximate="tanh") * up."""
        return self._gated(gu, True)
