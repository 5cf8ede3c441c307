"""The engine boundary's fault hooks: `FaultyEngine` wraps an engine's `generate` when a run plans
`engine.crash` or `engine.hang` (otherwise the rollout stage uses the engine itself).

* `engine.crash`: the engine generates, then dies before answering, so the whole call's work is
  lost. Where every actor has its own process (Ray) the producer process is SIGKILLed (the runtime
  restarts it and frees the slots of the groups it had in flight); in one process the call raises
  `EngineCrashed` and the rollout worker generates those groups again.
* `engine.hang`: the engine answers no call (an unresponsive server) until a caller gives up on one
  (the rollout's `request_timeout_s` turns it into `EngineTimeout` and runs those episodes again) or
  `delay_s` passes; the calls it held then go on.

The schedule counts `generate` calls per engine (scope = the engine's name). A crash is recorded as
recovered at the engine's next call that answers; a hang at the first answer to a call made after
the hung call was given up (other calls run on meanwhile: episodes have no batch barrier).

The faults on an engine's own inference server (`engine.server_kill`, `engine.server_kill_push`,
`engine.push_refused`: a SIGKILL by pid mid-generate or mid-push, a damaged version) are
`stages.engines.faulty_server`'s, applied here around `generate` and `receive_weights`.
"""

from __future__ import annotations

import math
import os
import signal

import anyio

from pipeline.faults import FaultPlan, InjectedFault
from pipeline.telemetry import get_logger
from stages.engines.base import Completion, Engine, EngineError, EngineRun, SamplingParams, returns_routed_experts
from stages.engines.faulty_server import server_faults


class EngineCrashed(EngineError, InjectedFault):
    """The engine died during the call (injected engine.crash); nothing it generated came back."""

    kind = "engine.crash"


class EngineTimeout(EngineError):
    """The engine did not answer within the rollout's `request_timeout_s`."""


class FaultyEngine:
    """`engine` with the plan's engine faults in `generate`; every other member of `Engine` is the engine's."""

    def __init__(self, engine: Engine, plan: FaultPlan) -> None:
        self.engine = engine
        self._crash = plan.schedule("engine.crash", engine.name)
        self._hang = plan.schedule("engine.hang", engine.name)
        self._hang_abandoned_at = 0.0
        self._hung: anyio.Event | None = None  # set while the engine hangs
        self._kill_process = plan.isolated
        self._server_faults = server_faults(engine, plan)
        self.log = get_logger("faults").bind(boundary="engine", engine=engine.name)

    async def _hang_up(self, hung: anyio.Event) -> None:
        """Answer nothing until a caller gives up on a hung call (its request timeout) or `delay_s` passes;
        the first caller to give up clears the hang for every call."""
        try:
            with anyio.move_on_after(self._hang.spec.delay_s):
                await hung.wait()
        except anyio.get_cancelled_exc_class():
            if self._hung is hung:
                self._hang_abandoned_at, self._hung = anyio.current_time(), None
                hung.set()
            raise

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def stats(self) -> dict[str, float]:
        return self.engine.stats

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def load(self) -> int:
        return self.engine.load

    @property
    def returns_routed_experts(self) -> bool:
        """The wrapped engine's answer (`stages.engines.base.returns_routed_experts`)."""
        return returns_routed_experts(self.engine)

    def attach(self, run: EngineRun) -> None:
        self.engine.attach(run)

    async def start(self) -> None:
        await self.engine.start()

    async def stop(self) -> None:
        await self.engine.stop()

    async def receive_weights(self, version: int, tensors: dict) -> None:
        if self._server_faults is None:
            await self.engine.receive_weights(version, tensors)
        else:
            await self._server_faults.receive_weights(lambda: self.engine.receive_weights(version, tensors), version)

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if self._server_faults is not None:
            return await self._server_faults.generate(lambda: self._generate(prompts, params))
        return await self._generate(prompts, params)

    async def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        started = anyio.current_time()
        if self._hang is not None and self._hang.hit():
            self.log.warning("injected fault: engine hangs", seconds=self._hang.spec.delay_s)
            self._hang_abandoned_at, self._hung = math.inf, anyio.Event()
        if self._hung is not None:
            await self._hang_up(self._hung)
        completions = await self.engine.generate(prompts, params)
        if self._crash is not None and self._crash.hit():
            if self._kill_process:
                self.log.warning("injected fault: killing the engine's process", pid=os.getpid())
                os.kill(os.getpid(), signal.SIGKILL)
            raise EngineCrashed(f"injected fault engine.crash: engine {self.name} died during a call of "
                                f"{len(prompts)} requests")
        if self._crash is not None:
            self._crash.recovered(f"engine {self.name} answered")
        if self._hang is not None and started >= self._hang_abandoned_at:
            self._hang.recovered(f"engine {self.name} answered a call made after the hung one was given up")
        return completions


def with_engine_faults(engine: Engine, plan: FaultPlan | None) -> Engine:
    """`engine` wrapped in a FaultyEngine when `plan` has an engine fault, else `engine` itself."""
    if plan is None or not plan.planned("engine."):
        return engine
    return FaultyEngine(engine, plan)


__all__ = ["EngineCrashed", "EngineTimeout", "FaultyEngine", "with_engine_faults"]
