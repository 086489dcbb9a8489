"""Agent workloads: generators matching the papers' statistics and loaders for the
recorded Claude Code and SWE-smith traces, feeding the simulator and the replay client.
No torch."""
