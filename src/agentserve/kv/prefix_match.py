"""What a prefix match found: the leading full blocks of a token sequence that
need no recompute, each on the device or with a copy in a tier below to reload
(kv/manager.py `match`, then `admit`)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from agentserve.kv.prefix_index import Node


@dataclass
class PrefixMatch:
    """Leading full blocks of a token sequence that need no recompute: each
    node either has a device block or a host copy to reload."""

    nodes: list[Node]
    block_size: int
    salt: Hashable = None  # the prefix cache's salt the match was made under (prefix_index.py)
    num_host_blocks: int = 0  # of the nodes, those with no device block (admit reloads them: host or disk)
    num_disk_blocks: int = 0  # of those, the ones read from the disk tier
    # blocks up to where the sequence left an indexed chain that a prompt continued
    # otherwise (a rewritten history: a compaction, a shared system prompt); 0: none
    branch: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.nodes) * self.block_size

    @property
    def num_host_tokens(self) -> int:
        return self.num_host_blocks * self.block_size
