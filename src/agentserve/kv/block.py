"""A KV block: `block_size` token slots of one request's context.

A block is *cached* when it is full and registered in the prefix index: it then
knows its tokens and its parent block, so a match can verify content instead of
trusting a hash."""

from __future__ import annotations


class Block:
    __slots__ = (
        "block_id", "ref_cnt", "key", "tokens", "parent", "num_children",
        "hits", "last_access", "prev", "next", "strategy_data", "node", "wpart", "wrefs",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.key: int | None = None  # prefix-index key (hash of parent key + tokens); None = not cached
        self.tokens: tuple[int, ...] | None = None
        self.parent: Block | None = None  # previous block in the cached chain
        self.num_children = 0  # cached blocks whose parent is this block
        self.hits = 0  # prefix-index hits since the block was cached
        self.last_access = 0.0
        # Links and a spare slot for eviction strategies (intrusive lists, heap entries).
        self.prev: Block | None = None
        self.next: Block | None = None
        self.strategy_data: object = None
        self.node: object = None  # the prefix-index node this block holds KV for (None = not cached)
        # the hybrid cache (kv/window_parts.py): the blocks holding this block's
        # tokens for the sliding-window layers, and how many holders read them
        self.wpart: list[Block] | None = None
        self.wrefs = 0

    @property
    def is_cached(self) -> bool:
        return self.key is not None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.is_cached})"
