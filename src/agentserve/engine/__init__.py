"""The step loop: requests, the scheduler (token budget, chunked prefill, admission,
preemption, speculation's plan), its output, and the `Executor` interface a step runs on
(the runner's real one or the simulator's). It imports `policy/` and `kv/`, never torch."""
