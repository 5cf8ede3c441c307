"""The inference-server faults, for an engine that launched its own server (`FaultyEngine` applies them):

* `engine.server_kill` (counted per `generate` call): once requests are in flight on the server, its process
  group is SIGKILLed by pid. The engine must notice, restart it (event `engine.restarted`), push the version it
  held and generate the call's requests again from their prompts, so the call answers whole and nothing is
  lost. Recovered when that call answers with the server restarted.
* `engine.server_kill_push` (counted per version pushed): the server is SIGKILLed while the engine pushes the
  version (paused, pushing, resuming or probing). The engine restarts it and catches it up to the latest
  version (a refused push is sent again by the weight transport). Recovered once the engine holds that version
  or a newer one, at its next answer or push.
* `engine.push_refused` (counted per version pushed): the version's file is damaged once written
  (`vllm_update.damage_file`), so the server refuses it before vLLM's update starts and keeps serving the
  version it held; the engine raises, the transport counts the refusal (`weights.refused`) and sends the
  version again. Recovered when a push lands.

Every kill is by the pid of the server the engine launched (`server.kill()`: its own process group), never by
name. An engine that cannot take a planned kind (an in-process engine, a server attached by url, a server
without version files) is refused when the run is built (`FaultPlanError`, naming `engine.kind`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

from pipeline.faults import SERVER_FAULT_KINDS, FaultPlan, FaultPlanError
from pipeline.telemetry import get_logger
from stages.engines.server_engine import ServerEngine

T = TypeVar("T")
KILL_WAIT_S = 60.0  # how long a planned kill waits for its moment (requests in flight, a push under way)


class ServerFaults:
    """The server fault schedules of one engine (see the module docstring); None schedules install nothing."""

    def __init__(self, engine: Any, plan: FaultPlan) -> None:
        self.engine = engine
        self._kill = plan.schedule("engine.server_kill", engine.name)
        self._kill_push = plan.schedule("engine.server_kill_push", engine.name)
        self._refuse = plan.schedule("engine.push_refused", engine.name)
        self._catch_up_to: int | None = None  # the version a kill mid-push interrupted, until the engine holds it
        self._refused: tuple[int | None, str] = (None, "")  # the version served when a damaged one was refused
        self.log = get_logger("faults").bind(boundary="engine server", engine=engine.name)
        launched = isinstance(engine, ServerEngine) and getattr(engine, "url", None) is None
        if (self._kill or self._kill_push) and not launched:
            how = " attached by url" if isinstance(engine, ServerEngine) else ""
            raise FaultPlanError(f"faults engine.server_kill / engine.server_kill_push need an engine that launches "
                                 f"its server (engine.kind = 'vllm', no engine.urls); engine {engine.name} is a "
                                 f"{type(engine).__name__}{how}")
        if self._refuse and not hasattr(engine, "damage_next_push"):
            raise FaultPlanError(f"fault engine.push_refused needs an engine that pushes version files (engine.kind "
                                 f"= 'vllm'); engine {engine.name} is a {type(engine).__name__}")

    async def generate(self, call: Callable[[], Awaitable[T]]) -> T:
        """`call()` (the engine's generate), with the server killed under it when `engine.server_kill` fires."""
        if self._kill is None or not self._kill.hit():
            result = await call()
            self._caught_up()
            return result
        stats = self.engine.stats
        restarts, regenerated = stats["restarts"], stats["regenerated"]
        result = await self._with_kill(call, lambda: self.engine.load > 0, "requests in flight")
        if stats["restarts"] > restarts:
            self._kill.recovered(f"engine {self.engine.name} restarted its server and answered the call whole",
                                 restarts=stats["restarts"], regenerated=stats["regenerated"] - regenerated,
                                 answered=len(result))
        self._caught_up()
        return result

    async def receive_weights(self, call: Callable[[], Awaitable[None]], version: int) -> None:
        """`call()` (the engine's receive_weights of `version`), with a kill or a damaged file when one fires."""
        if self._refuse is not None and self._refuse.hit():
            from stages.engines.vllm_update import damage_file  # here: a producer without this fault imports no torch

            self.log.warning("injected fault: damaging the version's file", version=version)
            self.engine.damage_next_push(damage_file)
            try:
                await call()  # the server refuses it: EngineError
            except Exception as exc:
                self._refused = (self.engine.version, str(exc)[:300])  # what it still serves, and why
                raise
        elif self._kill_push is not None and self._kill_push.hit():
            self._catch_up_to = version
            await self._with_kill(call, lambda: self.engine.updating, f"pushing version {version}")
        else:
            await call()
        if self._refuse is not None and self.engine.version >= version:
            held, why = self._refused
            self._refuse.recovered(f"engine {self.engine.name} took version {version}", version=version,
                                   held_when_refused=held, refused=why, restarts=self.engine.stats["restarts"])
        self._caught_up()

    async def _with_kill(self, call: Callable[[], Awaitable[T]], moment: Callable[[], bool], what: str) -> T:
        """Run `call()` and SIGKILL the engine's server (by its pid) once `moment()` holds during it."""
        async def kill_at_moment() -> None:
            with anyio.move_on_after(KILL_WAIT_S):
                while not moment():
                    await anyio.sleep(0.001)
                server = self.engine.server
                self.log.warning("injected fault: SIGKILL to the engine's server", pid=server.pid, during=what)
                server.kill()

        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_at_moment)
            try:
                return await call()
            finally:
                tg.cancel_scope.cancel()  # a call that ended before its moment came kills nothing

    def _caught_up(self) -> None:
        if self._catch_up_to is not None and self.engine.version >= self._catch_up_to:
            assert self._kill_push is not None
            self._kill_push.recovered(f"engine {self.engine.name} caught up", version=self.engine.version,
                                      interrupted=self._catch_up_to, restarts=self.engine.stats["restarts"])
            self._catch_up_to = None


def server_faults(engine: Any, plan: FaultPlan) -> ServerFaults | None:
    """The engine's server faults, or None when `plan` has none of them."""
    if not plan.planned(*SERVER_FAULT_KINDS):
        return None
    return ServerFaults(engine, plan)


__all__ = ["ServerFaults", "server_faults"]
