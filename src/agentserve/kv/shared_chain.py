"""The names and the budget of a KV directory that several servers share
(runner/shared_kv.py moves the bytes).

A block's file is named by its chain key: the hash of its parent's key and its
own tokens, as the prefix index chains its nodes, under a root key made of the
model's identity and KV layout and the request's salt (a tenant, a
`cache_salt`). So two servers of one model and layout name one prefix alike,
and two tenants, models or layouts never name a block alike. The prefix index's own keys are Python hashes, which differ from
process to process; these are BLAKE2b, which every process computes alike.

A server counts against its budget only the files it wrote, and deletes only
those (oldest written first): another server's files are never its to evict.
Files a server that is gone left behind are removed by age (`STALE_S`) by the
next server that starts on the directory."""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Hashable, Sequence

KEY_BYTES = 16  # 128 bits: no two prefixes of any fleet collide
STALE_S = 24 * 3600.0  # a file nobody rewrote or read for a day: a server that is gone left it


def chain_keys(token_ids: Sequence[int], block_size: int, num_blocks: int, salt: Hashable = None,
               namespace: str = "") -> list[str]:
    """The chain keys (hex) of the first `num_blocks` full blocks of `token_ids`
    under `salt`, in a directory of the model named by `namespace`."""
    if num_blocks * block_size > len(token_ids):
        raise ValueError(f"{num_blocks} blocks of {block_size} tokens need {num_blocks * block_size} tokens, "
                         f"got {len(token_ids)}")
    key = hashlib.blake2b(f"{namespace}\x00{salt!r}".encode(), digest_size=KEY_BYTES).digest()
    size = 4 * block_size
    data = struct.pack(f"<{num_blocks * block_size}i", *token_ids[:num_blocks * block_size])
    keys = []
    for i in range(num_blocks):
        key = hashlib.blake2b(key + data[i * size:(i + 1) * size], digest_size=KEY_BYTES).digest()
        keys.append(key.hex())
    return keys


class OwnedFiles:
    """The files this server wrote into the shared directory, oldest first,
    within a budget of `capacity` files."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the shared KV directory's budget must hold at least one file, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def add(self, key: str) -> list[str]:
        """`key`'s file was written by this server: the keys of its own files to
        delete now to stay within the budget (oldest first)."""
        self._keys[key] = None
        self._keys.move_to_end(key)
        out = []
        while len(self._keys) > self.capacity:
            old, _ = self._keys.popitem(last=False)
            out.append(old)
        self.num_evicted += len(out)
        return out

    def discard(self, key: str) -> None:
        """`key`'s file is gone (a failed write, or it was found damaged)."""
        self._keys.pop(key, None)
