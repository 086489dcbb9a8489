"""The KV side of a prefetch (engine/prefetch.py): which blocks of a program's
chain lie below the device, their reload into free device blocks without a
request, and where the reloaded blocks wait. The reloads are the tiers' own
(kv/copies.py, kv/disk_tier.py): queued, handed to the executor with the
step's copies, counted once confirmed; a reload holds its device block until
it lands, after which the block is a free cached block like any other. A
prefetch's stage reads the chain's blocks only on disk into the host tier
instead (kv/stage_copies.py)."""

from __future__ import annotations

from collections.abc import Iterable

from agentserve.kv.block import Block
from agentserve.kv.manager import KVCacheManager
from agentserve.kv.prefix_index import Node


def tier_blocks(kv: KVCacheManager, path: list[Node]) -> list[Node]:
    """The nodes of `path` (a chain from the root) a reload would bring back:
    those with no device block and a confirmed copy in the host or disk tier, up
    to the first node a match could not pass (no copy anywhere, or a reload of
    it already under way)."""
    if not kv.host.enabled or kv.parts is not None:
        # (the hybrid cache: a block brought back alone, without its window part,
        # would end a hit that its host copies, reloaded with their parts, serve)
        return []
    loading, dloading, staging = kv.copies.loading, kv.disk_copies.loading, kv.stages.staging
    out = []
    for node in path:
        if node in loading or node in dloading or node in staging:
            break
        if node.block is None:
            if not kv.host.readable(node) and not kv.disk.readable(node):
                break
            out.append(node)
    return out


def stage_blocks(kv: KVCacheManager, path: list[Node]) -> list[Node]:
    """The nodes of `path` a disk -> host stage (kv/stage_copies.py) would read:
    those whose KV is only on disk, up to the first node a match could not pass
    (no copy anywhere, or a copy of it under way)."""
    if not kv.disk.enabled or kv.parts is not None:
        return []
    loading, dloading, staging = kv.copies.loading, kv.disk_copies.loading, kv.stages.staging
    out = []
    for node in path:
        if node in loading or node in dloading or node in staging:
            break
        if node.block is None:
            if node.host_slot is not None:  # a host copy, or one on its way there
                if not kv.host.readable(node) and not kv.disk.readable(node):
                    break
                continue
            if not kv.disk.readable(node):
                break
            out.append(node)
    return out


def load_chain(kv: KVCacheManager, nodes: list[Node], path: list[Node], now: float) -> list[tuple[Node, Block]] | None:
    """Reload `nodes` (from `tier_blocks(kv, path)`) into free device blocks;
    the blocks `path` already holds on the device are kept through the
    allocation (it evicts others). Returns each node with its block, or None,
    with nothing changed, when the free blocks do not suffice."""
    pool = kv.pool
    device = [n.block for n in path if n.block is not None]
    for b in device:
        pool.ref(b)
    if len(nodes) > pool.num_free:
        pool.release(device, now)
        return None
    host = [n for n in nodes if kv.host.readable(n)]
    kv.copies.loading.update(host)  # their tier copies are not evicted by this allocation
    kv.disk_copies.loading.update(n for n in nodes if not kv.host.readable(n))
    fresh = pool.allocate(len(nodes))
    assert fresh is not None  # checked above
    out = []
    for node, block in zip(nodes, fresh):
        pool.attach(block, node)
        if kv.host.readable(node):
            kv.copies.load(node, block)
            kv.host.touch(node)
        else:
            kv.disk_copies.load(node, block)
        out.append((node, block))
    pool.release(fresh, now)  # the reloads hold them until they land
    pool.release(device, now)
    return out


def landed(kv: KVCacheManager, loads: list[tuple[Node, Block]]) -> bool:
    """Every reload of `loads` finished (landed or failed)."""
    loading, dloading = kv.copies.loading, kv.disk_copies.loading
    return not any(n in loading or n in dloading for n, _ in loads)


def promote(kv: KVCacheManager, blocks: Iterable[Block], now: float) -> None:
    """Free cached `blocks` leave the cold end for the strategy's newest place:
    the turn they were reloaded for has come and takes them."""
    pool = kv.pool
    for b in blocks:
        if b.ref_cnt == 0 and b.node is not None:
            pool.ref(b)
            pool.release([b], now)
