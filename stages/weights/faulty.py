"""The weight-push boundary's fault hook: `FaultyTransport` wraps the learner's transport when a run
plans `weights.push_fail` (otherwise the learner uses the transport itself).

At each scheduled occurrence (counted per `publish` attempt) the push is refused with
`InjectedPushError`, a `WeightPushError`, before the transport sends anything, so no receiver holds
part of the version. `publish` retries a refused push (`retries` more attempts, tenacity) and then
raises the `WeightPushError`: a push that did not reach every receiver is never reported as done.
"""

from __future__ import annotations

from typing import Any

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


def with_weight_faults(transport: Any, plan: FaultPlan | None, retries: int = 2) -> Any:
    """`transport` wrapped in a FaultyTransport when `plan` has weights.push_fail, else itself."""
    schedule = plan.schedule("weights.push_fail") if plan is not None else None
    return transport if schedule is None else FaultyTransport(transport, schedule, retries)


__all__ = ["FaultyTransport", "InjectedPushError", "with_weight_faults"]
