"""Scale-out: routing requests over several agentserve replicas (DESIGN.md, `router/`).

The pure-Python routing logic lives here (no torch, no Ray, no wall clock): what a
replica reports (`replica_load`), what a request is routed by (`route_key`), the
program-aware router and its baselines, and the simulated cluster."""
