"""GGUF's 4-bit weights (Q4_0, Q4_1) and 8-bit ones (Q8_0) kept as their codes
between the loader and the model, so `linear.Q4Linear` / `linear.Q8Linear` can
compute with them without a dequantized copy of the file in between.

A ggml Q4 block covers 32 consecutive weights of a row: an fp16 scale `d`
(Q4_1 also an fp16 minimum `m`) and 16 bytes of nibbles, the low nibbles holding
elements 0..15 and the high nibbles 16..31. Q4_1 means w = d*q + m; Q4_0 means
w = d*(q - 8), which is Q4_1 with m = -8d, so both are held the same way:
`Q4Weight` = codes q in 0..15 [out, in] and d, m per block [out, in/32], all of
them row-indexed, so a row permutation or a row concatenation (llama.cpp's q/k
permutation, the fused q/k/v and gate/up projections) applies to each part
alike. `dequantize()` reproduces `gguf.quants.dequantize` bit for bit (d*q is
exact in float32, so is -8d; the one rounding is the add, as in gguf)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32
# GGUF type name -> bytes per 32-weight block
Q4_TYPES = {"Q4_0": 18, "Q4_1": 20}
Q8_TYPES = {"Q8_0": 34}


@dataclass
class Q4Weight:
    codes: torch.Tensor  # uint8 [out, in], values 0..15
    d: torch.Tensor      # float32 [out, in/32], the fp16 block scales
    m: torch.Tensor      # float32 [out, in/32], the block minimums (Q4_0: -8d)
    qtype: str           # "Q4_0", "Q4_1", or both joined by "+" after a concatenation

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], w = d*q + m, equal to gguf's dequantization."""
        n, k = self.codes.shape
        q = self.codes.view(n, k // BLOCK, BLOCK).float()
        return (self.d.unsqueeze(-1) * q + self.m.unsqueeze(-1)).view(n, k)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Q4Weight":
        """The same row operation (e.g. `unpermute_qk`) on codes, scales and minimums."""
        return Q4Weight(fn(self.codes), fn(self.d), fn(self.m), self.qtype)

    @staticmethod
    def cat(parts: list["Q4Weight"]) -> "Q4Weight":
        """Rows of `parts` one after the other, like torch.cat of the weights."""
        qtypes = sorted({t for p in parts for t in p.qtype.split("+")})
        return Q4Weight(torch.cat([p.codes for p in parts]), torch.cat([p.d for p in parts]),
                        torch.cat([p.m for p in parts]), "+".join(qtypes))

    @property
    def nbytes(self) -> int:
        """What the file stored (4 bits a weight and the per-block fp16 numbers)."""
        n, k = self.codes.shape
        per_block = 20 if "Q4_1" in self.qtype else 18
        return n * (k // BLOCK) * per_block


@dataclass
class Q8Weight:
    """A Q8_0 weight: w = d*q per block of 32, q int8."""
    codes: torch.Tensor  # int8 [out, in]
    d: torch.Tensor      # float32 [out, in/32], the fp16 block scales
    qtype: str = "Q8_0"

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], w = d*q, equal to gguf's dequantization (one exact product)."""
        n, k = self.codes.shape
        return (self.d.unsqueeze(-1) * self.codes.view(n, k // BLOCK, BLOCK).float()).view(n, k)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Q8Weight":
        return Q8Weight(fn(self.codes), fn(self.d), self.qtype)

    @staticmethod
    def cat(parts: list["Q8Weight"]) -> "Q8Weight":
        return Q8Weight(torch.cat([p.codes for p in parts]), torch.cat([p.d for p in parts]))

    @property
    def nbytes(self) -> int:
        n, k = self.codes.shape
        return n * (k // BLOCK) * Q8_TYPES["Q8_0"]


QuantWeight = Q4Weight | Q8Weight
# the GGUF types `from_blocks` keeps as codes
KEPT_TYPES = {**Q4_TYPES, **Q8_TYPES}


def is_quantized(t: object) -> bool:
    return isinstance(t, (Q4Weight, Q8Weight))


def from_blocks(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> QuantWeight:
    """The raw bytes of a GGUF Q4_0/Q4_1/Q8_0 tensor ([rows, blocks * block bytes] uint8,
    as gguf's ReaderTensor.data gives them) as a Q4Weight or Q8Weight of `shape` [out, in]."""
    n, k = shape
    if k % BLOCK:
        raise ValueError(f"{qtype} tensor of shape {shape}: rows are not whole blocks of {BLOCK}")
    size = {**Q4_TYPES, **Q8_TYPES}[qtype]
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(n, k // BLOCK, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype in Q8_TYPES:
        codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k)
        return Q8Weight(torch.from_numpy(codes.copy()), torch.from_numpy(d))
    if qtype == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        m = d * np.float32(-8)
    nibbles = blocks[..., size - BLOCK // 2:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(n, k)
    return Q4Weight(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m), qtype)
