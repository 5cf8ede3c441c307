"""Where the Ray runtime puts processes, and what happens when the cluster cannot hold them.

Every host asks for what its stage says (`pipeline.contracts.Placed`; one CPU and no GPU otherwise).
A request no node of the cluster could ever hold fails the run before anything starts; one the
cluster could hold but does not within `timeout_s` (other work holds the resources) fails it then.
Either way the error names the actor, what it asked for and what the cluster has, instead of a run
that waits forever for an actor Ray keeps pending.

A stage's helper processes (`Services.start_helpers`: a sharded learner's other ranks) are Ray actors
in one placement group, one bundle each, gang-placed: all of them, or an `ActorUnplaceable` error
after `timeout_s`. A helper is owned by the host that started it, so it ends with that host.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pipeline.contracts import Helper, Placed, Resources

PLACEMENT_TIMEOUT_S = 120.0


class ActorUnplaceable(RuntimeError):
    """The cluster cannot place an actor the run needs (named, with what it asked for)."""


def resources_of(stage: Any, index: int) -> Resources:
    return stage.resources(index) if isinstance(stage, Placed) else Resources()


def host_options(needs: Resources) -> dict[str, float]:
    return {"num_cpus": needs.cpus, "num_gpus": needs.gpus}


def _asked(needs: Resources) -> str:
    return f"{needs.cpus:g} CPU" + (f" and {needs.gpus:g} GPU" if needs.gpus else "")


def _cluster() -> str:
    total, free = ray.cluster_resources(), ray.available_resources()
    return (f"the cluster has {total.get('CPU', 0):g} CPU and {total.get('GPU', 0):g} GPU, of which "
            f"{free.get('CPU', 0):g} CPU and {free.get('GPU', 0):g} GPU are free")


def check_feasible(requests: dict[str, Resources]) -> None:
    """Raise `ActorUnplaceable` for a request that no node of the cluster has the resources for."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    for name, needs in requests.items():
        if not any(n.get("CPU", 0) >= needs.cpus and n.get("GPU", 0) >= needs.gpus for n in nodes):
            raise ActorUnplaceable(
                f"actor {name} asks for {_asked(needs)} and no node of the cluster has that: {_cluster()}; give "
                "the cluster the resources (e.g. `ray start --head --num-cpus N --num-gpus M`) or ask for fewer "
                "(engine.count, learner.world_size, the devices in the config)")


async def await_placed(started: dict[str, Awaitable[Any]], requests: dict[str, Resources],
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


@ray.remote(num_cpus=0)
class HelperHost:
    """One helper process: runs `fn(*args)` until it returns."""

    def run(self, fn: Callable[..., None], args: tuple) -> None:
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
                      timeout_s: float = PLACEMENT_TIMEOUT_S) -> list[Helper]:
    """One actor per args tuple, gang-placed in a placement group of one bundle each (see the module
    docstring); `ActorUnplaceable` when the group is not placed within `timeout_s`."""
    bundle = {"CPU": resources.cpus, **({"GPU": resources.gpus} if resources.gpus else {})}
    group = placement_group([bundle] * len(args), strategy="PACK", name=f"{name}-group")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise ActorUnplaceable(f"{name}: {len(args)} helper processes of {_asked(resources)} each not placed "
                               f"within {timeout_s:g} s; {_cluster()}")
    helpers: list[Helper] = []
    for i, arguments in enumerate(args):
        strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i)
        actor = HelperHost.options(num_cpus=resources.cpus, num_gpus=resources.gpus, scheduling_strategy=strategy,
                                   name=None).remote()
        helpers.append(ActorHelper(f"{name}-{i}", actor, actor.run.remote(fn, arguments), group))
    return helpers
