"""The version fence: an engine that joins a running run is given requests only once it holds the run's
current weights, and has shown it.

The joining worker starts its engine (the model folder's weights, version 0) and subscribes it to the
learner's pushes first (`RunContext.services.weight_receivers`), so no version published from then on
passes it by. Then, until it passes or `timeout_s` runs out (`FenceError`):
1. it reads the learner's weight snapshot from the store (`stages.weights.snapshot`: every bucket
   checked against its checksum on decode) and, when the snapshot is newer than the engine and not newer
   than the clock, hands it to the engine;
2. where the engine holds exactly the snapshot's version, it proves it: the checksum of the engine's live
   weights equals the snapshot's (`ChecksumsWeights`; read with the engine's version unchanged before and
   after, so a push landing meanwhile is never mistaken for a mismatch). A mismatch is a `FenceError`. An
   engine that cannot report its weights (a server engine), or an adapter version, is proven by the
   snapshot's own bucket checksums;
3. it passes once the engine's version is at least the clock's, read after the subscription: any later
   version reaches it by push (each transport checks what it delivers).
Version 0 with no snapshot yet passes on the model folder itself (every engine starts from it); a clock
past the latest snapshot (`snapshot_every` > 1) passes on the push that brought it. The fence says
how it passed (`Fenced`): the version, the seconds it took, the checksum it proved, and from where.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio

from stages.engines.base import ChecksumsWeights, Engine
from stages.weights.adapter import AdapterVersion
from stages.weights.snapshot import load_snapshot


class FenceError(RuntimeError):
    """A joining engine could not show that it holds the run's current weights; it is given no work."""


@dataclass(frozen=True)
class Fenced:
    """How an engine passed its fence: at `version`, after `seconds`, proven by `checksum` (None: on the
    model folder or a push), its weights from `source` ("model", "snapshot" or "push")."""

    version: int
    seconds: float
    checksum: int | None
    source: str


async def pass_fence(engine: Engine, ctx: Any, store: Any, key: str, timeout_s: float) -> Fenced:
    """Bring `engine` to the run's current version and prove it (see the module docstring)."""
    started = anyio.current_time()
    proven: tuple[int, int | None] | None = None  # (version, checksum)
    while True:
        current = await ctx.clock.current()
        snapshot = await load_snapshot(store, key)
        if snapshot is not None and engine.version < snapshot[0] <= current:
            await engine.receive_weights(*snapshot)
        if snapshot is not None and engine.version == snapshot[0] and (proven is None or proven[0] != snapshot[0]):
            proven = await _prove(engine, *snapshot)
        if engine.version == current:
            passed = _passed(proven, snapshot[0] if snapshot is not None else None, current,
                             anyio.current_time() - started)
            if passed is not None:
                return passed
        # behind the clock, or a push ahead of it (its snapshot is stored before the clock moves): wait
        if anyio.current_time() - started > timeout_s:
            raise FenceError(f"engine {engine.name} reached version {engine.version}, not the run's {current}, "
                             f"within {timeout_s} s (the rollout's engine_sync_s); it is given no work")
        with anyio.move_on_after(0.05):
            await ctx.clock.wait_change(current)


async def _prove(engine: Engine, version: int, weights: Any) -> tuple[int, int | None] | None:
    """(version, checksum) once the engine's live weights match the snapshot's; (version, None) where the
    engine cannot report them or the version is an adapter (the snapshot's bucket checksums are the
    proof); None when a push landed while they were read (the next round proves that one)."""
    if isinstance(weights, AdapterVersion) or not isinstance(engine, ChecksumsWeights):
        return version, None
    live, expected = await anyio.to_thread.run_sync(engine.weights_checksums, weights)
    if engine.version != version:
        return None  # a newer version landed while it was read: the next round proves that one
    if live != expected:
        raise FenceError(f"engine {engine.name} holds version {version} with checksum {live:#x}, but the "
                         f"version's checksum is {expected:#x}: its weights are not the learner's")
    return version, expected


def _passed(proven: tuple[int, int | None] | None, snapshot: int | None, current: int,
            seconds: float) -> Fenced | None:
    """How an engine at the clock's version passes, or None while its proof is still to come."""
    if proven is not None and proven[0] == current:
        return Fenced(current, round(seconds, 3), proven[1], "snapshot")
    if snapshot is None or snapshot < current:  # nothing newer to prove against: the push's own checks
        return Fenced(current, round(seconds, 3), None, "model" if current == 0 else "push")
    return None


__all__ = ["FenceError", "Fenced", "pass_fence"]
