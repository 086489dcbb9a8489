"""GGUF's 4-bit weights (Q4_0, Q4_1) and 8-bit ones (Q8_0) kept as their codes
between the loader and the model, so `linear.Q4Linear` / `linear.Q8Linear` can
compute with them without a dequantized copy of the file in between; the
K-quants (Q4_K, Q5_K, Q6_K) and the 5-bit Q5_0/Q5_1 kept as the file's own
blocks (`BlockWeight`), for `gguf_linear.BlockLinear`.

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


def _half_bytes(t: torch.Tensor) -> torch.Tensor:
    """float32 values that came from fp16 -> their 2 fp16 bytes, [..., 2] uint8."""
    return t.to(torch.float16).contiguous().view(torch.uint8).view(*t.shape, 2)


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

    def to_blocks(self) -> torch.Tensor:
        """The file's Q4_0/Q4_1 blocks again, uint8 [out, in/32 * 18 or 20]
        (one type only, not a concatenation of both)."""
        if self.qtype not in Q4_TYPES:
            raise ValueError(f"a {self.qtype} weight has no single GGUF block layout")
        n, k = self.codes.shape
        q = self.codes.view(n, k // BLOCK, BLOCK)
        fields = [_half_bytes(self.d)]
        if self.qtype == "Q4_1":
            fields.append(_half_bytes(self.m))
        fields.append(q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4))
        return torch.cat(fields, -1).reshape(n, -1)

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

    def to_blocks(self) -> torch.Tensor:
        """The file's Q8_0 blocks again, uint8 [out, in/32 * 34]."""
        n, k = self.codes.shape
        q = self.codes.view(n, k // BLOCK, BLOCK).view(torch.uint8)
        return torch.cat([_half_bytes(self.d), q], -1).reshape(n, -1)

    @staticmethod
    def cat(parts: list["Q8Weight"]) -> "Q8Weight":
        return Q8Weight(torch.cat([p.codes for p in parts]), torch.cat([p.d for p in parts]))

    @property
    def nbytes(self) -> int:
        n, k = self.codes.shape
        return n * (k // BLOCK) * Q8_TYPES["Q8_0"]


# GGUF type name -> (weights per block, bytes per block) of the types kept as
# the file's blocks. ggml's layouts (little-endian; fp16 = IEEE half):
#   Q5_0 (32): d fp16, qh 4 bytes (bit j = 5th bit of weight j), qs 16 bytes
#              (low nibbles weights 0..15, high 16..31); w = d*(q - 16)
#   Q5_1 (32): d, m fp16, qh, qs as Q5_0; w = d*q + m
#   Q4_K (256): d, dmin fp16, 12 bytes of 6-bit scales sc[8] and mins mn[8]
#              (`_k_scales`), qs 128 bytes: bytes 32i..32i+31 hold sub-blocks
#              2i (low nibbles) and 2i+1 (high); w = d*sc*q - dmin*mn per
#              sub-block of 32
#   Q5_K (256): d, dmin, the 12 scale bytes, qh 32 bytes (bit j of byte l: the
#              5th bit of weight l of sub-block j), qs as Q4_K
#   Q6_K (256): ql 128 bytes, qh 64, sc 16 int8 (one per 16 weights), d fp16;
#              per half h of 128: ql[64h+l] low nibble -> weight l, of
#              ql[64h+32+l] -> 32+l, their high nibbles -> 64+l, 96+l; qh[32h+l]
#              bits 0-1, 2-3, 4-5, 6-7 the top 2 bits of those four; w = d*sc*(q - 32)
BLOCK_TYPES = {"Q5_0": (32, 22), "Q5_1": (32, 24), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


@dataclass
class BlockWeight:
    """A weight kept as the GGUF's blocks: `blocks` uint8 [out, in/block * bytes
    per block], row r holding the blocks of output row r, as the file has them.
    Row operations (permutation, concatenation) move whole rows of bytes."""
    blocks: torch.Tensor
    qtype: str
    cols: int

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_TYPES:
            raise ValueError(f"{self.qtype} is not a block type ({', '.join(BLOCK_TYPES)})")
        size, nbytes = BLOCK_TYPES[self.qtype]
        if self.cols % size or self.blocks.dim() != 2 or self.blocks.shape[1] != self.cols // size * nbytes:
            raise ValueError(f"{self.qtype} blocks {tuple(self.blocks.shape)} do not hold rows of {self.cols} weights")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.blocks.shape[0], self.cols))

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "BlockWeight":
        return BlockWeight(fn(self.blocks), self.qtype, self.cols)

    @staticmethod
    def cat(parts: list["BlockWeight"]) -> "BlockWeight":
        """Rows of `parts` (all of one type and width) one after the other."""
        if len({(p.qtype, p.cols) for p in parts}) != 1:
            raise ValueError(f"cannot join {', '.join(f'{p.qtype} {tuple(p.shape)}' for p in parts)} into one weight")
        return BlockWeight(torch.cat([p.blocks for p in parts]), parts[0].qtype, parts[0].cols)

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], equal to gguf's dequantization bit for bit: the same
        float32 operations in the same order (the products of fp16 scales and
        small codes are exact; what rounds, the subtraction of the minimum and
        Q6_K's (d*sc)*q, rounds as there)."""
        n, k = self.shape
        size, nbytes = BLOCK_TYPES[self.qtype]
        b = self.blocks.numpy().reshape(-1, nbytes)
        w = _DEQUANTIZE[self.qtype](b)
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(n, k))


