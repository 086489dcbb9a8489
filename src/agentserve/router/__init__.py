"""Scale-out on Ray Serve (`agentserve cluster`): program-aware request routing over engine replicas.

The routing logic (replica_load.py, route_key.py, program_router.py, baselines.py) is pure
Python; the Ray plumbing (ray_router.py, replica.py, ingress.py, cluster_app.py) imports Ray,
an optional extra, and only `agentserve cluster` imports it. Nothing here imports torch at
module level."""
