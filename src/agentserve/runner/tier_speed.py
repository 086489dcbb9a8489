"""How fast the KV tiers move blocks on this machine: the disk tier's files
(`disk_bandwidth`, which `agentserve profile` records) and the host tier's
copies against the head-major path they replaced (`tier_copy_speed`, behind
`python -m benchmarks tier-copy-speed`)."""

from __future__ import annotations

import os
import statistics
import time

import torch

from agentserve.runner.disk_store import DiskStore
from agentserve.runner.kv_cache import read_host, write_host


def disk_bandwidth(store: DiskStore, num_blocks: int) -> tuple[float, float]:
    """(write, read) bytes per second of the disk tier's own block files:
    `num_blocks` files written (checksummed, renamed into place) then read back
    and checked, the payload counted, on the store's threads as the tier runs. The page cache is asked to drop the files
    before they are read, where the OS allows, so reads come from the device.
    The files are removed afterwards (`clean`)."""
    payload = os.urandom(store.payload_bytes)
    store.clean()
    try:
        t0 = time.perf_counter()
        _raise_first(store.write_many([(slot, payload) for slot in range(num_blocks)]))
        fd = os.open(store.dir, os.O_RDONLY)
        try:
            os.fsync(fd)  # the renames; each file's data is flushed below before reading
        finally:
            os.close(fd)
        for slot in range(num_blocks):
            with open(store.path(slot), "rb") as f:
                os.fsync(f.fileno())
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        wrote = time.perf_counter() - t0
        t0 = time.perf_counter()
        _raise_first(store.read_many(range(num_blocks)))
        read = time.perf_counter() - t0
    finally:
        store.clean()
    total = num_blocks * store.payload_bytes
    return total / max(wrote, 1e-9), total / max(read, 1e-9)


def _raise_first(results: list) -> None:
    for r in results:
        if isinstance(r, Exception):
            raise r


def tier_copy_speed(device: str, shape: str, blocks: int, block_size: int = 16, repeats: int = 5) -> dict:
    """Host-tier copy bandwidth of `blocks` blocks of a `random_model` shape's KV
    each way, by the runner's copies and by the head-major path they replaced
    (`python -m benchmarks tier-copy-speed`)."""
    from agentserve.runner.config import ModelConfig
    from agentserve.runner.kv_cache import PagedKVCache
    from agentserve.runner.random_model import SHAPES

    dev = torch.device(device)
    cfg = ModelConfig.from_hf(dict(SHAPES[shape], eos_token_id=None), name=shape)
    kv = PagedKVCache(cfg, 2 * blocks, block_size, blocks, torch.bfloat16, dev)
    kv.device_kv.normal_()
    pinned = dev.type == "cuda"
    head_major = torch.zeros((2, cfg.num_layers, cfg.num_kv_heads, blocks, block_size, cfg.head_dim),
                             dtype=torch.bfloat16, pin_memory=pinned)
    src = list(range(blocks))
    src_idx = torch.tensor(src, device=dev)

    def sync() -> None:
        if pinned:
            torch.cuda.synchronize(dev)

    def timed(fn) -> float:
        fn()
        sync()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    def old_offload(slots: list[int]) -> None:
        head_major[:, :, :, torch.tensor(slots)] = kv.gather(src).to("cpu")

    def old_reload(slots: list[int]) -> None:
        kv.device_kv[:, :, :, src_idx] = head_major[:, :, :, torch.tensor(slots)].to(dev)

    def new_offload(slots: list[int]) -> None:
        write_host(kv.host_kv, kv.gather(src), slots)

    def new_reload(slots: list[int]) -> None:
        kv.device_kv[:, :, :, src_idx] = read_host(kv.host_kv, slots, dev)

    orders = {"consecutive": list(range(blocks)),
              "scattered": torch.randperm(blocks, generator=torch.Generator().manual_seed(0)).tolist()}
    moved = blocks * kv.block_bytes
    rows = []
    for path, off, rel in [("head-major, pageable bounce (before)", old_offload, old_reload),
                           ("block-major (the runner's)", new_offload, new_reload)]:
        row = {"path": path}
        for order, slots in orders.items():
            row[f"offload {order}"] = moved / timed(lambda: off(slots)) / 1e9
            row[f"reload {order}"] = moved / timed(lambda: rel(slots)) / 1e9
        rows.append(row)
    # the runner's path is exact: a scattered round trip into other device blocks
    want = kv.gather(src).clone()
    new_offload(orders["scattered"])
    dst = torch.arange(blocks, 2 * blocks, device=dev)
    kv.device_kv[:, :, :, dst] = read_host(kv.host_kv, orders["scattered"], dev)
    sync()
    name = torch.cuda.get_device_name(dev) if pinned else "cpu"
    return {"device": name, "shape": shape, "blocks": blocks, "block_bytes": kv.block_bytes, "repeats": repeats,
            "exact": bool(torch.equal(kv.device_kv[:, :, :, dst], want)), "rows": rows}
