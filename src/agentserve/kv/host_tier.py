"""The host-memory tier: a second, larger pool of block slots in DRAM.

Device blocks evicted from the prefix cache are copied here (write-back on
eviction, as LMCache-style offloading does), and a later prefix match that runs
past the device-resident part reloads them instead of recomputing. The tier
only keeps the accounting; the executor performs the copies it is handed.

Its slots follow kv/slot_tier.py: pending until the executor confirms a copy,
given back when a copy fails; an evicted confirmed copy is offered to the disk
tier (`on_evict`) when there is one."""

from __future__ import annotations

from agentserve.kv.slot_tier import SlotTier


class HostTier(SlotTier):
    name = "host"
    slot_attr = "host_slot"
