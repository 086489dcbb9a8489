"""Measuring servers from outside, what `agentserve bench` runs: the replay
client for agent workloads (`run`), its reports (`report`), the peers (vLLM,
llama.cpp, agentserve under other policies) started side by side (`compare`).
It never imports torch: it talks to servers over HTTP and may import the
layers below it, never the entry points. The research measurements, the API
fuzzer and the eviction analysis live outside the package, in benchmarks/."""
