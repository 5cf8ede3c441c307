"""The weight-push boundary's fault hooks: `FaultyTransport` wraps the learner's transport when a run
plans `weights.push_fail`, `JoinInPush` when it plans `engine.join_in_push`, `PreemptInPush` when it
plans `engine.preempt_in_push` (otherwise the learner uses the transport itself).

engine.join_in_push: at each scheduled version the publish asks the run's fleet for one more worker and
goes on only once the joining engine is subscribed, so the version goes out while the joiner's fence is
under way (`stages.rollout.fence` must neither miss the version nor take it for a mismatch).

engine.preempt_in_push: at each scheduled version the publish starts, and while it goes out the run's fleet
is asked for one worker fewer with `preempt` (a node taken away mid-push: the newest engine's requests stop
at once and continue on the others, `stages.rollout.relay`). The firing recovers once the version is
delivered; the leave's own event (`engine.left`) counts the requests carried over and the tokens kept and
lost, and the ledger must stay clean (nothing trained twice, nothing lost uncounted, none over the bound).

At each scheduled occurrence (counted per `publish` attempt) the push is refused with
`InjectedPushError`, a `WeightPushError`, before the transport sends anything, so no receiver holds
part of the version. `publish` retries a refused push (`retries` more attempts, tenacity) and then
raises the `WeightPushError`: a push that did not reach every receiver is never reported as done.
"""

from __future__ import annotations

from typing import Any

import anyio
import torch
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from pipeline.faults import FaultPlan, InjectedFault, Schedule
from pipeline.telemetry import get_logger
from stages.weights.base import WeightPushError, WeightTransport


class InjectedPushError(WeightPushError, InjectedFault):
    kind = "weights.push_fail"


class FaultyTransport:
    """`transport` with weights.push_fail in `publish`; the rest of `WeightTransport` is the transport's."""

    def __init__(self, transport: WeightTransport, schedule: Schedule, retries: int = 2) -> None:
        self.transport, self.schedule, self.retries = transport, schedule, retries
        self.log = get_logger("faults").bind(boundary="weights", transport=transport.name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)

    async def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        async for attempt in AsyncRetrying(
            stop=stop_after_attempt(self.retries + 1),
            wait=wait_exponential(multiplier=0.05, max=1.0),
            retry=retry_if_exception_type(WeightPushError),
            before_sleep=lambda state: self.log.warning(
                "weight push refused; retrying", version=version, error=str(state.outcome.exception())
            ),
            reraise=True,
        ):
            with attempt:
                if self.schedule.hit():
                    raise InjectedPushError(f"injected fault weights.push_fail: version {version} was refused")
                await self.transport.publish(version, tensors)
        self.schedule.recovered(f"version {version} delivered")


class JoinInPush:
    """`transport` whose scheduled publishes start with a join (see the module docstring)."""

    def __init__(self, transport: WeightTransport, schedule: Schedule, fleet: Any, receivers: Any,
                 subscribed_s: float = 60.0) -> None:
        self.transport, self.schedule, self.fleet, self.receivers = transport, schedule, fleet, receivers
        self.subscribed_s = subscribed_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)

    async def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        fired = self.schedule.hit(occurrence=version)
        if fired:
            before = {id(r) for r in self.receivers}  # by identity: a leave settling meanwhile changes the count
            await self.fleet.scale(min(self.fleet.max_workers, self.fleet.target + 1))
            with anyio.move_on_after(self.subscribed_s):
                while all(id(r) in before for r in self.receivers):
                    await anyio.sleep(0.002)
        await self.transport.publish(version, tensors)
        if fired:
            self.schedule.recovered(f"version {version} delivered to {len(self.receivers)} engines")


class PreemptInPush:
    """`transport` whose scheduled publishes go out while the fleet preempts a worker (see the module docstring)."""

    def __init__(self, transport: WeightTransport, schedule: Schedule, fleet: Any) -> None:
        self.transport, self.schedule, self.fleet = transport, schedule, fleet

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)

    async def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        if not self.schedule.hit(occurrence=version):
            await self.transport.publish(version, tensors)
            return
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.transport.publish, version, tensors)
            await anyio.sleep(0)  # the push is under way: the preempted leave lands while it goes out
            status = await self.fleet.scale(max(1, self.fleet.target - 1), preempt=True)
        self.schedule.recovered(f"version {version} delivered while a worker was preempted "
                                f"({status['leaving']} leaving, {status['live']} live)")


def with_weight_faults(transport: Any, plan: FaultPlan | None, retries: int = 2, services: Any = None) -> Any:
    """`transport` wrapped in a FaultyTransport when `plan` has weights.push_fail, and in a JoinInPush when it
    has engine.join_in_push, and in a PreemptInPush when it has engine.preempt_in_push (each where the run has a
    fleet, in `services`); else itself."""
    schedule = plan.schedule("weights.push_fail") if plan is not None else None
    if schedule is not None:
        transport = FaultyTransport(transport, schedule, retries)
    joins = plan.schedule("engine.join_in_push") if plan is not None else None
    fleet = getattr(services, "fleet", None)
    if joins is not None and fleet is not None:
        transport = JoinInPush(transport, joins, fleet, services.weight_receivers)
    preempts = plan.schedule("engine.preempt_in_push") if plan is not None else None
    if preempts is not None and fleet is not None:
        transport = PreemptInPush(transport, preempts, fleet)
    return transport


__all__ = ["FaultyTransport", "InjectedPushError", "JoinInPush", "PreemptInPush", "with_weight_faults"]
