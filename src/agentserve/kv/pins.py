"""Pins: a finished turn's blocks held for its program across a tool call,
until released, expired or reclaimed (the KV manager holds and releases the
blocks; the scheduler and its policy decide when).

`PinTable` is the programs' pins by program id, with their expiries kept in a
heap, so a step finds the expired ones without scanning every pin."""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from agentserve.kv.block import Block


@dataclass
class Pin:
    program_id: str
    blocks: list[Block]
    expiry: float
    program_arrival: float
    num_tokens: int
    window: list[Block] = field(default_factory=list)  # blocks whose window parts it holds (hybrid cache)


class PinTable(Mapping[str, Pin]):
    def __init__(self) -> None:
        self._pins: dict[str, Pin] = {}
        # (expiry, n, pin) for every expiry a pin was given; entries of released or extended pins are skipped
        self._expiries: list[tuple[float, int, Pin]] = []
        self._numbers = itertools.count()

    def __getitem__(self, program_id: str) -> Pin:
        return self._pins[program_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._pins)

    def __len__(self) -> int:
        return len(self._pins)

    def add(self, program_id: str, blocks: list[Block], expiry: float, program_arrival: float,
            num_tokens: int, window: list[Block] | None = None) -> None:
        """Pin `blocks` (and the window parts of `window`) for the program; a
        program already pinned (a second finished request of it) gets them added
        to its one pin, which lasts the longer."""
        old = self._pins.get(program_id)
        if old is not None:
            old.blocks.extend(blocks)
            old.window.extend(window or ())
            old.num_tokens = max(old.num_tokens, num_tokens)
            if expiry <= old.expiry:
                return
            old.expiry = expiry
            pin = old
        else:
            pin = self._pins[program_id] = Pin(program_id, blocks, expiry, program_arrival, num_tokens,
                                               list(window or ()))
        heapq.heappush(self._expiries, (expiry, next(self._numbers), pin))

    def pop(self, program_id: str) -> Pin | None:
        return self._pins.pop(program_id, None)

    def _valid(self, entry: tuple[float, int, Pin]) -> bool:
        pin = entry[2]
        return self._pins.get(pin.program_id) is pin and pin.expiry == entry[0]

    def expired(self, now: float) -> list[str]:
        """The programs whose pin expired by `now`, each named once, in expiry
        order. A caller that keeps such a pin anyway gets it named no more."""
        out = []
        h = self._expiries
        while h and h[0][0] <= now:
            entry = heapq.heappop(h)
            if self._valid(entry):
                out.append(entry[2].program_id)
        return out

    def next_expiry(self) -> float | None:
        """The earliest expiry of a pin not yet named by `expired` (None: none)."""
        h = self._expiries
        while h and not self._valid(h[0]):
            heapq.heappop(h)
        return h[0][0] if h else None

    @property
    def num_blocks(self) -> int:
        """Distinct blocks held by pins (a block two pins share, or one pin holds
        twice, counts once)."""
        return len({b.block_id for p in self._pins.values() for b in p.blocks})

    def reclaimable(self, program_id: str, blocks: list[Block]) -> int:
        """Blocks that unpinning `program_id` would return to the free set (`blocks`:
        the pool's blocks by id)."""
        p = self._pins.get(program_id)
        if p is None:
            return 0
        c = Counter(b.block_id for b in p.blocks)
        n = sum(1 for bid, k in c.items() if blocks[bid].ref_cnt == k)
        if p.window:
            w = Counter(b.block_id for b in p.window)
            n += sum(len(blocks[bid].wpart) for bid, k in w.items() if blocks[bid].wrefs == k)
        return n
