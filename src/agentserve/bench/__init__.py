"""Measuring servers from outside: the replay client for agent workloads, the peers
(vLLM, llama.cpp) started side by side, reports and plots, and the measurement commands
of `agentserve bench`. It never imports torch; it talks to servers over HTTP, runs the
simulator, and drives the offline `LLM` inside functions only."""
