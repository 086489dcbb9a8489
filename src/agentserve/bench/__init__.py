"""Measuring servers from outside, what `agentserve bench` runs: the replay
client for agent workloads (`run`), its reports (`report`), the peers (vLLM,
llama.cpp, agentserve under other policies) started side by side (`compare`),
the eviction analysis through the KV manager alone (`apc`). It never imports
torch: it talks to servers over HTTP and may import the layers below it, never
the entry points. The research measurements and the API fuzzer live outside
the package, in benchmarks/."""
