"""The small per-layer operations of a decode step on the CPU, one native call
each (csrc/layer_ops.c): residual add + RMSNorm (with Gemma's norm on the
sublayer output folded in), q/k norm + rotary embedding + KV write,
SiLU-and-multiply, tanh-GELU-and-multiply (Gemma's GeGLU). In bfloat16 they
round as torch does; in float32 (taken only with GGUF-kept weights, whose
kernels quantize their activations anyway, so the dense float32 path stays on
torch's kernels, exact against transformers) they compute torch's float32
expressions with the sums in another order. `LayerOps.create` returns None
where they do not apply (a GPU, no native library); the model then uses torch."""

from __future__ import annotations

import ctypes

import torch

from agentserve.runner import native


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class LayerOps:
    __slots__ = ("lib", "f32")

    def __init__(self, lib: ctypes.CDLL, f32: bool = False) -> None:
        self.lib = lib
        self.f32 = f32

    @staticmethod
    def create(dtype: torch.dtype, device: torch.device, quantized: bool = False) -> "LayerOps | None":
        if device.type != "cpu" or not (dtype is torch.bfloat16 or (dtype is torch.float32 and quantized)):
            return None
        lib = native.layer_ops()
        return None if lib is None else LayerOps(lib, dtype is torch.float32)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out: torch.Tensor, delta_weight: torch.Tensor | None = None) -> torch.Tensor:
        """h += delta (in place, when given; RMSNorm(delta) * delta_weight where
        that is given); returns out = RMSNorm(h) * weight."""
        T, dim = h.shape
        fn = self.lib.agentserve_add_rms_norm_f32 if self.f32 else self.lib.agentserve_add_rms_norm
        fn(h.data_ptr(), None if delta is None else delta.contiguous().data_ptr(), _ptr(delta_weight),
           weight.data_ptr(), out.data_ptr(), T, dim, eps, torch.get_num_threads())
        return out

    def rope_kv(self, qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor,
                sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slots: torch.Tensor, qk_norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
        """Norms q and k per head (with `qk_norm` [heads + kv_heads, head_dim]),
        rotates them; k and v go into the cache at `slots`; returns q [T, heads,
        head_dim] in the cache's dtype (what the attention kernel reads)."""
        qkv = qkv.contiguous()
        T = qkv.shape[0]
        q = torch.empty(T, heads, head_dim, dtype=k_cache.dtype)
        kvh, nb, bs, _ = k_cache.shape
        args = (qkv.data_ptr(), T, heads, kv_heads, head_dim, _ptr(qk_norm), eps, cos.data_ptr(), sin.data_ptr(),
                positions.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr())
        rest = (nb * bs, slots.data_ptr(), q.data_ptr(), torch.get_num_threads())
        if self.f32:
            if k_cache.dtype not in (torch.bfloat16, torch.float32):
                raise ValueError(f"a float32 step writes a bfloat16 or float32 cache, not {k_cache.dtype}")
            self.lib.agentserve_rope_kv_f32(*args, int(k_cache.dtype is torch.bfloat16), *rest)
        else:
            self.lib.agentserve_rope_kv(*args, *rest)
        return q

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        if self.f32:  # no float32 form in csrc: torch's two kernels
            g, u = gu.chunk(2, dim=-1)
            return torch.nn.functional.silu(g) * u
        gu = gu.contiguous()
        T, two = gu.shape
        out = torch.empty(T, two // 2, dtype=gu.dtype)
        self.lib.agentserve_silu_mul(gu.data_ptr(), T, two // 2, out.data_ptr(), torch.get_num_threads())
        return out

    def gelu_tanh_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """gu [T, 2I] (gate then up) -> [T, I] = F.gelu(gate, approximate="tanh") * up
        (in bfloat16 rounded as torch rounds it)."""
        gu = gu.contiguous()
        T, two = gu.shape
        out = torch.empty(T, two // 2, dtype=gu.dtype)
        fn = self.lib.agentserve_gelu_tanh_mul_f32 if self.f32 else self.lib.agentserve_gelu_tanh_mul
        fn(gu.data_ptr(), T, two // 2, out.data_ptr(), torch.get_num_threads())
        return out
