"""Where the Ray runtime puts processes, and what happens when the cluster cannot hold them.

Every host asks for what its stage says (`pipeline.contracts.Placed`; one CPU and no GPU otherwise).
A request no node of the cluster could ever hold fails the run before anything starts; one the
cluster could hold but does not within `timeout_s` (other work holds the resources) fails it then.
Either way the error names the actor, what it asked for and what the cluster has, instead of a run
that waits forever for an actor Ray keeps pending.

A stage's helper processes (`Services.start_helpers`: a sharded learner's other ranks) are Ray actors
in one placement group, one bundle each, gang-placed: all of them, or an `ActorUnplaceable` error
after `timeout_s`. A helper is owned by the host that started it, so it ends with that host.

On a cluster of several nodes, `pipeline.placement.Placement` says which node a stage's processes go to: each role asks
for a share of custom resources that `ray start --resources` gave some nodes only (the config's
`[ray.resources]`; docs/guides/multi-node.md). Without it Ray picks the nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pipeline.contracts import Helper, Placed, Resources

PLACEMENT_TIMEOUT_S = 120.0


class ActorUnplaceable(RuntimeError):
    """The cluster cannot place an actor the run needs (named, with what it asked for)."""


@dataclass(frozen=True)
class Needs:
    """One process's request: the stage's CPUs and GPUs, and the custom resources its role asks for."""

    resources: Resources
    custom: dict[str, float] = field(default_factory=dict)


def resources_of(stage: Any, index: int) -> Resources:
    return stage.resources(index) if isinstance(stage, Placed) else Resources()


def host_options(needs: Needs) -> dict[str, Any]:
    return {"num_cpus": needs.resources.cpus, "num_gpus": needs.resources.gpus, "resources": needs.custom}


def _asked(needs: Needs) -> str:
    cpus, gpus = needs.resources.cpus, needs.resources.gpus
    return (f"{cpus:g} CPU" + (f" and {gpus:g} GPU" if gpus else "")
            + "".join(f" and {amount:g} {name}" for name, amount in needs.custom.items()))


def _holds(node: dict[str, float], needs: Needs) -> bool:
    asked = {"CPU": needs.resources.cpus, "GPU": needs.resources.gpus, **needs.custom}
    return all(node.get(name, 0) >= amount for name, amount in asked.items())


def _cluster() -> str:
    total, free = ray.cluster_resources(), ray.available_resources()
    return (f"the cluster has {total.get('CPU', 0):g} CPU and {total.get('GPU', 0):g} GPU, of which "
            f"{free.get('CPU', 0):g} CPU and {free.get('GPU', 0):g} GPU are free")


def check_feasible(requests: dict[str, Needs]) -> None:
    """Raise `ActorUnplaceable` for a request that no node of the cluster has the resources for."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    for name, needs in requests.items():
        if not any(_holds(n, needs) for n in nodes):
            raise ActorUnplaceable(
                f"actor {name} asks for {_asked(needs)} and no node of the cluster has that: {_cluster()}; give "
                "the cluster the resources (e.g. `ray start --head --num-cpus N --num-gpus M`, a node's custom "
                "resources by `ray start --resources`) or ask for fewer (engine.count, learner.world_size, the "
                "devices in the config, ray.resources)")


async def await_placed(started: dict[str, Awaitable[Any]], requests: dict[str, Needs],
                       timeout_s: float = PLACEMENT_TIMEOUT_S) -> list[Any]:
    """Await every host's first call (it runs once Ray placed the host); after `timeout_s`, fail naming the
    hosts still waiting for a place and what they asked for."""
    tasks = {name: asyncio.ensure_future(call) for name, call in started.items()}
    try:
        done, pending = await asyncio.wait(tasks.values(), timeout=timeout_s)
    except asyncio.CancelledError:  # e.g. the run ends while a joining host is placed: nothing left unawaited
        for task in tasks.values():
            task.cancel()
        raise
    if pending:
        for task in pending:
            task.cancel()
        waiting = [name for name, task in tasks.items() if task in pending]
        raise ActorUnplaceable(
            f"{', '.join(waiting)} not placed within {timeout_s:g} s (asking for "
            f"{'; '.join(f'{n}: {_asked(requests[n])}' for n in waiting)}); {_cluster()}; free resources on the "
            "cluster (other jobs hold them), give it more, or ask for fewer")
    return [task.result() for task in tasks.values()]


