"""agentserve's program scheduling inside vLLM: `vllm serve MODEL --scheduler-cls
agentserve.integrations.vllm.ProgramScheduler` (or `python -m
agentserve.integrations.vllm serve MODEL`, which checks the version first and
exports the plugin's metrics). `keeper.py` holds what the policy decides and
needs no vLLM; `scheduler.py` is the thin subclass of vLLM's scheduler that
calls it, imported only when `ProgramScheduler` is asked for."""

from __future__ import annotations

QUALNAME = "agentserve.integrations.vllm.ProgramScheduler"


def __getattr__(name: str):
    if name in ("ProgramScheduler", "AsyncProgramScheduler"):
        from agentserve.integrations.vllm import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
