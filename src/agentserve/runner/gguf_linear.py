"""A projection on a GGUF file's quantized blocks, and the choice of kernel
for a projection's codes.

`BlockLinear` multiplies on the file's blocks as stored (csrc/block_matmul.c:
any kept GGUF type, a fused projection of mixed types as one call per run of
one type) for decode-sized steps, with a bf16 copy above. `codes_linear`
picks, for the parts of one projection, the tiled AVX512-VNNI kernel, torch's
int4 kernel or the block kernel (linear.py holds the first two), or None where
no kernel takes them (the caller dequantizes, with one log line a reason)."""

from __future__ import annotations

import logging

import torch

from agentserve.runner import native
from agentserve.runner.linear import (Linear, Q4Linear, Q8Linear, _size, _torch_int4_works, int4_shape_ok,
                                     should_pack)
from agentserve.runner.quant import BlockWeight, Q4Weight, Q8Weight

log = logging.getLogger("agentserve.runner")

# csrc/block_matmul.c's type numbers
BLOCK_KERNEL_TYPES = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q5_0": 3, "Q5_1": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7}
# Rows up to which BlockLinear multiplies on the file's blocks; above, the bf16
# copy. Where bf16 is emulated (no AVX512-BF16 or AMX, so the copy is unpacked
# F.linear) the kernel wins at every decode size; past 16 rows a step is a
# prefill chunk, where the bf16 copy's oneDNN path and chunking matter more, so
# 16 there. Where the CPU has native bf16 the packed copy is several times
# faster and this kernel was not timed against it: 8, the crossover of the
# AVX512-VNNI Q8_0 kernel against packed bf16. Timings and the command that
# reproduces them: docs/kernels.md, 'The block kernel'.
BLOCK_MAX_ROWS = 8 if native.cpu_has_native_bf16() else 16
# Rows up to which the block kernel takes the activations as int8 codes
# (agentserve_block_matmul8: one scale per 4 values, error up to max|x| / 254 of
# its 4; vpmaddubsw, twice the products per instruction) instead of int16 codes
# (error far below the bf16 weight copy's), for the types in ACT8_TYPES.
# int8 codes in the Q4_0/Q4_1/Q5_0/Q5_1 projections are faster and kept greedy
# agreement on the Gemma 3 270M Q4_K_M file; in the K-quants (little faster) and
# Q8_0 (no faster) they cost greedy choices for little or no time, and one scale
# per 32 (llama.cpp's q8_0) cost more choices. Steps past 8 rows (prompt chunks,
# which write the KV every later token reads) keep the finer codes, which cost
# little there. Timings and agreement counts: docs/kernels.md, 'int8 activation
# codes'.
ACT8_MAX_ROWS = 8
# The types whose decode rows take the int8 codes (above)
ACT8_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1"})


def block_available(device: torch.device) -> bool:
    return device.type == "cpu" and native.block_kernel() is not None


def _blocks_of(w) -> tuple[str, torch.Tensor]:
    """(GGUF type, the file's blocks [out, row bytes]) of a kept weight."""
    if isinstance(w, BlockWeight):
        return w.qtype, w.blocks
    return w.qtype, w.to_blocks()


