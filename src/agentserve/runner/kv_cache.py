"""The paged KV cache tensors: device blocks and the host-memory tier, and
the copies to and from the disk tier's files (runner/disk_store.py).

Layout: one tensor per tier of shape [2, layers, kv_heads, blocks, block_size,
head_dim] (K then V). The KV head comes before the block so that gathering a
request's blocks (one `index_select` of whole blocks) yields, per head, its
context as one contiguous [tokens, head_dim] slab: the layout the attention
kernel reads fastest (gathering whole blocks is several times faster than
gathering token slots, and attention over a contiguous slab is faster than
over a strided one; docs/kernels.md, 'The KV cache layout'). New tokens are
written by slot (block * block_size + offset) into the per-layer view
[kv_heads, blocks * block_size, head_dim].

The host tier is block-major, [blocks, 2, layers, kv_heads, block_size,
head_dim]: each host slot is one contiguous run of bytes, which is what a
disk file holds and what a DMA copy moves at full speed. An offload gathers
its device blocks on the device (one indexed copy over all layers) and turns
them block-major; from a GPU each run of consecutive host slots is then one
asynchronous copy into pinned memory (on the CPU one indexed copy does it
all); a reload does the reverse. On a GPU that moves the tier's bytes at
about the host link's speed, an order of magnitude faster than head-major host
slots copied through a pageable bounce and CPU indexing (docs/gpu.md,
'Host-tier copies'; `python -m benchmarks tier-copy-speed`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agentserve.runner.config import ModelConfig
from agentserve.runner.disk_store import DiskBlockError, DiskStore, fingerprint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HybridLayout:
    """Where each layer's KV lives in the hybrid cache (kv/window_parts.py).

    A block of the pool holds `slots` layers' KV (as many as the model has
    global layers). The global layers are group 0: a sequence's blocks. The
    window layers, `slots` to a group, are groups 1..pages: group j reads page
    j - 1 of each block's window part. Layer i's KV is slot `slot[i]` of
    whichever block its group's table names, so the pages of all groups share
    one pool and one tensor per slot."""
    window: int
    slots: int  # layers a block holds (the global layers' count)
    pages: int  # blocks a window part takes
    slot: tuple[int, ...]  # by layer
    group: tuple[int, ...]  # by layer: 0 global, j >= 1 the window part's page j - 1

    @classmethod
    def of(cls, windows: Sequence[int | None]) -> "HybridLayout | None":
        """The layout for layers with these sliding windows (None: global), or
        None where a hybrid cache does not apply: no window layers, no global
        layers (every layer windowed: the full cache serves it), or two windows."""
        sizes = {w for w in windows if w is not None}
        n_global = sum(1 for w in windows if w is None)
        if len(sizes) != 1 or n_global == 0:
            return None
        slot, group = [], []
        g = k = 0
        for w in windows:
            if w is None:
                slot.append(g)
                group.append(0)
                g += 1
            else:
                slot.append(k % n_global)
                group.append(1 + k // n_global)
                k += 1
        return cls(sizes.pop(), n_global, -(-k // n_global), tuple(slot), tuple(group))

    @property
    def layers_per_full_block(self) -> int:
        """Slots a block of every layer takes: the full cache's block in this layout's blocks."""
        return self.slots * (1 + self.pages)


def kv_layout_for(choice: str, windows, disk: bool) -> HybridLayout | None:
    """The layout `--kv-layout` asks for (auto, hybrid, full) for layers with
    these sliding windows; `disk`: a disk tier is asked for. The hybrid
    cache has a host tier but no disk tier, so auto takes the full cache with a
    disk tier (saying so)."""
    if choice not in ("auto", "hybrid", "full"):
        raise ValueError(f"kv layout must be auto, hybrid or full, not {choice!r}")
    layout = None if choice == "full" else HybridLayout.of(windows)
    if choice == "hybrid" and layout is None:
        raise ValueError("--kv-layout hybrid needs a model with both sliding-window and global layers "
                         "(one window size); this one has " + _kinds(windows))
    if layout is not None and choice == "hybrid" and disk:
        raise ValueError("--kv-layout hybrid has no disk KV tier (a host tier it has): drop the disk tier "
                         "or use --kv-layout full")
    if layout is not None and choice == "auto" and disk:
        log.info("KV cache: full layout (every layer's KV of every token), since a disk tier is set "
                 "(the hybrid layout has none)")
        return None
    return layout


def _kinds(windows) -> str:
    n_window = sum(1 for w in windows if w is not None)
    sizes = sorted({w for w in windows if w is not None})
    return f"{len(windows) - n_window} global and {n_window} window layers" + (f" (windows {sizes})" if sizes else "")


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, num_host_blocks: int,
                 dtype: torch.dtype, device: torch.device, layout: HybridLayout | None = None) -> None:
        """`layout`: the hybrid cache's (then `num_blocks` blocks of `layout.slots`
        layers each, and host slots of as many: a window part's host copy takes
        `layout.pages` of them, copied like blocks); None: blocks of every layer."""
        self.layout = layout
        n_slots = cfg.num_layers if layout is None else layout.slots
        shape = (2, n_slots, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.dtype = dtype
        self.device_kv = torch.zeros(shape, dtype=dtype, device=device)
        self.host_kv: torch.Tensor | None = None
        if num_host_blocks > 0:
            hshape = (num_host_blocks, 2, n_slots, cfg.num_kv_heads, block_size, cfg.head_dim)
            # pinned host memory makes the device<->host copies asynchronous DMA on CUDA
            pin = self.device.type == "cuda"
            self.host_kv = torch.zeros(hshape, dtype=dtype, pin_memory=pin)
        self.block_shape = (2, n_slots, cfg.num_kv_heads, block_size, cfg.head_dim)
        self.block_bytes = self.device_kv[:, :, :, 0].numel() * self.device_kv.element_size()
        self.fingerprint = fingerprint(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, str(dtype))
        self.disk: DiskStore | None = None  # the disk tier's files (`attach_disk`)
        slot = range(cfg.num_layers) if layout is None else layout.slot
        self._k = [self.device_kv[0, slot[i]] for i in range(cfg.num_layers)]
        self._v = [self.device_kv[1, slot[i]] for i in range(cfg.num_layers)]

    @property
    def bytes(self) -> int:
        return self.device_kv.numel() * self.device_kv.element_size()

    @property
    def host_bytes(self) -> int:
        return 0 if self.host_kv is None else self.host_kv.numel() * self.host_kv.element_size()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer i, each [kv_heads, blocks, block_size, head_dim]."""
        return self._k[i], self._v[i]

    def gather(self, blocks: list[int]) -> torch.Tensor:
        """A copy of device blocks, on the device: what an overlapped offload
        writes to the host later (runner/copy_engine.py), read before the step's
        forward pass may write the blocks."""
        return self.device_kv[:, :, :, torch.tensor(blocks, device=self.device)]

    def offload(self, pairs: list[tuple[int, int]], staged: torch.Tensor | None = None) -> list[int]:
        """Copy device blocks to host slots: pairs of (device block, host block),
        or, given `staged` (`gather` of those device blocks), that snapshot.
        Returns the positions of the copies that failed (all of them, or none)."""
        if not pairs:
            return []
        if self.host_kv is None:
            raise RuntimeError("offload asked but the cache has no host tier")
        try:
            if staged is None:
                staged = self.gather([d for d, _ in pairs])
            write_host(self.host_kv, staged, [h for _, h in pairs])
        except (RuntimeError, MemoryError) as e:
            log.warning("offload of %d KV blocks failed: %s", len(pairs), e)
            return list(range(len(pairs)))
        return []

    def attach_disk(self, directory) -> DiskStore:
        """Use `directory` for the disk tier's files (cleaned of this server's old files)."""
        if self.host_kv is None:
            raise ValueError("the disk KV tier needs a host tier (it is filled from the host tier's evictions)")
        if self.layout is not None:
            raise ValueError("the hybrid KV cache has no disk tier: use the full layout to have one")
        store = DiskStore(directory, self.fingerprint, self.block_bytes)
        removed = store.clean()
        if removed:
            log.info("disk KV tier: removed %d block files of an earlier run from %s", removed, directory)
        self.disk = store
        return store

    def spill(self, pairs: list[tuple[int, int]]) -> list[int]:
        """Write host slots to disk-tier files: pairs of (host block, disk slot).
        Returns the positions of the writes that failed."""
        if not pairs:
            return []
        if self.host_kv is None:
            raise RuntimeError("spill asked but the cache has no disk tier")
        # in the step nothing reuses the host slots before they are written: no staging copy
        return self.write_spills(pairs, [self.host_kv[h] for h, _ in pairs])

    def stage_spills(self, slots: list[int]) -> torch.Tensor:
        """A copy of host slots (block-major, in host memory) for `write_spills`
        to write later: the slots may be reused by an offload meanwhile."""
        if self.disk is None or self.host_kv is None:
            raise RuntimeError("spill asked but the cache has no disk tier")
        return self.host_kv[torch.tensor(slots)]

    def write_spills(self, pairs: list[tuple[int, int]], blocks: Sequence[torch.Tensor]) -> list[int]:
        """Write `blocks` (the pairs' host slots, or `stage_spills` of them) to the
        pairs' disk slots. Returns the positions of the writes that failed."""
        if not pairs:
            return []
        if self.disk is None:
            raise RuntimeError("spill asked but the cache has no disk tier")
        failed = []
        errors = self.disk.write_many([(d, blocks[i].view(torch.uint8).reshape(-1).numpy().data)
                                       for i, (_, d) in enumerate(pairs)])
        for i, ((h, d), e) in enumerate(zip(pairs, errors)):
            if e is not None:
                log.warning("spill of host KV block %d to disk slot %d failed: %s", h, d, e)
                failed.append(i)
        return failed

    def load_disk(self, pairs: list[tuple[int, int]]) -> list[int]:
        """Read disk-tier files into device blocks: pairs of (disk slot, device block).
        Returns the positions of the reads that failed or were rejected (torn,
        foreign, corrupt): their device blocks were not written."""
        if not pairs:
            return []
        if self.disk is None:
            raise RuntimeError("disk reload asked but the cache has no disk tier")
        failed = []
        chunk = 4 * self.disk.threads  # payloads read ahead at most: a batch may be thousands of blocks
        for start in range(0, len(pairs), chunk):
            part = pairs[start:start + chunk]
            for i, ((d, dev), payload) in enumerate(zip(part, self.disk.read_many([d for d, _ in part])), start):
                try:
                    if isinstance(payload, Exception):
                        raise payload
                    block = torch.frombuffer(payload, dtype=torch.uint8).view(self.dtype).reshape(self.block_shape)
                    self.device_kv[:, :, :, dev] = block.to(self.device)
                except (DiskBlockError, OSError, ValueError, RuntimeError, MemoryError) as e:
                    log.warning("reload of disk slot %d failed: %s", d, e)
                    failed.append(i)
        return failed

    def stage_disk(self, pairs: list[tuple[int, int]]) -> list[int]:
        """Read disk-tier files into host slots (a prefetch's stage, kv/stage_copies.py):
        pairs of (disk slot, host block). Returns the positions of the reads that
        failed or were rejected: their host slots were not written."""
        if not pairs:
            return []
        if self.disk is None or self.host_kv is None:
            raise RuntimeError("stage asked but the cache has no disk tier")
        failed = []
        chunk = 4 * self.disk.threads
        for start in range(0, len(pairs), chunk):
            part = pairs[start:start + chunk]
            for i, ((d, h), payload) in enumerate(zip(part, self.disk.read_many([d for d, _ in part])), start):
                try:
                    if isinstance(payload, Exception):
                        raise payload
                    self.host_kv[h] = torch.frombuffer(payload, dtype=torch.uint8).view(self.dtype).reshape(
                        self.host_kv.shape[1:])
                except (DiskBlockError, OSError, ValueError, RuntimeError, MemoryError) as e:
                    log.warning("stage of disk slot %d into host slot %d failed: %s", d, h, e)
                    failed.append(i)
        return failed

    def load(self, pairs: list[tuple[int, int]]) -> list[int]:
        """Copy host slots back into device blocks: pairs of (host block, device block).
        Returns the positions of the copies that failed (all of them, or none)."""
        if not pairs:
            return []
        if self.host_kv is None:
            raise RuntimeError("reload asked but the cache has no host tier")
        try:
            dev = torch.tensor([d for _, d in pairs], device=self.device)
            self.device_kv[:, :, :, dev] = read_host(self.host_kv, [h for h, _ in pairs], self.device)
        except (RuntimeError, MemoryError) as e:
            log.warning("reload of %d KV blocks failed: %s", len(pairs), e)
            return list(range(len(pairs)))
        return []


