"""The prefix index: a tree of full token blocks, keyed by a hash chain and
verified by content.

Each node stands for one block of `block_size` tokens at one position after one
exact prefix. A node may hold a device block, a host-tier slot, a disk-tier slot,
any of them together, or none (an interior node whose KV was evicted while its descendants' was not;
when the prefix is recomputed, the descendants become reachable again).

A child is found by `key_fn(tokens)` in its parent's table and then compared
token by token, so a hash collision is a miss, never a false hit. Every node
also carries `key`, the hash chain value hash(parent key, tokens): a content
id that survives eviction (ARC's ghost lists use it).

A *salt* (a tenant, a request's `cache_salt`) splits the tree at its root: a
salted first block is found under (salt, lookup key), and every later block
hangs below its first, so requests with different salts never share a node,
and none of them can tell from a hit what another one sent."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from agentserve.kv.block import Block


@dataclass(frozen=True)
class _SaltedKey:
    """A first block's lookup key under a salt: never equal to an unsalted key, whatever key_fn returns."""
    salt: Hashable
    key: Hashable


def common_blocks(a: Sequence[int], b: Sequence[int], block_size: int, limit: int | None = None) -> int:
    """How many leading full blocks `a` and `b` share (at most `limit`)."""
    n = min(len(a), len(b)) // block_size
    if limit is not None:
        n = min(n, limit)
    if a[:n * block_size] == b[:n * block_size]:
        return n
    for i in range(n):
        lo, hi = i * block_size, (i + 1) * block_size
        if a[lo:hi] != b[lo:hi]:
            return i
    return n


@dataclass(frozen=True, slots=True)
class ChainHint:
    """A sequence whose full blocks were indexed along the chain ending at `node`
    (the last indexed block of its block table), under `salt`."""

    tokens: Sequence[int]
    node: Node
    salt: Hashable = None


class Node:
    __slots__ = ("tokens", "parent", "children", "key", "block", "host_slot", "disk_slot", "lookup_key",
                 "prompt", "__weakref__")

    def __init__(self, tokens: tuple[int, ...], parent: Node | None, key: int, lookup_key: Hashable) -> None:
        self.tokens = tokens
        self.parent = parent
        self.children: dict[Hashable, Node] = {}
        self.key = key
        self.lookup_key = lookup_key
        self.block: Block | None = None
        self.host_slot: int | None = None
        self.disk_slot: int | None = None
        self.prompt = False  # some sequence had this block's tokens all in its prompt (kv/manager.py `commit`)

    @property
    def is_empty(self) -> bool:
        return self.block is None and self.host_slot is None and self.disk_slot is None and not self.children


def _default_key_fn(tokens: tuple[int, ...]) -> Hashable:
    return tokens


class PrefixIndex:
    def __init__(self, block_size: int, key_fn: Callable[[tuple[int, ...]], Hashable] | None = None) -> None:
        self.block_size = block_size
        self.key_fn = key_fn or _default_key_fn
        self.root = Node((), None, 0, None)
        self.num_nodes = 0

    def blocks_of(self, token_ids: Sequence[int], max_blocks: int | None = None):
        """Yield the full-block token tuples of `token_ids`."""
        bs = self.block_size
        n = len(token_ids) // bs
        if max_blocks is not None:
            n = min(n, max_blocks)
        for i in range(n):
            yield tuple(token_ids[i * bs:(i + 1) * bs])

    def _lookup_key(self, parent: Node, tokens: tuple[int, ...], salt: Hashable) -> Hashable:
        lk = self.key_fn(tokens)
        return lk if salt is None or parent is not self.root else _SaltedKey(salt, lk)

    def child(self, node: Node, tokens: tuple[int, ...], salt: Hashable = None) -> Node | None:
        """`salt` counts only below the root (see the module's docstring)."""
        c = node.children.get(self._lookup_key(node, tokens, salt))
        if c is not None and c.tokens == tokens:
            return c
        return None

    def walk(self, token_ids: Sequence[int], max_blocks: int | None = None, salt: Hashable = None,
             hint: ChainHint | None = None) -> list[Node]:
        """The existing nodes along `token_ids`' full blocks, from the root, as far as they go.
        With a `hint` (the chain of an earlier sequence, e.g. the program's last turn), the
        blocks `token_ids` shares with it are taken from that chain without a lookup each."""
        bs = self.block_size
        n = len(token_ids) // bs
        if max_blocks is not None:
            n = min(n, max_blocks)
        path = self._along(hint, token_ids, n, salt) if hint is not None else []
        node = path[-1] if path else self.root
        for i in range(len(path), n):
            node = self.child(node, tuple(token_ids[i * bs:(i + 1) * bs]), salt)
            if node is None:
                break
            path.append(node)
        return path

    def _along(self, hint: ChainHint, token_ids: Sequence[int], n: int, salt: Hashable) -> list[Node]:
        """The first nodes of `hint`'s chain that `token_ids` shares (none if the chain
        was cut since: a node on it was pruned; or it was made under another salt)."""
        if hint.salt != salt:
            return []
        chain = []
        append, root = chain.append, self.root
        node = hint.node
        while node is not None and node is not root:
            append(node)
            node = node.parent
        if node is not root:
            return []
        chain.reverse()
        return chain[:common_blocks(token_ids, hint.tokens, self.block_size, min(n, len(chain)))]

    def get_or_create(self, parent: Node, tokens: tuple[int, ...], salt: Hashable = None) -> Node | None:
        """The child of `parent` for `tokens`, created if absent. None when a
        different block already owns the lookup key (a collision): that block
        stays, the new one is simply not indexed."""
        lk = self._lookup_key(parent, tokens, salt)
        c = parent.children.get(lk)
        if c is not None:
            return c if c.tokens == tokens else None
        key = hash((parent.key, salt, tokens)) if isinstance(lk, _SaltedKey) else hash((parent.key, tokens))
        c = Node(tokens, parent, key, lk)
        parent.children[lk] = c
        self.num_nodes += 1
        return c

    def prune(self, node: Node) -> None:
        """Drop `node` and its now-empty ancestors once they hold nothing."""
        while node is not self.root and node.is_empty:
            parent = node.parent
            assert parent is not None
            del parent.children[node.lookup_key]
            node.parent = None
            self.num_nodes -= 1
            node = parent

    def own_tail(self, node: Node) -> list[Node]:
        """The end of the chain through `node` that no other chain shares:
        `node` and its ancestors up to the first that has another child (or
        `node` has a child), shallowest first."""
        own: list[Node] = []
        came_from = None
        while node is not None and node is not self.root:
            if any(c is not came_from for c in node.children.values()):
                break
            own.append(node)
            node, came_from = node.parent, node
        own.reverse()
        return own

    def iter_nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())
