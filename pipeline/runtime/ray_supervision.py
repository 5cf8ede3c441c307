"""How the Ray runtime supervises a run's hosts until the consumer returns (`pipeline.runtime.ray`'s
"Supervision" paragraph): a dead producer is restarted, any other death fails the run.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import ray
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from pipeline.actor import ActorFailed
from pipeline.events import report_event
from pipeline.telemetry import RunFolder

__all__ = ["Supervision"]


@dataclass
class Supervision:
    """Watches every host of a Ray run until the consumer returns: restarts a dead producer (freeing its
    admission slots, re-sending it the latest weights), fails the run on any other death, and runs the
    progress line, a resumed run's feeder and the hang watch beside them."""

    run_: Any  # the pipeline.runtime.ray.RayRun supervised: its hosts, restarts and watchdog settings
    pipe: Any
    wiring: Any  # its pipeline.runtime.ray.Wiring
    peers: dict[str, list[Any]]
    progress: Any
    feeder: Callable[[], Awaitable[None]] | None  # a resumed run's feed_resume
    extra: list[Any] = field(default_factory=list)  # driver actors (an elastic run's fleet, control endpoint)
    failure: list[BaseException] = field(default_factory=list)

    async def run(self) -> None:
        self.done = anyio.Event()
        started = []
        try:
            for actor in self.extra:
                await actor.start()
                started.append(actor)
            await self._supervise()
        finally:
            with anyio.CancelScope(shield=True):
                for actor in reversed(started):  # a fleet stops the workers that joined
                    await actor.stop()
        if self.failure:
            raise self.failure[0]

    async def _supervise(self) -> None:
        async with anyio.create_task_group() as tg:
            for i in range(len(self.peers["producer"])):
                tg.start_soon(self.watch_producer, i)
            tg.start_soon(self.watch, "buffer-0", False)
            tg.start_soon(self.watch, "consumer-0", True)
            tg.start_soon(self.show_progress)
            if self.feeder is not None:
                tg.start_soon(self.guard, "resume", self.feeder)
            if self.run_.watchdog is not None and self.run_.watchdog.enabled:
                tg.start_soon(self.watch_for_hangs)
            for actor in self.extra:
                tg.start_soon(self.guard, actor.name, actor.run)
            await self.done.wait()
            tg.cancel_scope.cancel()

    def fail(self, error: BaseException) -> None:
        if not self.done.is_set():
            self.failure.append(error)
            self.done.set()

    async def watch(self, name: str, ends_run: bool) -> None:
        await self.guard(name, self.run_._hosts[name].run.remote)
        if ends_run:
            self.done.set()

    async def guard(self, name: str, work: Any) -> None:
        try:
            await work()
        except Exception as exc:
            self.fail(ActorFailed(name, "run", exc))

    async def watch_producer(self, index: int) -> None:
        name = f"producer-{index}"
        host, run = self.run_._hosts[name], self.run_
        while True:
            try:
                await host.run.remote()
                return
            except ray.exceptions.RayActorError as exc:
                if self.done.is_set() or name not in run._hosts:  # the run ended, or its fleet let it go
                    return
                if run.restarts[name] >= run.max_restarts:
                    return self.fail(ActorFailed(name, "run", exc))
                await self.restart_producer(name, index, exc)
            except Exception as exc:  # the actor's own error: the run fails, naming it
                return self.fail(ActorFailed(name, "run", exc))

    async def restart_producer(self, name: str, index: int, exc: BaseException) -> None:
        run = self.run_
        run.restarts[name] += 1
        freed = await self.wiring.conductor.worker_died.remote(name)
        report_event(self.wiring.folder, "producer.restarted", host=name, restart=run.restarts[name],
                     freed_slots=freed, error=str(exc))
        host = run._hosts[name]
        await _when_back(host, self.peers)  # Ray restarts the process; rebuild its actor
        await host.start.remote()
        await run._hosts["consumer-0"].producer_restarted.remote(index)

    async def show_progress(self) -> None:
        while True:
            version = await self.wiring.conductor.current.remote()
            self.progress.update(
                version=f"{version}/{self.pipe.steps}",
                **self.pipe.consumer.progress(RunFolder(self.wiring.folder).latest_metrics()),
            )
            await anyio.sleep(0.5)

    async def watch_for_hangs(self) -> None:
        from pipeline.runtime.ray_watchdog import ray_watchdog
        from pipeline.watchdog import PipelineHung

        dog = ray_watchdog(
            self.run_.watchdog, self.wiring.conductor, self.wiring.channels, self.run_._hosts, run=self.pipe.name,
            folder=RunFolder(self.wiring.folder),
        )
        try:
            await dog.run()
        except PipelineHung as hung:  # raised as it is, like the local runtime's
            self.fail(hung)


async def _when_back(host: Any, peers: dict[str, list[Any]], timeout_s: float = 120.0) -> None:
    """Set a restarted host up again, waiting while Ray still reports it as restarting."""
    async for attempt in AsyncRetrying(
        retry=retry_if_exception_type(ray.exceptions.ActorUnavailableError),
        wait=wait_exponential(multiplier=0.1, max=2.0),
        stop=stop_after_delay(timeout_s),
        reraise=True,
    ):
        with attempt:
            await host.setup.remote(peers)
