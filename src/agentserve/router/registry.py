"""The routers by name (`--router program|pow2|prefix|round-robin`): `make_router`."""

from __future__ import annotations

from typing import Any

from agentserve.router.baselines import PowerOfTwoRouter, PrefixAffinityRouter, RoundRobinRouter
from agentserve.router.program_router import ProgramRouter, RouterConfig

ROUTERS: dict[str, type] = {
    "program": ProgramRouter,
    "pow2": PowerOfTwoRouter,
    "prefix": PrefixAffinityRouter,
    "round-robin": RoundRobinRouter,
}


def router_names() -> list[str]:
    return list(ROUTERS)


def make_router(name: str, seed: int = 0, config: RouterConfig | None = None) -> Any:
    """A fresh router; `seed` for the randomized ones, `config` for the program router."""
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}: choose from {', '.join(ROUTERS)}")
    if name == "program":
        return ProgramRouter(config)
    if name == "pow2":
        return PowerOfTwoRouter(seed)
    return ROUTERS[name]()
