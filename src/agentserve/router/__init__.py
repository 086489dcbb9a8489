"""Scale-out: routing requests over several agentserve replicas (docs/architecture.md, "Layers").

The pure-Python routing logic lives here (no torch, no Ray, no wall clock): what a
replica reports (`replica_load`), what a request is routed by (`route_key`), the
program-aware router and its baselines, and the simulated cluster. The Ray Serve
plumbing of `agentserve cluster` (ray_router.py, replica.py, asgi_bridge.py,
ingress.py, metrics_merge.py, cluster_app.py) imports Ray, an optional extra, and only
that command imports it; it calls the logic through `registry.make_router` and the
router interface (`rank`, `routed`, `replica_gone`, `counters`)."""
