"""Linear layers with the weight kept in the layout the CPU kernel reads fastest.

On the CPU in bfloat16, oneDNN can pre-pack a weight into its blocked layout
once at load; the packed matrix-vector product streams the weights about twice
as fast as `F.linear` on the plain [out, in] tensor, with bit-identical
results (docs/kernels.md, 'Packed bf16 projections'). float32 stays on
`F.linear`: packing changes its rounding, and float32 is the path that must
match transformers exactly.
Packing is checked on a random input at load and skipped if the build
lacks it or disagrees.

`Q4Linear` keeps a GGUF Q4_0/Q4_1 weight 4-bit for the few rows of a decode
step. Where the native kernels are built for an AVX512-VNNI CPU it uses
agentserve's own (csrc/gguf_matmul.c): the file's codes and fp16 scales exactly,
the activations quantized per block to two levels of int8 codes, products
summed in integers (see there). Its error against the float32 product is the
output's own bf16 rounding; one level of codes, llama.cpp's scheme for these
files, gave several times that and lost some of SmolLM2's clear greedy choices
(docs/kernels.md has the figures). Without that kernel it uses torch's
CPU int4 kernel (`aten._weight_int4pack_mm_for_cpu`, group size 32 = one ggml
block), which dequantizes w = (q - 8) * scale + zero per group: Q4_1's
w = d*q + m is scale = d, zero = m + 8d and Q4_0's w = d*(q - 8) is scale = d,
zero = 0. With bfloat16 activations that kernel takes its scales and zeros only
in bfloat16, so the fp16 block scales lose 3 bits; each block's zero is then
re-fitted to the block's own codes (least squares given the rounded scale),
which takes back part of that.

Either kernel reads a quarter of the bytes a bf16 weight takes and wins where
reading the weights is the cost, a step of a few rows (decode). Past
`max_rows` rows (prefill, large batches) the layer multiplies with a bf16 copy
of the dequantized weight kept beside the codes (oneDNN-packed: the very
numbers and kernel of the `bf16` weight format). That copy costs memory, 2
bytes a weight on top of the int4 form's 0.625, and no time. Dequantizing per
call instead, to save the memory, would cost a step several times what the
bf16 multiplies themselves take at tens of rows (docs/kernels.md).

`BlockLinear` keeps any kept GGUF type (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K,
Q5_K, Q6_K) as the file's blocks and multiplies on csrc/block_matmul.c (AVX2,
FMA, F16C) for at most `BLOCK_MAX_ROWS` rows, the bf16 copy above; a fused
projection whose parts differ in type is one kernel call per run of one type.
`codes_linear` picks the kernel per projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agentserve.runner import native
from agentserve.runner.quant import BLOCK, Q4Weight, Q8Weight


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

    @property
    def resident_bytes(self) -> int:
        return self.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


# Rows (tokens in the step) up to which Q4Linear uses an int4 kernel; above,
# the bf16 copy. Reading a quarter of the bytes wins while the weights' reads
# are the cost; as rows grow the kernel's integer arithmetic takes over and the
# bf16 GEMM catches up, sooner for torch's kernel than for agentserve's. The
# crossovers on SmolLM2's projections: docs/kernels.md, 'Q4_0 / Q4_1 codes'.
INT4_MAX_ROWS = 8  # torch's int4 kernel
NATIVE_Q4_MAX_ROWS = 12  # agentserve's
# The same for Q8_0 on agentserve's kernel (SmolLM2's tied LM head: about half
# the bytes of its bf16 copy); docs/kernels.md, 'Q8_0 codes'.
NATIVE_Q8_MAX_ROWS = 8


def _int4_ops_present() -> bool:
    aten = torch.ops.aten
    return hasattr(aten, "_weight_int4pack_mm_for_cpu") and hasattr(aten, "_convert_weight_to_int4pack_for_cpu")


_INT4_REASON: str | None | bool = False  # False: not checked yet


def int4_unavailable(device: torch.device) -> str | None:
    """None when kept GGUF codes have a kernel on `device` (agentserve's tiled or
    block kernel, or torch's int4 for Q4_0/Q4_1), else why not (a phrase for a
    log line)."""
    global _INT4_REASON
    if device.type != "cpu":
        return f"the int4 kernels here are CPU ones, the device is {device.type}"
    if native.gguf_kernel() is not None or native.block_kernel() is not None:
        return None
    if _INT4_REASON is False:
        _INT4_REASON = _check_int4()
    return _INT4_REASON  # type: ignore[return-value]


def _torch_int4_works() -> bool:
    global _INT4_REASON
    if _INT4_REASON is False:
        _INT4_REASON = _check_int4()
    return _INT4_REASON is None


def _check_int4() -> str | None:
    if not _int4_ops_present():
        return f"this torch build ({torch.__version__}) lacks aten._weight_int4pack_mm_for_cpu"
    try:
        g = torch.Generator().manual_seed(0)
        n, k = 32, 64
        w = Q4Weight(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                     torch.rand(n, k // BLOCK, generator=g) * 0.1, torch.randn(n, k // BLOCK, generator=g) * 0.1,
                     "Q4_1")
        x = torch.randn(2, k, generator=g).to(torch.bfloat16)
        lin = Q4Linear(w, max_rows=2, pack=False, kernel="torch")
        ref = F.linear(x.float(), w.dequantize())
        err = (lin(x).float() - ref).abs().max().item()
        if not err <= 0.02 * ref.abs().max().item():
            return f"the int4 kernel disagrees with the dequantized weight (max error {err:.3g})"
    except (RuntimeError, AttributeError) as e:
        return f"the int4 kernel failed its check ({str(e).splitlines()[0]})"
    return None


def int4_shape_ok(shape: torch.Size | tuple[int, ...]) -> bool:
    """The kernel packs rows in groups of 16 and columns in whole 32-blocks."""
    return len(shape) == 2 and shape[0] % 16 == 0 and shape[1] % BLOCK == 0


def int4_scales_zeros(w: Q4Weight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The kernel's [in/32, out, 2] (scale, zero) pairs for w = (q - 8)*scale + zero,
    in the activations' dtype: float32 holds d and m + 8d as they are (to float32
    rounding); bfloat16 needs the fit below.

    scale = bf16(d). Rounding d moves every weight of a block by (d - scale)*(q - 8);
    the zero is set to the least-squares best constant for the block's actual codes,
    m + 8d + (d - scale) * mean(q - 8), which cancels the mean of that shift."""
    n, k = w.shape
    if dtype is torch.float32:
        return torch.stack([w.d.float(), (w.m + 8 * w.d).float()], -1).transpose(0, 1).contiguous()
    scale = w.d.to(torch.bfloat16)
    mean = w.codes.view(n, k // BLOCK, BLOCK).sum(-1, dtype=torch.int32).float() / BLOCK - 8
    zero = w.m + 8 * w.d + (w.d - scale.float()) * mean
    return torch.stack([scale, zero.to(torch.bfloat16)], -1).transpose(0, 1).contiguous()


def _native_pack(lib, w: Q4Weight | Q8Weight) -> torch.Tensor:
    """The weight in csrc/gguf_matmul.c's tile layout (the file's fp16 scales as they were)."""
    n, k = w.shape
    codes, d = w.codes.contiguous(), w.d.to(torch.float16).contiguous()
    if isinstance(w, Q8Weight):
        out = torch.empty(n // 16 * (k // BLOCK) * 576, dtype=torch.uint8)
        lib.agentserve_q8_pack(codes.data_ptr(), d.data_ptr(), n, k, out.data_ptr())
        return out
    out = torch.empty(n // 16 * (k // BLOCK) * 320, dtype=torch.uint8)
    m = w.m.to(torch.float16).contiguous()
    lib.agentserve_q4_pack(codes.data_ptr(), d.data_ptr(), m.data_ptr(), n, k, out.data_ptr())
    return out


def _size(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class _CodesLinear:
    """A weight kept as its GGUF codes for steps of at most `max_rows` rows, with
    a copy of the dequantized weight in the compute `dtype` (bf16 oneDNN-packed
    when `pack`) above."""

    __slots__ = ("lib", "packed", "q8", "bias", "bias32", "dense", "max_rows", "shape")

    def __init__(self, weight: Q4Weight | Q8Weight, bias: torch.Tensor | None, max_rows: int, pack: bool | None,
                 dense: Linear | None, lib, dtype: torch.dtype = torch.bfloat16) -> None:
        if not int4_shape_ok(weight.shape):
            raise ValueError(f"{weight.qtype} weights need rows in multiples of 16 and whole blocks, "
                             f"got {tuple(weight.shape)}")
        self.shape = tuple(weight.shape)
        self.lib = lib
        self.q8 = isinstance(weight, Q8Weight)
        self.packed = _native_pack(lib, weight) if lib is not None else None
        self.bias = bias
        self.bias32 = None if bias is None or lib is None else bias.float().contiguous()
        self.max_rows = max_rows
        # oneDNN packing where this CPU has it (not every x86 CPU does), bf16 only
        pack = should_pack(dtype, torch.device("cpu")) if pack is None else pack and dtype is torch.bfloat16
        # `dense` lets a tied LM head share the embedding's copy
        self.dense = dense or Linear(weight.dequantize().to(dtype), bias, pack)

    @property
    def kernel(self) -> str:
        return "agentserve" if self.lib is not None else "torch"

    @property
    def nbytes(self) -> int:
        """Bytes a decode step reads: the codes, the block scales (and minimums), the bias."""
        return _size(self.packed) + _size(self.bias)

    @property
    def resident_bytes(self) -> int:
        """Memory held: the codes and the bf16 copy."""
        return self.nbytes + self.dense.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            return self.dense(x)
        return self._codes(x.contiguous())

    def _codes(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"{'Q8_0' if self.q8 else 'int4'} projections take bfloat16 or float32 activations, "
                            f"got {x.dtype}")
        rows = x.shape[0]
        n, k = self.shape
        y = torch.empty(rows, n, dtype=x.dtype)
        if rows == 0:
            return y
        rc = self.lib.agentserve_gguf_matmul(int(self.q8), int(x.dtype is torch.bfloat16), x.data_ptr(), rows, k,
                                             self.packed.data_ptr(), n,
                                             None if self.bias32 is None else self.bias32.data_ptr(),
                                             y.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"native GGUF kernel failed with code {rc} (x {tuple(x.shape)}, weight {self.shape})")
        return y


class Q4Linear(_CodesLinear):
    """y = x @ W.T (+ bias) for a GGUF Q4_0/Q4_1 weight: an int4 kernel (agentserve's
    where built, else torch's) for at most `max_rows` rows of x (bf16), the bf16
    copy above."""

    __slots__ = ("int4", "scales_zeros")

    def __init__(self, weight: Q4Weight, bias: torch.Tensor | None = None, max_rows: int | None = None,
                 pack: bool | None = None, dense: Linear | None = None, kernel: str = "auto",
                 dtype: torch.dtype = torch.bfloat16) -> None:
        if kernel not in ("auto", "torch"):
            raise ValueError(f"kernel {kernel!r} is not one of auto, torch")
        lib = native.gguf_kernel() if kernel == "auto" else None
        if max_rows is None:
            max_rows = NATIVE_Q4_MAX_ROWS if lib is not None else INT4_MAX_ROWS
        super().__init__(weight, bias, max_rows, pack, dense, lib, dtype)
        self.int4 = self.scales_zeros = None
        if lib is None:
            self.int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32), 1)
            self.scales_zeros = int4_scales_zeros(weight, dtype)

    @property
    def nbytes(self) -> int:
        return super().nbytes + _size(self.int4) + _size(self.scales_zeros)

    def _codes(self, x: torch.Tensor) -> torch.Tensor:
        if self.lib is not None:
            return super()._codes(x)
        if x.dtype is not self.scales_zeros.dtype:
            raise TypeError(f"this int4 projection was built for {self.scales_zeros.dtype} activations, "
                            f"got {x.dtype}")
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.int4, BLOCK, self.scales_zeros)
        return y if self.bias is None else y.add_(self.bias)


class Q8Linear(_CodesLinear):
    """y = x @ W.T (+ bias) for a GGUF Q8_0 weight on agentserve's kernel (there is
    no torch one: without it the weight is dequantized instead, see `q8_available`)
    for at most `max_rows` rows, the bf16 copy above."""

    __slots__ = ()

    def __init__(self, weight: Q8Weight, bias: torch.Tensor | None = None, max_rows: int = NATIVE_Q8_MAX_ROWS,
                 pack: bool | None = None, dense: Linear | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
        lib = native.gguf_kernel()
        if lib is None:
            raise RuntimeError(f"no Q8_0 kernel: {native.gguf_unavailable_reason()}")
        super().__init__(weight, bias, max_rows, pack, dense, lib, dtype)


def q8_available(device: torch.device) -> bool:
    return device.type == "cpu" and native.gguf_kernel() is not None