def adopt_node_address() -> str:
    """Set `BATON_HOST` in this Ray worker process to the address of the node it runs on (what Ray
    advertises for it, `ray start --node-ip-address`), and return it: the address this process's servers
    give their peers, whatever the environment it inherited from its raylet says."""
    os.environ["BATON_HOST"] = ray.util.get_node_ip_address()
    return os.environ["BATON_HOST"]


@contextlib.contextmanager
def driver_node_address() -> Iterator[str]:
    """`BATON_HOST` in the driver for one run (e.g. where the Mooncake master it starts listens): the user's if
    set, else the address of the node this driver joined; put back as it was when the run ends, so that an
    in-process run leaves no address to a later run in the same process (or to the processes it starts)."""
    before = os.environ.get("BATON_HOST")
    os.environ["BATON_HOST"] = before or ray.util.get_node_ip_address()
    try:
        yield os.environ["BATON_HOST"]
    finally:
        if before is None:
            os.environ.pop("BATON_HOST", None)


@ray.remote(num_cpus=0)
class HelperHost:
    """One helper process: runs `fn(*args)` until it returns (with `BATON_HOST` its node's address)."""

    def run(self, fn: Callable[..., None], args: tuple) -> None:
        adopt_node_address()
        fn(*args)


class ActorHelper:
    """A helper on Ray: its actor, the call that runs it (done: it ended) and the placement group it was
    placed in (removed on `stop`, so helpers started again, as a restarted learner group's, are placed)."""

    def __init__(self, name: str, actor: Any, call: Any, group: Any = None) -> None:
        self.name, self.actor, self.call, self.group = name, actor, call, group

    def exitcode(self) -> int | None:
        ready, _ = ray.wait([self.call], timeout=0)
        if not ready:
            return None
        try:
            ray.get(self.call)
            return 0
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
            return 1

    def stop(self, timeout_s: float) -> None:
        ray.wait([self.call], timeout=timeout_s)
        ray.kill(self.actor)
        if self.group is not None:
            with contextlib.suppress(Exception):  # its group's other helpers removed it already
                remove_placement_group(self.group)


def start_ray_helpers(name: str, fn: Callable[..., None], args: Sequence[tuple], resources: Resources,
                      timeout_s: float = PLACEMENT_TIMEOUT_S,
                      custom: Mapping[str, float] | None = None) -> list[Helper]:
    """One actor per args tuple, gang-placed in a placement group of one bundle each (see the module
    docstring), each bundle with `custom` resources too (`pipeline.placement.Placement`: the nodes they go to);
    `ActorUnplaceable` when the group is not placed within `timeout_s`."""
    custom = dict(custom or {})
    bundle = {"CPU": resources.cpus, **({"GPU": resources.gpus} if resources.gpus else {}), **custom}
    group = placement_group([bundle] * len(args), strategy="PACK", name=f"{name}-group")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise ActorUnplaceable(f"{name}: {len(args)} helper processes of {_asked(Needs(resources, custom))} each "
                               f"not placed within {timeout_s:g} s; {_cluster()}")
    helpers: list[Helper] = []
    for i, arguments in enumerate(args):
        strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i)
        actor = HelperHost.options(num_cpus=resources.cpus, num_gpus=resources.gpus, resources=custom,
                                   scheduling_strategy=strategy, name=None).remote()
        helpers.append(ActorHelper(f"{name}-{i}", actor, actor.run.remote(fn, arguments), group))
    return helpers
