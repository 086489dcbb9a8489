"""The KV side of a prefetch (engine/prefetch.py): which blocks of a program's
chain lie below the device, their reload into free device blocks without a
request, and where the reloaded blocks wait. The reloads are the tiers' own
(kv/copies.py, kv/disk_tier.py): queued, handed to the executor with the
step's copies, counted once confirmed; a reload holds its device block until
it lands, after which the block is a free cached block like any other. Under the
hybrid cache the reload takes the window parts along as an admission does
(kv/window_tier.py `hold`/`fill`), into blocks it reloads or blocks still on
the device; a filled part is held until it lands, then left unheld. A
prefetch's stage reads the chain's blocks only on disk into the host tier
instead (kv/stage_copies.py)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from agentserve.kv.block import Block
from agentserve.kv.block_table import BlockTable
from agentserve.kv.manager import KVCacheManager
from agentserve.kv.prefix_index import Node
from agentserve.kv.prefix_match import PrefixMatch


@dataclass
class ChainReload:
    """What a reload of a chain's prefix from the tiers below takes
    (`chain_reload`): `path`, the prefix a hit reaches once it landed; `nodes`,
    its nodes reloaded into device blocks; `parts` (the hybrid cache), its
    nodes whose window part comes back from its host copy (kv/window_tier.py);
    `taken`, the device blocks the reloads fill (the nodes' and the parts'
    pages); `need`, the free blocks issuing it takes: those, and the free
    cached blocks of the path and the window's unheld parts, which it holds
    meanwhile."""

    path: list[Node]
    nodes: list[Node]
    parts: list[Node] = field(default_factory=list)
    taken: int = 0
    need: int = 0


def chain_reload(kv: KVCacheManager, path: list[Node]) -> ChainReload | None:
    """The reload of `path` (a chain from the root): its nodes with no device
    block and a confirmed copy in the host or disk tier, up to the first node a
    match could not pass (no copy anywhere, or a copy of it or of its part
    already under way). Under the hybrid cache, only as far as a hit would
    have its window (`WindowParts.valid_nodes`), with the parts of that window
    not on the device. None: nothing to reload."""
    if not kv.host.enabled:
        return None
    loading, dloading, staging = kv.copies.loading, kv.disk_copies.loading, kv.stages.staging
    filling = kv.window_tier.filling if kv.window_tier is not None else ()
    reach = []
    for node in path:
        if node in loading or node in dloading or node in staging or (filling and node.block in filling):
            break
        if node.block is None and not kv.host.readable(node) and not kv.disk.readable(node):
            break
        reach.append(node)
    parts = kv.parts
    if parts is None:
        nodes = [n for n in reach if n.block is None]
        return ChainReload(reach, nodes, taken=len(nodes), need=len(nodes) + _free_cached(reach)) if nodes else None
    reach = reach[:parts.valid_nodes(reach)]
    nodes = [n for n in reach if n.block is None]
    window = reach[parts.first_needed(len(reach) * kv.block_size):]
    back = [n for n in window if n.block is None or n.block.wpart is None]
    # while the reload is issued it holds the window's parts still on the device, unheld ones included
    unheld = sum(1 for n in window if n.block is not None and n.block.wpart is not None and n.block.wrefs == 0)
    if not nodes and not back:
        return None
    taken = len(nodes) + parts.pages * len(back)
    return ChainReload(reach, nodes, back, taken, taken + parts.pages * unheld + _free_cached(reach))


def _free_cached(path: list[Node]) -> int:
    """Blocks of `path` on the device that nobody holds: a reload holds them through its allocation."""
    return sum(1 for n in path if n.block is not None and n.block.ref_cnt == 0)


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


def load_chain(kv: KVCacheManager, r: ChainReload, now: float) -> list[tuple[Node, Block]] | None:
    """Reload `r` (from `chain_reload`) into free device blocks; the blocks its
    path already holds on the device are kept through the allocation (it evicts
    others), and so are the parts of its window. Returns each node reloaded,
    or whose part is, with its block; None, with nothing changed, when the
    free blocks do not suffice."""
    pool = kv.pool
    if r.need > pool.num_free:
        return None
    device = [n.block for n in r.path if n.block is not None]
    for b in device:
        pool.ref(b)
    nodes = r.nodes
    host = [n for n in nodes if kv.host.readable(n)]
    kv.copies.loading.update(host)  # their tier copies are not evicted by this allocation
    kv.disk_copies.loading.update(n for n in nodes if not kv.host.readable(n))
    if r.parts:  # the window's parts: held through the allocation, those to reload given pages first
        st = BlockTable(computed=len(r.path) * kv.block_size)
        reloads = kv.window_tier.hold(st, PrefixMatch(r.path, kv.block_size))
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
    if r.parts:
        st.blocks = [n.block for n in r.path]
        kv.window_tier.fill(st, reloads)  # (its reloads hold the parts they fill until they land)
        kv.parts.release_all(st.window.values(), now)
        reloaded = set(nodes)
        out.extend((n, n.block) for n in r.parts if n not in reloaded)
    pool.release(fresh, now)  # the reloads hold them until they land
    pool.release(device, now)
    return out


def landed(kv: KVCacheManager, loads: list[tuple[Node, Block]]) -> bool:
    """Every reload of `loads` finished (landed or failed), its blocks' and their parts'."""
    loading, dloading = kv.copies.loading, kv.disk_copies.loading
    filling = kv.window_tier.filling if kv.window_tier is not None else ()
    return not any(n in loading or n in dloading or b in filling for n, b in loads)


def promote(kv: KVCacheManager, blocks: Iterable[Block], now: float) -> None:
    """Free cached `blocks` leave the cold end for the strategy's newest place:
    the turn they were reloaded for has come and takes them."""
    pool = kv.pool
    for b in blocks:
        if b.ref_cnt == 0 and b.node is not None:
            pool.ref(b)
            pool.release([b], now)
