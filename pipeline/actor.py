"""Actors: the unit a runtime places and supervises.

An actor is anything with a `name` and three async methods. The runtime promises:
* `start()` of every actor completes before any `run()` begins (so wiring is done first);
* `stop()` is called on every actor whose `start()` succeeded, in reverse start order, even when
  the run fails or is cancelled;
* the first `run()` to raise ends the whole run, and the error names that actor.
An actor's `run()` that returns normally is simply done; the run ends when every actor the
runtime was told to wait for (`until`) has returned.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Actor(Protocol):
    name: str

    async def start(self) -> None: ...

    async def run(self) -> None: ...

    async def stop(self) -> None: ...


class BaseActor:
    """Convenience base: a name and no-op start/stop."""

    name: str = "actor"

    async def start(self) -> None:
        return None

    async def run(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        return None


class ActorFailed(RuntimeError):
    """An actor's start() or run() raised; the original exception is the __cause__."""

    def __init__(self, actor: str, phase: str, error: BaseException) -> None:
        self.actor = actor
        self.phase = phase
        error = innermost(error)
        super().__init__(
            f"actor {actor!r} failed in {phase}(): {type(error).__name__}: {error} "
            f"(the run was stopped; the traceback of the cause is above)"
        )


def innermost(error: BaseException) -> BaseException:
    """The one real error inside nested single-member exception groups (task groups wrap errors)."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error