def write_host(host: torch.Tensor, staged: torch.Tensor, slots: list[int]) -> None:
    """Write `staged` (device blocks as `gather` returns them) into the host
    slots `slots` of a block-major host tensor; returns once they hold it.
    From a GPU: one DMA copy per run of consecutive slots, straight into the
    pinned slots. On the CPU: one indexed copy (per-run copies each open an
    OpenMP region, which stalls while the forward pass holds the cores)."""
    blocks = staged.permute(3, 0, 1, 2, 4, 5)  # block-major (copy_ makes it so on the source's device)
    if staged.device.type == "cpu":
        host[torch.tensor(slots)] = blocks
        return
    for i, h, n in _runs(slots):
        host[h:h + n].copy_(blocks[i:i + n], non_blocking=True)
    if staged.device.type == "cuda":
        # the host slots must hold their bytes before the copy is reported done
        # (a spill or a reload may read them next)
        torch.cuda.current_stream(staged.device).synchronize()


def read_host(host: torch.Tensor, slots: list[int], device: torch.device) -> torch.Tensor:
    """Host slots `slots` of a block-major host tensor, on `device` in the device
    layout ([2, layers, kv_heads, len(slots), block_size, head_dim], a view);
    copied as `write_host` copies."""
    if device.type == "cpu":
        return host[torch.tensor(slots)].permute(1, 2, 3, 0, 4, 5)
    blocks = torch.empty((len(slots), *host.shape[1:]), dtype=host.dtype, device=device)
    for i, h, n in _runs(slots):
        blocks[i:i + n].copy_(host[h:h + n], non_blocking=True)
    return blocks.permute(1, 2, 3, 0, 4, 5)


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(position, first slot, count) of each run of consecutive slots, in order:
    one copy a run."""
    runs: list[tuple[int, int, int]] = []
    for i, h in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == h:
            pos, first, n = runs[-1]
            runs[-1] = (pos, first, n + 1)
        else:
            runs.append((i, h, 1))
    return runs
