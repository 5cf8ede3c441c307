"""Which nodes of a Ray cluster each role's processes go to (`[ray.resources]`), checked without Ray.

A node started with `ray start --resources='{"node_b": 1}'` holds one unit of `node_b`; a role that asks
for a share of it (0.01: a hundred processes fit) runs only on that node. The Ray runtime adds a role's
share to each of its processes' requests (`pipeline.runtime.ray_placement`); docs/guides/multi-node.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

PLACED_ROLES = ("engine", "buffer", "learner", "learner_ranks")  # the roles `Placement` can send to nodes
ROLE_OF_HOST = {"producer": "engine", "buffer": "buffer", "consumer": "learner"}


@dataclass(frozen=True)
class Placement:
    """Custom Ray resources each role's processes ask for, {role: {resource: amount}} (roles: `PLACED_ROLES`;
    a learner's other ranks are "learner_ranks"). A role not named asks for none."""

    custom: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for role, asks in self.custom.items():
            if role not in PLACED_ROLES:
                raise ValueError(f"ray.resources.{role}: not a role; use one of {', '.join(PLACED_ROLES)}")
            for name, amount in asks.items():
                if name in ("CPU", "GPU", "memory", "object_store_memory") or amount <= 0:
                    raise ValueError(f"ray.resources.{role}.{name} = {amount}: give a custom resource a node was "
                                     "started with (`ray start --resources`) and an amount > 0 (e.g. 0.01, so "
                                     "many processes fit on that node); CPUs and GPUs come from the stage")

    def of(self, role: str) -> dict[str, float]:
        return dict(self.custom.get(role, {}))


__all__ = ["PLACED_ROLES", "ROLE_OF_HOST", "Placement"]
