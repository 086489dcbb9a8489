"""agentserve's measurements beyond what a user runs against a server: the
runner's speed and its sweeps against context and peers, the paper's agent
workloads with the fast path, grouped prefill on a burst, the scheduler's own
time a step, tool-call early stop, render cost, host-tier copies, time to first
token per turn, a long soak, clusters by router beside one server, a cluster
replica killed mid-run, a server restarted mid-replay (with and without its
learned state), the API fuzzer, the eviction strategies' prefix-cache hit
ratios through the KV manager alone.
Each is a command: `python -m benchmarks NAME [args]` (`--help` lists them),
or `python -m benchmarks.MODULE [args]`; run from the repository root.

They use agentserve from outside: agentserve.bench (the replay client, the peer
servers and their loop), the simulator, the server's parts and the offline
`LLM` (inside functions, so that importing a benchmark never imports torch).
Nothing in agentserve imports them. The peers' installers are in peers/."""

# name: (module, what it measures). The modules are imported only when run.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "agentic": ("agentic", "the stateful-inference paper's agent workloads against agentserve and its peers"),
    "burst": ("burst_prefill", "a burst of agents sharing a long preamble, grouped prefill off and on"),
    "sched": ("sched_overhead", "the scheduler's own time a step with many running requests and pins"),
    "soak": ("soak", "misbehaving agent programs for a long time: leaks, lost responses, RSS"),
    "runner-speed": ("runner_speed", "the runner's prefill and decode tokens/s; --sweep: against context and peers"),
    "toolcall-early-stop": ("toolcall_early_stop", "tokens the tool-call early stop saves on the agent workloads"),
    "render-cost": ("render_cost", "CPU time to turn a chat request into token ids, render cache off and on"),
    "tier-copy-speed": ("tier_copy_speed", "host-tier copy bandwidth through the runner's own copies"),
    "turn-ttft": ("turn_ttft", "time to first token per turn of one program against a running server"),
    "cluster-compare": ("cluster_compare", "`bench compare` with `agentserve cluster` servers, by router, beside the rest"),
    "cluster-failover": ("cluster_failover", "one replica of `agentserve cluster` killed mid-replay: what agents saw"),
    "restart-replay": ("restart_replay", "`bench compare` with servers restarted mid-replay, learned state kept or not"),
    "kv-footprint": ("kv_footprint", "KV a long conversation holds between turns, full against hybrid cache"),
    "peers": ("peer_servers", "the peer servers: list them, or start each, send one chat, stop it"),
    "fuzz-api": ("fuzz_api", "schemathesis against a live server from its OpenAPI document: no 5xx, as documented"),
    "apc": ("apc_cli", "prefix-cache hit ratio per eviction strategy, a workload through the KV manager alone"),
}
