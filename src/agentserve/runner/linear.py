"""Linear layers with the weight kept in the layout the CPU kernel reads fastest.

On the CPU in bfloat16, oneDNN can pre-pack a weight into its blocked layout
once at load; the packed matrix-vector product streams the weights about twice
as fast as `F.linear` on the plain [out, in] tensor (measured over a whole
SmolLM2 step's 121 projections, batch 1: 13.7 ms against 23-31 ms), with
bit-identical results. float32 stays on `F.linear`: packing changes its
rounding, and float32 is the path that must match transformers exactly.
Packing is checked on a random input at load and skipped if the build
lacks it or disagrees."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _packing_works() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    if ops is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(64, 32, generator=g).to(torch.bfloat16)
        x = torch.randn(3, 32, generator=g).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.equal(y, F.linear(x, w)))
    except (RuntimeError, AttributeError):
        return False


_PACKING: bool | None = None


def should_pack(dtype: torch.dtype, device: torch.device) -> bool:
    global _PACKING
    if device.type != "cpu" or dtype is not torch.bfloat16:
        return False
    if _PACKING is None:
        _PACKING = _packing_works()
    return _PACKING


class Linear:
    """y = x @ weight.T (+ bias)."""

    __slots__ = ("weight", "bias", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = False) -> None:
        self.bias = bias
        if pack:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
            self.weight = None  # the packed copy replaces it
        else:
            self.packed = None
            self.weight = weight

    @property
    def nbytes(self) -> int:
        t = self.packed if self.packed is not None else self.weight
        n = t.numel() * t.element_size()
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
