"""Chains no turn will match again, sent to the cold end of eviction (the pool's
cold list, and the host tier's cold end): a program's history its next turn
rewrote (`supersede`), and the end of an ended program's chain that no other
chain shares (`retire`). Evicted from there, their KV is dropped, not written
to the tier below: on agent workloads most KV that reaches the disk tier was
such dead weight (in the simulator, on BFCL, none of the blocks spilled to
disk was read back). Part of `KVCacheManager` (kv/manager.py), whose pool,
index, host tier and pins it uses."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from agentserve.kv.block_pool import BlockPool
from agentserve.kv.host_tier import HostTier
from agentserve.kv.pins import PinTable
from agentserve.kv.prefix_index import ChainHint, PrefixIndex, common_blocks
from agentserve.kv.window_parts import WindowParts


class DeadChains:
    block_size: int
    pool: BlockPool
    index: PrefixIndex
    host: HostTier
    pins: PinTable
    parts: WindowParts | None

    def supersede(self, program_id: str, old_tokens: Sequence[int], new_tokens: Sequence[int], now: float,
                  salt: Hashable = None) -> int:
        """A program's new turn `new_tokens` left `old_tokens`, the history of its
        last turn (the agent rewrote or truncated its context): the cached chain
        past the block where they part will not be matched by this program again.
        Its blocks leave the program's pin now, with the pin's blocks that no
        match can reach (a partial last block, private copies), and go to the
        cold end of eviction, deepest first; so do their host copies. Returns the
        number of device blocks demoted (0 when the new turn extends the old).
        `salt`: the prefix cache's salt of the program's turns."""
        bs = self.block_size
        common = common_blocks(old_tokens, new_tokens, bs)
        if common >= len(old_tokens) // bs:
            return 0
        gone = self.index.walk(old_tokens, salt=salt)[common:]
        pin = self.pins.get(program_id)
        if pin is not None:
            dead = set(gone)
            keep = [b for b in pin.blocks if b.node is not None and b.node not in dead]
            if len(keep) < len(pin.blocks):
                dropped = [b for b in pin.blocks if b.node is None or b.node in dead]
                pin.blocks = keep
                pin.num_tokens = min(pin.num_tokens, common * bs)
                if pin.window:  # the window parts it held of them go first (hybrid cache)
                    out = {id(b) for b in dropped}
                    for b in [b for b in pin.window if id(b) in out]:
                        self.parts.release(b, now)
                    pin.window = [b for b in pin.window if id(b) not in out]
                self.pool.release(dropped, now)
        return self._demote(gone)

    def retire(self, hint: ChainHint | None) -> int:
        """A program ended: the end of its chain (`hint`, its last turn's) that no
        other chain hangs off will not be matched again, so its free cached
        blocks go to the cold end of eviction, deepest first, and so do their
        host copies; it stops at the first node another chain shares (a common
        system prompt). Returns the number of device blocks demoted."""
        return 0 if hint is None else self._demote(self.index.own_tail(hint.node))

    def _demote(self, nodes: list) -> int:
        """Send `nodes` (shallowest first) to the cold end of every tier."""
        for node in nodes:  # shallowest first, so the deepest copy ends up first in line
            self.host.demote(node, dead=True)
        return self.pool.demote(n.block for n in reversed(nodes) if n.block is not None)
