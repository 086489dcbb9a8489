"""The small per-layer operations of a bfloat16 forward on the CPU, one native
call each (csrc/layer_ops.c): residual add + RMSNorm, rotary embedding + KV
write, SiLU-and-multiply, tanh-GELU-and-multiply (Gemma's GeGLU). `LayerOps.create` returns None where they do not
apply (float32, a GPU, no native library); the model then uses torch."""

from __future__ import annotations

import ctypes

import torch

from agentserve.runner import native


class LayerOps:
    __slots__ = ("lib",)

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    @staticmethod
    def create(dtype: torch.dtype, device: torch.device) -> "LayerOps | None":
        if dtype is not torch.bfloat16 or device.type != "cpu":
            return None
        lib = native.layer_ops()
        return None if lib is None else LayerOps(lib)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out: torch.Tensor) -> torch.Tensor:
        """h += delta (in place, when given); returns out = RMSNorm(h) * weight."""
        T, dim = h.shape
        self.lib.agentserve_add_rms_norm(h.data_ptr(), None if delta is None else delta.contiguous().data_ptr(),
                                         weight.data_ptr(), out.data_ptr(), T, dim, eps, torch.get_num_threads())
        return out

    def rope_kv(self, qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor,
                sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
        """Rotates the fused projection's q and k; k and v go into the cache at
        `slots`; returns q [T, heads, head_dim]."""
        qkv = qkv.contiguous()
        T = qkv.shape[0]
        q = torch.empty(T, heads, head_dim, dtype=qkv.dtype)
        kvh, nb, bs, _ = k_cache.shape
        self.lib.agentserve_rope_kv(qkv.data_ptr(), T, heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                                    positions.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), nb * bs,
                                    slots.data_ptr(), q.data_ptr(), torch.get_num_threads())
        return q

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        gu = gu.contiguous()
        T, two = gu.shape
        out = torch.empty(T, two // 2, dtype=gu.dtype)
        self.lib.agentserve_silu_mul(gu.data_ptr(), T, two // 2, out.data_ptr(), torch.get_num_threads())
        return out

    def gelu_tanh_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """gu [T, 2I] (gate then up) -> [T, I] = F.gelu(gate, approximate="tanh") * up,
        rounded as torch rounds it in bfloat16."""
        gu = gu.contiguous()
        T, two = gu.shape
        out = torch.empty(T, two // 2, dtype=gu.dtype)
        self.lib.agentserve_gelu_tanh_mul(gu.data_ptr(), T, two // 2, out.data_ptr(), torch.get_num_threads())
        return out
