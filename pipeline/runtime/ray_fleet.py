"""An elastic run on Ray: the fleet's workers (`pipeline.fleet`) are producer hosts, each a `StageHost` actor.

The fleet itself, its control endpoint (`pipeline.control`) and the `engine.join` / `engine.leave` faults run
in the driver, as on the local runtime; only how a worker starts and stops differs (`RayLauncher`, the
fleet's `WorkerLauncher`). The invariants:
* a joining worker is a new `StageHost` placed on the cluster (a CPU, and the GPUs its engine needs, like
  the run's first engine's), set up with `Scalable.join`; the learner subscribes it to the pushes (the
  consumer's host hears `producer_joined`) before its `start` runs the version fence, so no version
  published while the fence reads the clock passes it by; only then does the fleet let it ask for work;
* a leaving worker drains in its host (`Retiring.retire`), is unsubscribed, then stopped and killed;
* a joined host is not restarted by Ray: its death fails the run, naming it (the first hosts are
  restarted as before, `pipeline.runtime.ray_supervision`);
* a preempted leave tells the leaving host which other producer hosts are live: its requests in flight
  continue on their engines from the tokens they have (`stages.rollout.relay_remote`, through each
  host's `relay` mailbox), as a local relay continues them on the engines of its own process.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import anyio
import ray

from pipeline.runtime.ray_placement import Needs, await_placed, host_options, resources_of

STOP_S = 15.0  # a leaving host's stop waits this long (its own run unwinds in RUN_UNWIND_S)


@dataclass
class RayLauncher:
    """The Ray runtime's `WorkerLauncher` (see the module docstring). `hosts` is the run's (`RayRun._hosts`):
    a joiner is added as it is created, so the run's end stops and kills it whatever happened."""

    stage: Any  # the producer stage (Scalable)
    wiring: Any  # pipeline.runtime.ray.Wiring
    peers: dict[str, list[Any]]
    hosts: dict[str, Any]
    tag: str  # the hosts' name prefix, baton/<run>/<folder>
    host_class: Any  # pipeline.runtime.ray.StageHost (passed in: this module is imported by it)
    placement_timeout_s: float
    custom: dict[str, float]  # the engine role's custom resources ([ray.resources] engine): the nodes joiners go to

    def join(self, index: int) -> RayWorker:
        return RayWorker(f"producer-{index}", index, self)


    def first_workers(self, names: list[str]) -> list[RayWorker]:
        """The run's first producer hosts (already set up and started) as fleet workers; `names`: their actors'."""
        workers = []
        for index, name in enumerate(names):
            worker = RayWorker(f"producer-{index}", index, self, host=self.hosts[f"producer-{index}"])
            worker.name = name
            workers.append(worker)
        return workers


@dataclass(eq=False)
class RayWorker:
    """One producer host as the fleet sees it (an `Actor` and `Retiring`): `start` creates and fences a joiner."""

    host_name: str
    index: int
    launcher: RayLauncher
    host: Any = None
    name: str = field(default="")  # its actor's name once set up (rollout:<engine>); before: the host's

    def __post_init__(self) -> None:
        self.name = self.name or self.host_name

    async def start(self) -> None:
        launcher = self.launcher
        # like the first engines': the stage's CPUs and GPUs, on the nodes the engine role is placed on
        needs = Needs(resources_of(launcher.stage, self.index % launcher.stage.workers), launcher.custom)
        self.host = launcher.host_class.options(name=f"{launcher.tag}/{self.host_name}",
                                                **host_options(needs)).remote(launcher.stage, "producer",
                                                                              self.index, launcher.wiring)
        launcher.hosts[self.host_name] = self.host
        (self.name,) = await await_placed({self.host_name: self.host.setup.remote(launcher.peers, True)},
                                          {self.host_name: needs}, launcher.placement_timeout_s)
        # subscribed before its fence reads the clock: no version goes out unseen between the two
        await launcher.hosts["consumer-0"].producer_joined.remote(self.host_name, self.host)
        await self.host.start.remote()  # the engine starts and passes the version fence

    async def run(self) -> None:
        host = self.host
        try:
            await host.run.remote()
        except ray.exceptions.RayActorError:
            if self.host is not None:  # it died: not a leave the fleet asked for (`stop` lets go of it first)
                raise

    async def retire(self, preempt: bool = False) -> None:
        """Drain in the host; a preempted one's requests continue on the other producer hosts live now."""
        others = {n: h for n, h in self.launcher.hosts.items() if n.startswith("producer-") and n != self.host_name}
        await self.host.retire.remote(preempt, others)

    async def stop(self) -> None:
        """Unsubscribe it, stop its actor (its engine) and kill its host; once (a second stop does nothing)."""
        host, self.host = self.host, None
        if host is None:
            return
        consumer = self.launcher.hosts.get("consumer-0")
        with contextlib.suppress(Exception):  # noqa: BLE001 - a host that died, or never set up: it is killed next
            if consumer is not None:
                await consumer.producer_left.remote(self.host_name)
            with anyio.move_on_after(STOP_S):
                await host.stop.remote()
        ray.kill(host)
        self.launcher.hosts.pop(self.host_name, None)


__all__ = ["RayLauncher", "RayWorker"]
