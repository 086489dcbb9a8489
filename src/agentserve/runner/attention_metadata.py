"""A step's attention layout, built once and shared by every layer: the cache
slot of each new token's K/V, and either the native kernel's segments (a decode
row or prefill chunk each, with its block table) or the torch path's gathered
decode batch and prefill spans with their masks; laid out again per sliding
window on first use (`AttentionMetadata.for_window`). runner/attention.py
computes attention on it."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field, replace

import torch

from agentserve.runner import native, triton_ops

# A float32 prefill chunk of at least this many rows attends with torch's flash
# kernel (matrix multiplies pay off): its own K/V causally, plus, after a
# prefix, the prefix's blocks gathered once and unmasked, the two merged by
# log-sum-exp. Shorter chunks and decode rows go through the native kernel,
# whose float32 path loses to flash's matrix multiplies on long chunks.
GEMM_CHUNK_ROWS = 64
# bfloat16 chunks of any length go through the native kernel when it was built
# with its big-tile path (AVX512-BF16, `native.big_tiles()`): it beats flash at
# every chunk length and prefix timed. Without that path (or False here), bfloat16
# follows GEMM_CHUNK_ROWS like float32. Per-layer timings of both constants:
# docs/kernels.md, 'Native attention for prefill chunks'.
BF16_CHUNKS_NATIVE = True

@dataclass
class PrefillSpan:
    row_start: int  # first row of this chunk in the flattened batch
    num_rows: int
    start: int  # position of the chunk's first token
    blocks: torch.Tensor | None  # block table covering [kv_start, start + num_rows); None when start == 0
    mask: torch.Tensor | None  # [num_rows, start + num_rows - kv_start] bool, True = may attend
    kv_start: int = 0  # position of the first key in `blocks` (> 0 only under a sliding window)


@dataclass
class DecodeBatch:
    num_rows: int
    blocks: torch.Tensor  # [rows * max_blocks] block ids, each row padded with block 0
    max_blocks: int
    mask: torch.Tensor | None  # [rows, 1, 1, max_blocks * block_size] bool, True = may attend


@dataclass
class GpuDecode:
    """The decode rows for the Triton kernel (runner/triton_ops.py), on the
    device: each row's block table and context length (the new token included;
    0 for a padding row of a captured graph), read in place by the kernel."""
    num_rows: int
    tables: torch.Tensor  # int32 [rows, blocks of the longest row], padded with block 0
    lens: torch.Tensor  # int32 [rows]


@dataclass
class NativeSegments:
    """The rows the native kernel computes: one segment per decode row or
    prefill chunk (int32 arrays the kernel reads in place)."""
    count: int
    row_start: torch.Tensor
    num_rows: torch.Tensor
    start: torch.Tensor
    table_offset: torch.Tensor  # where each segment's block table starts in `tables`
    tables: torch.Tensor
    args: tuple = ()  # the kernel's arguments for these arrays, converted once per step

    def __post_init__(self) -> None:
        p = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
        self.args = (ctypes.c_int(self.count), p(self.row_start), p(self.num_rows), p(self.start),
                     p(self.table_offset), p(self.tables))


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V goes to
    decode: DecodeBatch | None = None  # torch path only
    prefills: list[PrefillSpan] = field(default_factory=list)  # torch path: all chunks; native: SDPA ones
    native: NativeSegments | None = None  # rows for the native kernel (None: none this step)
    gpu: GpuDecode | None = None  # decode rows on CUDA's Triton kernel (the prefills stay on the torch path)
    kernel: bool = False  # built for the native path
    window: int | None = None  # the sliding window this layout serves (None: full causal)
    max_context: int = 0  # the longest context of any row: a window at least this long changes nothing
    source: tuple = ()  # build_metadata's inputs, to lay the step out for a window
    by_window: dict = field(default_factory=dict)  # the layouts for_window built, by window
    groups: list = field(default_factory=list)  # hybrid cache: the step laid out per layer group ([0] is self)

    def for_window(self, window: int | None) -> "AttentionMetadata":
        """This step laid out for attention with a sliding window (None: self).
        Built on first use and kept, so every layer with that window shares it.
        It never has prefill spans this one lacks: a step that attends without
        the step's own k and v (no spans) can do so under any window."""
        if window is None:
            return self
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"a sliding window is a positive number of positions, not {window!r}")
        if self.window is not None:  # a layout for_window made
            if window != self.window:
                raise ValueError(f"metadata laid out for window {self.window} asked for window {window}")
            return self
        if window >= self.max_context:
            return self
        laid = self.by_window.get(window)
        if laid is None:
            if (self.kernel and all(sp.start + sp.num_rows <= window for sp in self.prefills)) or \
                    (self.gpu is not None and not self.prefills):
                # the kernel's segments (or the GPU's tables) serve any window as they are: only the
                # kernel's argument differs
                laid = replace(self, window=window, by_window={})
            else:
                laid = _layout(self.slot_mapping, *self.source, kernel=self.kernel, window=window)
            self.by_window[window] = laid
        return laid