def _half(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of each block, as float32 [blocks, 1]."""
    return b[:, at:at + 2].copy().view(np.float16).astype(np.float32)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: the 32 bits of qh [blocks, 4] as 0/16 per weight [blocks, 32]."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")
    return bits * np.uint8(16)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> weights 0..15 (low nibbles), 16..31 (high)."""
    return np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1)


def _q5_0(b: np.ndarray) -> np.ndarray:
    q = (_nibbles32(b[:, 6:22]) | _fifth_bits(b[:, 2:6])).astype(np.float32) - np.float32(16)
    return _half(b, 0) * q


def _q5_1(b: np.ndarray) -> np.ndarray:
    q = (_nibbles32(b[:, 8:24]) | _fifth_bits(b[:, 4:8])).astype(np.float32)
    return _half(b, 0) * q + _half(b, 2)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes [blocks, 12] -> 6-bit scales and mins [blocks, 8]:
    sub-blocks 0..3 take the low 6 bits of bytes 0..3 (scales) and 4..7 (mins);
    4..7 take a nibble of bytes 8..11 (low: scale, high: min) below the top 2
    bits of bytes 0..3 (scale) and 4..7 (min)."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, mn


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 8 sub-blocks of 32 [blocks, 8, 32]: 2i the low nibbles of
    bytes 32i.., 2i+1 their high nibbles."""
    q = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([q & np.uint8(15), q >> np.uint8(4)], axis=2).reshape(-1, 8, 32)


def _q4_k_like(b: np.ndarray, q: np.ndarray) -> np.ndarray:
    sc, mn = _k_scales(b[:, 4:16])
    d = (_half(b, 0) * sc.astype(np.float32))[..., None]
    dm = (_half(b, 2) * mn.astype(np.float32))[..., None]
    return (d * q.astype(np.float32) - dm).reshape(-1, 256)


def _q4_k(b: np.ndarray) -> np.ndarray:
    return _q4_k_like(b, _k_nibbles(b[:, 16:144]))


def _q5_k(b: np.ndarray) -> np.ndarray:
    qh = b[:, 16:48][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]  # [blocks, 8, 32]
    return _q4_k_like(b, _k_nibbles(b[:, 48:176]) | ((qh & np.uint8(1)) << np.uint8(4)))


def _q6_k(b: np.ndarray) -> np.ndarray:
    ql = b[:, 0:128].reshape(-1, 2, 1, 64)
    low = np.concatenate([ql & np.uint8(15), ql >> np.uint8(4)], axis=2).reshape(-1, 2, 4, 32)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    q = (low | ((qh & np.uint8(3)) << np.uint8(4))).astype(np.float32) - np.float32(32)
    d = _half(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)  # [blocks, 16]
    return (d[..., None] * q.reshape(-1, 16, 16)).reshape(-1, 256)


_DEQUANTIZE = {"Q5_0": _q5_0, "Q5_1": _q5_1, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}

QuantWeight = Q4Weight | Q8Weight | BlockWeight
# the GGUF types `from_blocks` keeps as codes or blocks
KEPT_TYPES = {**Q4_TYPES, **Q8_TYPES, **{t: nbytes for t, (_, nbytes) in BLOCK_TYPES.items()}}


def is_quantized(t: object) -> bool:
    return isinstance(t, (Q4Weight, Q8Weight, BlockWeight))


def from_blocks(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> QuantWeight:
    """The raw bytes of a GGUF tensor of a KEPT_TYPES type ([rows, blocks * block bytes]
    uint8, as gguf's ReaderTensor.data gives them) as a Q4Weight, Q8Weight or
    BlockWeight of `shape` [out, in]."""
    n, k = shape
    if qtype in BLOCK_TYPES:
        size, nbytes = BLOCK_TYPES[qtype]
        if k % size:
            raise ValueError(f"{qtype} tensor of shape {shape}: rows are not whole blocks of {size}")
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(n, k // size * nbytes)
        return BlockWeight(torch.from_numpy(raw.copy()), qtype, k)
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
