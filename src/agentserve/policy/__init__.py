"""What the scheduler decides with: programs and their table, tool-call parsing and the
streaming validator, tool-duration statistics, the TTL model, KV pressure, and the
scheduling policies (one class each, registered in `registry`). It imports `kv/` and
the clock only, never torch."""
