"""Checkpoints on the Ray runtime: one consistent cut of a run whose state lives in many processes.

On Ray the run's ledger lives in the `Conductor` actor, its refs in the hosts (producers sending, the
buffer's index, the consumer's window) and in the channel actors. `RayCut.capture` (called by the
consumer between two steps, like `LocalCut`) takes the cut in three moves:

1. **freeze** the conductor: from its reply on, every call that changes the ledger (`produced`,
   `take_source`, `trained`, `finished`) waits, so the ledger snapshot in the reply is the ledger for
   the whole capture. The freeze is a lease: it thaws by itself after `lease_s`, and a capture whose
   lease ran out raises `CheckpointError` (its cut is no longer consistent) instead of writing;
2. **ask** every producer host live at the cut (an elastic run's joiners too, until they drained), the
   `produced` channel, the buffer host and the `ready` channel (all at once: one round trip of frozen
   time) for the refs they hold, and producers for the prompts they were making; the consumer's own
   window is read in place (it waits in `Checkpointer.save`);
3. **thaw** the conductor, then the checkpoint is written as on the local runtime.

A host that does not answer within the lease (80 % of it, so the thaw comes in time) voids the cut:
`CutFailed`, and `Checkpointer.save` skips this checkpoint (the previous one stays the latest; the
ledger's store keeps every record) while the run goes on. A dead
host answers nothing and holds nothing: its groups are regenerated on resume.

Why this cut is good enough for a resume (pipeline.checkpoint): refs keep moving downstream during
step 2, but the ledger does not change, and resume trusts the ledger. A ref seen twice (it moved
downstream between two answers) is re-sent once (by group); a group the ledger has in flight whose
ref was seen nowhere (inside a call between two actors) is regenerated and counted. A producer whose
`produced` call was waiting at the frozen conductor reports those groups as `recording`; they are
owed unless the frozen ledger has them already (`owed_sources`). A redo polled from the feedback
channel but not yet taken is found in the ledger's sources (`redo_requests`). So nothing in flight at
the cut is lost or produced twice, whatever the timing.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec

from pipeline.checkpoint import CheckpointError, CutFailed, GateCounts, RandomState, RunState, owed_sources
from pipeline.contracts import CheckpointedProducer, CheckpointingConsumer, RefHolder
from pipeline.ledger import Ledger, LedgerState
from pipeline.refs import HeldRef, Redo


class FrozenRun(msgspec.Struct, frozen=True, kw_only=True):
    """The conductor's part of a cut: its version, ledger (`Ledger.state`: in flight, and the store's
    position) and gate counts at the freeze."""

    token: str
    version: int
    ledger: LedgerState
    gate: GateCounts


class HostHeld(msgspec.Struct, frozen=True, kw_only=True):
    """A host's part of a cut: the refs its actor holds, the prompts it was generating, and the
    (group, source) of its `produced` call under way."""

    refs: list[HeldRef] = []
    generating: list[bytes] = []
    recording: list[tuple[str, bytes]] = []
    rngs: dict[str, RandomState] = {}  # the actor's random stream, by its name


def held_by(actor: Any) -> bytes:
    """What `actor` holds for a cut (`pipeline.contracts`: a producer's state, or any held refs), msgpack-encoded."""
    if isinstance(actor, CheckpointedProducer):
        return msgspec.msgpack.encode(HostHeld(
            refs=actor.held_refs(), generating=actor.held_sources(), recording=actor.recording(),
            rngs={actor.name: actor.rng_state()},
        ))
    return msgspec.msgpack.encode(HostHeld(refs=actor.held_refs() if isinstance(actor, RefHolder) else []))


class Freezer:
    """The conductor's freeze (see the module docstring): ledger-changing calls `await self.open()`
    first; `freeze` closes the gate for at most `lease_s`, `thaw` opens it. One freeze at a time."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._token: str | None = None
        self._lease: asyncio.TimerHandle | None = None
        self.frozen_s = 0.0  # in all, for the run summary
        self._since = 0.0

    async def open(self) -> None:
        if not self._open.is_set():
            await self._open.wait()

    def freeze(self, lease_s: float) -> str:
        if self._token is not None:
            raise CheckpointError("a checkpoint cut is already being taken; the consumer takes one at a time")
        self._token = uuid.uuid4().hex
        self._open.clear()
        self._since = time.perf_counter()
        self._lease = asyncio.get_running_loop().call_later(lease_s, self._release)
        return self._token

    def thaw(self, token: str) -> bool:
        """Open the ledger again; True if the freeze `token` names still held (the cut is consistent)."""
        held = token == self._token
        if held:
            self._release()
        return held

    def _release(self) -> None:
        if self._lease is not None:
            self._lease.cancel()
        self.frozen_s += time.perf_counter() - self._since
        self._token, self._lease = None, None
        self._open.set()


def frozen_run(freezer: Freezer, lease_s: float, version: int, ledger: Ledger, started: int, discarded: int) -> bytes:
    """Freeze and describe the conductor's state (what `Conductor.freeze` answers)."""
    token = freezer.freeze(lease_s)
    return msgspec.msgpack.encode(FrozenRun(
        token=token, version=version, ledger=ledger.state(), gate=GateCounts(started, discarded)
    ))


@dataclass
class RayCut:
    """The Ray runtime's `RunCut` (see the module docstring). `producers()` gives the producer hosts live at
    the cut (an elastic run's joiners included: the consumer's roster) and `buffer` is the buffer's, as
    StageHost handles; `channels` the run's RayChannels of refs and its feedback channel."""

    run: str
    steps: int
    units_per_version: int
    conductor: Any
    producers: Callable[[], Iterable[Any]]
    buffer: Any
    channels: dict[str, Any]
    lease_s: float = 60.0

    async def capture(self, version: int, consumer: CheckpointingConsumer) -> RunState:
        frozen = msgspec.msgpack.decode(await self.conductor.freeze.remote(self.lease_s), type=FrozenRun)
        try:
            if frozen.version != version:
                raise CheckpointError(f"a checkpoint of version {version} was asked at version {frozen.version}")
            with anyio.fail_after(self.lease_s * ASK_SHARE):
                parts = await self._ask_holders()
        except TimeoutError:
            parts = None
        finally:
            consistent = await self.conductor.thaw.remote(frozen.token)
        if parts is None or not consistent:
            raise CutFailed(
                f"the cut of version {version} did not finish within its {self.lease_s:g} s lease on the conductor's "
                "ledger (a host did not answer); this checkpoint is skipped"
            )
        held, generating, recording, rngs, redo = parts
        return RunState(
            run=self.run, version=version, steps=self.steps, units_per_version=self.units_per_version,
            created_at=time.time(), ledger=frozen.ledger, gate=frozen.gate,
            held=[*consumer.held_refs(), *held], redo=redo,
            owed=owed_sources(generating, recording, frozen.ledger), rngs=rngs,
        )

    async def _ask_holders(self) -> tuple[list[HeldRef], list[bytes], list[tuple[str, bytes]], dict, list[Redo]]:
        """Every host's and channel's part of the cut (see the module docstring)."""
        import ray

        held: list[HeldRef] = []
        generating: list[bytes] = []
        recording: list[tuple[str, bytes]] = []
        rngs: dict[str, RandomState] = {}

        async def host(handle: Any) -> None:
            try:
                part = msgspec.msgpack.decode(await handle.held.remote(), type=HostHeld)
            except ray.exceptions.RayActorError:  # a dead producer holds nothing: its groups are regenerated
                return
            held.extend(part.refs)
            generating.extend(part.generating)
            recording.extend(part.recording)
            rngs.update(part.rngs)

        async def channel(name: str) -> None:
            held.extend(HeldRef(ref=r, holder=f"channel:{name}") for r in await self.channels[name].items())

        async def feedback() -> list[Redo]:
            return [r for r in await self.channels["feedback"].items() if isinstance(r, Redo)]

        # all at once: the ledger is what resume trusts, and its rules absorb refs that move meanwhile
        *_, redo = await asyncio.gather(
            *(host(h) for h in self.producers()), channel("produced"), host(self.buffer), channel("ready"), feedback()
        )
        return held, generating, recording, rngs, redo


ASK_SHARE = 0.8  # of the lease: the hosts must have answered by then, so the thaw comes within the lease


__all__ = ["Freezer", "FrozenRun", "HostHeld", "RayCut", "frozen_run", "held_by"]
