"""The scheduling policies; importing this package registers them all."""

from agentserve.policy.policies import (  # noqa: F401
    agentserve,
    autellix,
    continuum,
    infercept,
    program_fcfs,
    static_ttl,
    vllm_fcfs,
)

# How tables list them: the baseline, the paper's ablation steps, then the other papers.
ORDER = ["vllm-fcfs", "program-fcfs", "static-ttl", "continuum", "autellix", "infercept", "agentserve"]
