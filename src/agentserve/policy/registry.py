"""The policies by name: `make_policy(name, ctx)` and `policy_names()`.
Importing `policy.policies` registers every policy (each class is decorated
with `base.register`); this module is the one place that both imports them and
reads the registry, so `base.py` never imports the policies that import it."""

from __future__ import annotations

from agentserve.policy import policies
from agentserve.policy.base import POLICIES, Policy, PolicyContext


def make_policy(name: str, ctx: PolicyContext, **options) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(sorted(POLICIES))}") from None
    return cls(ctx, **options)


def policy_names() -> list[str]:
    """The registered policies, in the order tables list them (policies.ORDER), then any others."""
    order = policies.ORDER
    return [n for n in order if n in POLICIES] + [n for n in POLICIES if n not in order]