def use_native(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether attention on this device and dtype runs on the native kernel."""
    return torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16) \
        and native.paged_attention_kernel() is not None


def use_triton(device: torch.device | str) -> bool:
    """Whether decode rows on this device attend on the Triton kernel."""
    device = torch.device(device)
    return device.type == "cuda" and triton_ops.unavailable(device) is None


def build_metadata(decode_tables: list[list[int]], decode_lens: list[int],
                   prefills: list[tuple[list[int], int, int]], block_size: int,
                   device: torch.device, kernel: bool | None = None,
                   dtype: torch.dtype = torch.bfloat16) -> AttentionMetadata:
    """decode_tables/decode_lens: block table and context length (including the
    new token) of each decode row. prefills: (block table, start, num_tokens).
    Tables must cover their context and no more. kernel: use the native kernel
    (None: whenever `use_native` says so)."""
    if kernel is None:
        kernel = use_native(device, dtype)
    slots = torch.tensor(_slot_mapping(decode_tables, decode_lens, prefills, block_size),
                         dtype=torch.int64).to(device)
    return _layout(slots, decode_tables, decode_lens, prefills, block_size, device, dtype,
                   kernel=kernel, window=None)


def _layout(slots: torch.Tensor, decode_tables: list[list[int]], decode_lens: list[int],
            prefills: list[tuple[list[int], int, int]], bs: int, device: torch.device, dtype: torch.dtype,
            kernel: bool, window: int | None) -> AttentionMetadata:
    if kernel:
        meta = _native_metadata(slots, decode_tables, decode_lens, prefills, bs, device, dtype, window)
    else:
        gpu = _gpu_decode(decode_tables, decode_lens, device) if decode_tables and use_triton(device) else None
        meta = _torch_metadata(slots, [] if gpu else decode_tables, [] if gpu else decode_lens, prefills, bs,
                               device, window, first_row=len(decode_tables))
        meta.gpu = gpu
    meta.window = window
    meta.max_context = max([*decode_lens, *(s + n for _, s, n in prefills)], default=0)
    meta.source = (decode_tables, decode_lens, prefills, bs, device, dtype)
    return meta


def _gpu_decode(decode_tables: list[list[int]], decode_lens: list[int], device: torch.device) -> GpuDecode:
    nb = max(len(t) for t in decode_tables)
    rows = [t + [0] * (nb - len(t)) + [n] for t, n in zip(decode_tables, decode_lens)]
    both = torch.tensor(rows, dtype=torch.int32).to(device)  # one copy to the device: tables and lengths
    return GpuDecode(len(rows), both[:, :nb], both[:, nb].contiguous())


def _torch_metadata(slots: torch.Tensor, decode_tables: list[list[int]], decode_lens: list[int],
                    prefills: list[tuple[list[int], int, int]], bs: int, device: torch.device,
                    window: int | None, first_row: int | None = None) -> AttentionMetadata:
    decode = None
    if decode_tables:
        # a row of context n sees positions [lo, n), from its block fb on
        lo = [max(0, n - window) if window else 0 for n in decode_lens]
        fb = [x // bs for x in lo]
        tables = [t[f:] for t, f in zip(decode_tables, fb)]
        nb = max(len(t) for t in tables)
        padded = [t + [0] * (nb - len(t)) for t in tables]
        mask = None
        if any(n - f * bs != nb * bs or x != f * bs for n, f, x in zip(decode_lens, fb, lo)):
            pos = torch.arange(nb * bs)[None, :] + torch.tensor(fb, dtype=torch.int64)[:, None] * bs
            mask = pos < torch.tensor(decode_lens, dtype=torch.int64)[:, None]
            if window:
                mask &= pos >= torch.tensor(lo, dtype=torch.int64)[:, None]
            mask = mask[:, None, None, :].to(device)
        decode = DecodeBatch(len(decode_tables), torch.tensor(padded, dtype=torch.int64).view(-1).to(device),
                             nb, mask)
    spans = []
    row = len(decode_tables) if first_row is None else first_row
    for table, start, n in prefills:
        if start == 0 and (window is None or n <= window):
            spans.append(PrefillSpan(row, n, 0, None, None))
        else:
            fb = max(0, start - window + 1) // bs if window else 0  # the first row's window starts there
            q_pos = torch.arange(start, start + n)[:, None]
            k_pos = torch.arange(fb * bs, start + n)[None, :]
            mask = k_pos <= q_pos
            if window:
                mask &= k_pos > q_pos - window
            blocks = torch.tensor(table[fb:], dtype=torch.int64).to(device) if start else None
            spans.append(PrefillSpan(row, n, start, blocks, mask.to(device), fb * bs))
        row += n
    return AttentionMetadata(slots, decode, spans)


def _slot_mapping(decode_tables: list[list[int]], decode_lens: list[int],
                  prefills: list[tuple[list[int], int, int]], bs: int) -> list[int]:
    """The cache slot of each new token, in the step's row order."""
    slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(decode_tables, decode_lens)]
    for table, start, n in prefills:
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
    return slots


