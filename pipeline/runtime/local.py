"""The local runtime: every actor is a task in one event loop (anyio task group).

Blocking compute inside an actor belongs in `anyio.to_thread.run_sync`, so that two actors can
compute at once (torch releases the GIL in its kernels).
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from pipeline.actor import Actor, ActorFailed


async def run_actors(actors: Sequence[Actor], until: Sequence[str]) -> None:
    """Start all actors, run them until every actor named in `until` has returned, then stop all.

    Raises ActorFailed (cause chained) if any start() or run() raises. Other actors are cancelled
    and every started actor is stopped either way.
    """
    names = [a.name for a in actors]
    if len(set(names)) != len(names):
        raise ValueError(f"actor names must be unique, got {names}")
    missing = set(until) - set(names)
    if missing:
        raise ValueError(f"until names unknown actors: {sorted(missing)}")

    started: list[Actor] = []
    failure: list[ActorFailed] = []
    try:
        for actor in actors:
            try:
                await actor.start()
            except Exception as exc:
                failure.append(ActorFailed(actor.name, "start", exc))
                raise failure[-1] from exc
            started.append(actor)

        pending = set(until)

        async with anyio.create_task_group() as tg:

            async def supervise(actor: Actor) -> None:
                try:
                    await actor.run()
                except anyio.get_cancelled_exc_class():
                    raise
                except Exception as exc:
                    err = ActorFailed(actor.name, "run", exc)
                    err.__cause__ = exc
                    failure.append(err)
                    tg.cancel_scope.cancel()
                    return
                pending.discard(actor.name)
                if not pending:
                    tg.cancel_scope.cancel()

            for actor in actors:
                tg.start_soon(supervise, actor, name=f"actor:{actor.name}")
        if failure:
            raise failure[0]
    finally:
        with anyio.CancelScope(shield=True):
            stop_errors = []
            for actor in reversed(started):
                try:
                    await actor.stop()
                except Exception as exc:  # keep stopping the others; report after
                    stop_errors.append(ActorFailed(actor.name, "stop", exc))
            if stop_errors and not failure:
                raise stop_errors[0]
