"""agentserve: an LLM inference server for agent workloads."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # lazy: the simulator and the pure layers must not pull in torch
    if name == "LLM":
        from agentserve.llm import LLM
        return LLM
    if name == "SamplingParams":
        from agentserve.engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'agentserve' has no attribute {name!r}")
