"""The policies by name: `make_policy(name, ctx)` and `policy_names()`.
Importing `policy.policies` registers every policy (each class is decorated
with `base.register`); this module is the one place that both imports them and
reads the registry, so `base.py` never imports the policies that import it."""

from __future__ import annotations

import inspect

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


def parse_policy_spec(spec: str) -> tuple[str, dict]:
    """`name` or `name:option=value:...` (e.g. `agentserve:pressure=off:eta=1`, an
    ablation) -> (name, options). Values are read as numbers, on/off/true/false
    or none where they look like one, else kept as text. ValueError names what
    is wrong: an unknown policy, an option without `=` or one the policy does not
    take, or a value the policy refuses."""
    name, *parts = spec.split(":")
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(policy_names())}")
    options = {}
    for part in parts:
        key, eq, text = part.partition("=")
        if not eq or not key:
            raise ValueError(f"policy option {part!r} in {spec!r} is not key=value")
        options[key.replace("-", "_")] = _option_value(text)
    accepted = _options_of(POLICIES[name])
    for key in options:
        if key not in accepted:
            raise ValueError(f"policy {name!r} has no option {key!r}"
                             + (f"; it takes {', '.join(sorted(accepted))}" if accepted else "; it takes none"))
    try:  # the values: a policy checks its own, so build one on a blank context
        make_policy(name, PolicyContext(reload_cost=lambda n: 0.0), **options)
    except (ValueError, TypeError) as e:
        raise ValueError(f"policy {spec!r}: {e}") from None
    return name, options


def _options_of(cls: type[Policy]) -> set[str]:
    """The keyword options a policy's constructor takes, up its class chain
    (a subclass passing **options on to its parent takes the parent's too)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters
        names |= {n for n, p in params.items() if n not in ("self", "ctx") and p.kind is p.POSITIONAL_OR_KEYWORD
                  or p.kind is p.KEYWORD_ONLY}
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            break
    return names


def _option_value(text: str):
    low = text.lower()
    if low in ("on", "true", "yes"):
        return True
    if low in ("off", "false", "no"):
        return False
    if low == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