class BlockLinear:
    """y = x @ W.T (+ bias) for a weight given as GGUF parts (the q, k, v or
    gate, up of a fused projection, or one), each kept as the file's blocks:
    csrc/block_matmul.c for at most `max_rows` rows of x, one call per run of
    parts of one type writing its columns of y in place (a fused projection
    may mix types: Gemma 3's Q4_K_M has q, k in Q5_0 and v in Q8_0); a copy
    of the dequantized weight in the compute `dtype` (bf16 oneDNN-packed when
    `pack`) above."""

    __slots__ = ("lib", "groups", "bias", "bias32", "dense", "max_rows", "act8_rows", "act8_codes", "shape")

    def __init__(self, parts: list, bias: torch.Tensor | None = None, max_rows: int = BLOCK_MAX_ROWS,
                 pack: bool | None = None, dense: Linear | None = None,
                 dtype: torch.dtype = torch.bfloat16, act8_rows: int = ACT8_MAX_ROWS,
                 act8_types: frozenset[str] = ACT8_TYPES) -> None:
        lib = native.block_kernel()
        if lib is None:
            raise RuntimeError(f"no GGUF block kernel: {native.block_unavailable_reason()}")
        if not parts or len({p.shape[1] for p in parts}) != 1:
            raise ValueError(f"parts of one projection must share their width, got "
                             f"{[tuple(p.shape) for p in parts]}")
        self.lib = lib
        self.groups: list[tuple[int, int, int, torch.Tensor]] = []  # (kernel type, first column, n, blocks)
        col = 0
        for part in parts:
            qtype, blocks = _blocks_of(part)
            if qtype not in BLOCK_KERNEL_TYPES:
                raise ValueError(f"{qtype} has no block kernel (it takes {', '.join(BLOCK_KERNEL_TYPES)})")
            code = BLOCK_KERNEL_TYPES[qtype]
            if self.groups and self.groups[-1][0] == code:  # one call for a run of one type
                c, first, n, prev = self.groups.pop()
                self.groups.append((c, first, n + blocks.shape[0], torch.cat([prev, blocks])))
            else:
                self.groups.append((code, col, blocks.shape[0], blocks.contiguous()))
            col += blocks.shape[0]
        self.shape = (col, int(parts[0].shape[1]))
        self.bias = bias
        self.bias32 = None if bias is None else bias.float().contiguous()
        self.max_rows = max_rows
        self.act8_rows = act8_rows
        self.act8_codes = frozenset(BLOCK_KERNEL_TYPES[t] for t in act8_types if t in BLOCK_KERNEL_TYPES)
        if dense is None:
            pack = should_pack(dtype, torch.device("cpu")) if pack is None else pack and dtype is torch.bfloat16
            weight = torch.cat([p.dequantize().to(dtype) for p in parts])
            dense = Linear(weight, bias, pack)
        self.dense = dense

    @property
    def kernel(self) -> str:
        return "agentserve-block"

    @property
    def qtypes(self) -> list[str]:
        names = {v: k for k, v in BLOCK_KERNEL_TYPES.items()}
        return [names[g[0]] for g in self.groups]

    @property
    def nbytes(self) -> int:
        """Bytes a decode step reads: the file's blocks and the bias."""
        return sum(g[3].numel() for g in self.groups) + _size(self.bias)

    @property
    def resident_bytes(self) -> int:
        return self.nbytes + self.dense.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            return self.dense(x)
        return self.blocks(x.contiguous())

    def blocks(self, x: torch.Tensor) -> torch.Tensor:
        """The product on the blocks, whatever the row count."""
        if x.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"GGUF block projections take bfloat16 or float32 activations, got {x.dtype}")
        rows = x.shape[0]
        n, k = self.shape
        if x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"x {tuple(x.shape)} does not match weight {self.shape}")
        y = torch.empty(rows, n, dtype=x.dtype)
        if rows == 0:
            return y
        bf16, threads, size = int(x.dtype is torch.bfloat16), torch.get_num_threads(), y.element_size()
        int8 = rows <= self.act8_rows
        for code, col, cols, blocks in self.groups:
            bias = None if self.bias32 is None else self.bias32.data_ptr() + 4 * col
            matmul = self.lib.agentserve_block_matmul8 if int8 and code in self.act8_codes else \
                self.lib.agentserve_block_matmul
            rc = matmul(code, bf16, x.data_ptr(), rows, k, blocks.data_ptr(), cols, bias, y.data_ptr() + size * col,
                        n, threads)
            if rc != 0:
                raise RuntimeError(f"GGUF block kernel failed with code {rc} (x {tuple(x.shape)}, "
                                   f"weight {self.shape})")
        return y


_LOGGED: set[str] = set()


def _dequantized_because(why: str) -> None:
    """One log line per reason, not one per projection."""
    if why not in _LOGGED:
        _LOGGED.add(why)
        log.warning("weights native: %s; those projections use dequantized weights", why)


def codes_linear(parts: list, bias: torch.Tensor | None, pack: bool, dense: Linear | None,
                 device: torch.device, dtype: torch.dtype = torch.bfloat16
                 ) -> "Q4Linear | Q8Linear | BlockLinear | None":
    """The projection over the row-concatenation of `parts` on a kernel for their
    GGUF codes, or None where no kernel takes them (the caller dequantizes):
    Q4_0/Q4_1 on the tiled AVX512-VNNI kernel where built, else the block
    kernel on AVX2, else torch's int4; Q8_0 on the tiled kernel, else the block
    kernel; the K-quants and Q5_0/Q5_1 on the block kernel; a fused projection
    of mixed types on the block kernel. `dtype` is the compute dtype (bfloat16
    or float32): the activations the kernel takes and the dense copy's."""
    if device.type != "cpu":
        _dequantized_because(f"the GGUF kernels are CPU ones, the device is {device.type}")
        return None
    tiled = native.gguf_kernel() is not None
    for kind, layer in ((Q4Weight, Q4Linear), (Q8Weight, Q8Linear)):
        if not all(isinstance(r, kind) for r in parts):
            continue
        q = parts[0] if len(parts) == 1 else kind.cat(parts)  # type: ignore[attr-defined]
        if tiled and int4_shape_ok(q.shape):
            return layer(q, bias, pack=pack, dense=dense, dtype=dtype)
        # torch's int4 kernel where it takes the shape: as fast as the block kernel at 1-4 rows
        # (docs/kernels.md, 'The block kernel'), and what the model counts as int4 projections
        if kind is Q4Weight and int4_shape_ok(q.shape) and _torch_int4_works():
            return layer(q, bias, pack=pack, dense=dense, dtype=dtype)
    if not all(isinstance(r, (Q4Weight, Q8Weight, BlockWeight)) for r in parts):
        return None  # a dense part: the projection is dense
    if not block_available(device):
        types = sorted({_blocks_of(p)[0] if isinstance(p, BlockWeight) else p.qtype for p in parts})
        _dequantized_because(f"no kernel for {', '.join(types)} here ({native.block_unavailable_reason()})")
        return None
    return BlockLinear(parts, bias, pack=pack, dense=dense, dtype=dtype)
