"""A request's block table: the device blocks that hold its KV, in token
order, and how far they are registered in the prefix index.

The table lives on the request that owns it (`Request.block_table`), not in a
map of the KV manager: whoever holds the request holds its KV, and a step
reaches a request's blocks without a lookup. The KV manager creates a table at
admission, grows, trims and indexes it, and releases it at the end of a turn
(free, swap out, or hand the blocks to a pin)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from agentserve.kv.block import Block
from agentserve.kv.prefix_index import Node


@dataclass(eq=False, slots=True)
class BlockTable:
    blocks: list[Block] = field(default_factory=list)
    num_indexed: int = 0  # leading blocks registered in the prefix index
    last_node: Node | None = None  # the index node of the last indexed block (the root: none)
    index_stopped: bool = False  # a collision cut the chain: index nothing further
    released: bool = False  # freed, swapped out or pinned: the blocks are no longer this table's
    salt: Hashable = None  # the prefix cache's salt its blocks are indexed under (prefix_index.py)
    loads: list[Block] = field(default_factory=list)  # blocks admitted by reload, until the reloads land
    # the hybrid cache (kv/window_parts.py): the blocks whose window parts this
    # table holds, by position; the tokens whose KV is computed; the prompt's
    # length, whose window is kept for the next turn's hit; and where its
    # prompt left another prompt's chain (`PrefixMatch.branch`, in tokens),
    # whose window is kept too
    window: dict[int, Block] = field(default_factory=dict)
    computed: int = 0
    checkpoint: int = 0
    branch: int = 0

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    def __len__(self) -> int:
        return len(self.blocks)
