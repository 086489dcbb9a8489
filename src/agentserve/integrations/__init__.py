"""agentserve's policy inside other engines. Each engine has its own subpackage,
which alone imports that engine (and only where it is installed); what it runs of
agentserve is the policy layer (policy/) and the clock, through an adapter kept
free of the engine so that it is tested without it."""
