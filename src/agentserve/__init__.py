"""agentserve: an LLM inference server for agent workloads."""

__version__ = "0.1.0"
