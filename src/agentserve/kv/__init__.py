"""The KV manager's bookkeeping: the block pool, block tables, the prefix index over
hash-chained, token-verified blocks, pins and their leases, eviction strategies, the
protected zone, and the host and disk tiers' slots and copy plans. It holds no tensor:
it imports nothing of agentserve but the clock, and never torch."""