def _native_metadata(slots: torch.Tensor, decode_tables: list[list[int]], decode_lens: list[int],
                     prefills: list[tuple[list[int], int, int]], bs: int, device: torch.device,
                     dtype: torch.dtype, window: int | None) -> AttentionMetadata:
    row_start: list[int] = []
    num_rows: list[int] = []
    starts: list[int] = []
    offsets: list[int] = []
    tables: list[int] = []

    def segment(row: int, n: int, start: int, table: list[int]) -> None:
        row_start.append(row)
        num_rows.append(n)
        starts.append(start)
        offsets.append(len(tables))
        tables.extend(table)

    for row, (t, n) in enumerate(zip(decode_tables, decode_lens)):
        segment(row, 1, n - 1, t)
    spans = []
    row = len(decode_tables)
    all_native = BF16_CHUNKS_NATIVE and dtype is torch.bfloat16 and native.big_tiles()
    for table, start, n in prefills:
        # torch's flash kernel has no window mask: a chunk the window cuts stays native
        if n >= GEMM_CHUNK_ROWS and not all_native and not (window and start + n > window):
            prefix = torch.tensor(table[:-(-start // bs)], dtype=torch.int64).to(device) if start else None
            spans.append(PrefillSpan(row, n, start, prefix, None))
        else:
            segment(row, n, start, table)
        row += n
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    segs = NativeSegments(len(row_start), i32(row_start), i32(num_rows), i32(starts), i32(offsets),
                          i32(tables or [0])) if row_start else None
    return AttentionMetadata(slots, None, spans, segs, kernel=True)


