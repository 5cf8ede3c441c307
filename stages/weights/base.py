"""The weight-transport contract: how a new weight version reaches the engines.

`publish(version, tensors)` returns once every subscribed receiver holds the whole version (staged
for the next decode step); a receiver gets all named tensors of `version` or none. Versions
published are strictly increasing (a publish that raised published nothing). Engines in this
process are `WeightReceiver`s; engines in another process are an `Asker` (their host's mailboxes,
`remote_receiver`) and answer each version with an `ApplyReply`; every message is msgpack,
validated on arrival. Engines get each version as received (`stages.weights.adapter.as_received`:
full weights, or an `AdapterVersion` decoded once on the engine side). A transport declares its
engine side (`receiver`) and whether it can push from a sharded learner's ranks
(`pushes_from_shards`): the learner and the engines never test its name.

The byte-moving transports (`disk`, `delta`, `broadcast`, `mooncake_p2p`) share one push loop,
`PushTransport`, and say only what differs: `receiver` (their engine side, an `EngineReceiver`
class: in engine processes and for engines in this process), `stage(version, tensors)` (make a
version sendable once: a file, a packed buffer, clones) and `send(target, attempt)`: one attempt at
one receiver, sending what they choose (a delta, the whole state), returning (the encoded
`ApplyReply`, None when the receiver does not answer; the bytes sent) or raising `LinkBroken`. A
refused or broken attempt is tried again `retries` more times, then raised as `WeightPushError`,
never counted as delivered (an engine that will not take a verified version, e.g. one that does not
fit it, refuses it too). A receiver that does not answer is skipped and its session forgotten
(`Target.forget`): `resend()` catches it up once its process is back, so one dead engine never stops
the others. """

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import anyio
import msgspec
import torch

from stages.weights.adapter import AdapterError, AdapterVersion, as_received


@runtime_checkable
class WeightReceiver(Protocol):
    """An engine in the learner's process: it gets each version as received (`as_received`)."""

    name: str

    async def receive_weights(self, version: int, weights: dict[str, torch.Tensor] | AdapterVersion) -> None: ...


@runtime_checkable
class Asker(Protocol):
    """A receiver reached by messages: `ask(box, header)` hands `header` to mailbox `box` and returns
    the encoded reply, or None when the receiver's process does not answer (it is gone)."""

    name: str

    async def ask(self, box: str, header: bytes) -> bytes | None: ...


@runtime_checkable
class WeightTransport(Protocol):
    """Everything the learner calls on a transport; `stats` has the keys of `new_stats()`."""

    name: str
    stats: dict[str, float]
    receiver: type[EngineReceiver]  # its engine side: the mailboxes an engine process registers for it
    pushes_from_shards: bool  # it has `publish_shards` (stages.weights.mooncake_shards): every learner rank writes

    def subscribe(self, receiver: WeightReceiver | Asker) -> Callable[[], None]:
        """Send every later version to `receiver` too; returns its unsubscribe: once called, no version is
        sent to it any more (a push in progress may still reach it; an engine leaving is still up then)."""
        ...

    def remote_receiver(self, peer: Any, name: str) -> Any:
        """A receiver to subscribe for the engines of another process, reached through `peer`
        (`deliver`/`ask` into its mailboxes); its `resend()` calls this transport's `resend`."""
        ...

    async def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None: ...

    async def resend(self, receiver: Any) -> None:
        """Catch one subscribed receiver up with the latest version (its process was restarted).
        Best effort: a refused catch-up is counted (`deferred`) and left to the next `publish`."""
        ...

    async def close(self) -> None: ...


STATS = {
    "versions": "versions published",
    "state_bytes": "the published versions' own bytes, summed",
    "bytes": "bytes sent, summed over receivers and over every attempt a receiver answered",
    "seconds": "time spent in publish",
    "copied": "versions sent from a copy (a file, a packed buffer, clones), not the learner's tensors",
    "refused": "attempts that did not deliver (refused, or the link broke); retried, then raised",
    "full_sends": "whole states sent in place of a partial version (the receiver lacked its base)",
    "unreachable": "sends skipped because the receiver's process did not answer",
    "resent": "catch-ups `resend` delivered",
    "deferred": "catch-ups `resend` could not deliver (left to the next publish)",
    # element-level deltas (`stages.weights.sparse`), summed over sends; zero for other transports
    "elements": "engine-dtype elements of the versions sent",
    "changed": "elements that differed from the receiving slot's base",
    "full_bytes": "bytes whole versions would have been (to compare with `bytes`)",
    "buckets_index": "buckets sent as element indices and values",
    "buckets_bitmask": "buckets sent as a bitmask and values",
    "buckets_full": "buckets sent whole (denser than either form, or no base)",
    "fallback_new": "full sends to a receiver that holds no version (new, restarted, its slots lost)",
    "fallback_lost": "full sends to a receiver whose versions the learner no longer keeps",
    "fallback_refused": "full sends after a refused attempt (a checksum mismatch, a lost base)",
}


def new_stats() -> dict[str, float]:
    """A transport's counters: the keys of `STATS`, all zero; every transport counts them alike."""
    return dict.fromkeys(STATS, 0)


def state_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class WeightPushError(RuntimeError):
    """A version could not be delivered to every receiver."""


class ApplyReply(msgspec.Struct, frozen=True):
    """An engine process's answer to a version: applied (or already held), or refused and why;
    `version` is what it holds afterwards."""

    ok: bool
    version: int
    reason: str = ""


@dataclass
class RemoteReceiver:
    """The engines of another process, reached through `peer.ask(box, header)` (their host's
    mailboxes); `resend()` has the transport catch them up once that process was restarted."""

    peer: Any
    name: str
    transport: WeightTransport

    async def ask(self, box: str, header: bytes) -> bytes | None:
        return await self.peer.ask(box, header)

    async def resend(self) -> None:
        await self.transport.resend(self)


def subscribe_producers(transport: WeightTransport, producers: Any) -> dict[str, Any]:
    """Subscribe a `remote_receiver` for every producer process in `producers` (a `pipeline.roster.Roster` of
    peers named producer-<index>, Ray runtime): those there now and each that joins later; one that leaves is
    unsubscribed before its process stops. Returns the subscribed receivers by name, kept current."""
    receivers: dict[str, Any] = {}

    def joined(peer: Any) -> Callable[[], None]:
        receiver = transport.remote_receiver(peer, peer.name)
        receivers[peer.name] = receiver
        unsubscribe = transport.subscribe(receiver)

        def left() -> None:
            receivers.pop(peer.name, None)
            unsubscribe()

        return left

    producers.watch(joined)
    return receivers


def require_newer(version: int, last: int) -> None:
    """Versions are published strictly increasing; anything else is a bug in the caller."""
    if version <= last:
        raise WeightPushError(f"version {version} published after {last}; versions must increase")


class EngineReceiver:
    """The engine side of a transport that moves bytes: the version its engines hold, how many
    versions it refused, and the replies. Subclasses verify what arrives and call `apply` only
    with a whole, verified version; every reply is an encoded `ApplyReply`."""

    def __init__(self, engines: list[Any]) -> None:
        self.engines, self.version, self.rejected = engines, -1, 0

    def handlers(self) -> dict[str, Any]:
        """Mailbox name -> `async handler(header, blob) -> reply bytes`."""
        raise NotImplementedError

    def holds(self, version: int) -> bytes | None:
        """The reply for a version it already holds (or an older one), else None."""
        if version <= self.version:
            return msgspec.msgpack.encode(ApplyReply(True, self.version, "already applied"))
        return None

    def refuse(self, reason: str) -> bytes:
        self.rejected += 1
        return msgspec.msgpack.encode(ApplyReply(False, self.version, reason))

    async def apply(self, version: int, tensors: dict[str, torch.Tensor]) -> bytes:
        """Hand the version to every engine, as received (an adapter's descriptor decoded once, here); a
        descriptor that does not decode, or an engine that will not take it (weights that do not fit: its
        EngineError), refuses the version, and the engines keep their own."""
        try:
            weights = as_received(tensors)
        except AdapterError as exc:
            return self.refuse(f"version {version}: {exc}")
        for engine in self.engines:
            try:
                await engine.receive_weights(version, weights)
            except Exception as exc:  # noqa: BLE001 - the engine's own error, told to the learner as the reason
                return self.refuse(f"engine {engine.name} refused version {version}: {exc}")
        self.version = version
        return msgspec.msgpack.encode(ApplyReply(True, self.version))


@dataclass
class LocalAsker:
    """An `EngineReceiver` in this process (local runtime, tests), reached by calling its handlers."""

    receiver: EngineReceiver
    name: str = "local"

    async def ask(self, box: str, header: bytes) -> bytes | None:
        return await self.receiver.handlers()[box](header, None)


class LinkBroken(RuntimeError):
    """An attempt broke on the way (a write, a collective); tried again like a refusal."""


@dataclass(eq=False)
class Target:
    """One subscribed receiver; a transport's subclass adds its session with it (a group, slots)."""

    asker: Asker

    def forget(self) -> None:
        """Drop the session: the receiver's process is gone or new, the next send starts over."""


class PushTransport:
    """See the module docstring. Subclasses are dataclasses with the fields `retries` and `name`."""

    name: str
    retries: int
    target_type: ClassVar[type[Target]] = Target
    receiver: ClassVar[type[EngineReceiver]]
    pushes_from_shards: ClassVar[bool] = False

    def __post_init__(self) -> None:
        self.stats = new_stats()
        self._targets: list[Target] = []
        self._published = -1  # the last version `publish` returned for
        self._staged = -1  # the version `send` sends (`resend` too)
        self._lock: anyio.Lock | None = None

    def engine_receiver(self, engines: list[Any]) -> EngineReceiver:
        """The engine side for engines in this process."""
        return self.receiver(engines)

    async def stage(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    async def send(self, target: Any, attempt: int) -> tuple[bytes | None, int]:
        raise NotImplementedError

    def subscribe(self, receiver: WeightReceiver | Asker) -> Callable[[], None]:
        """An `Asker` (another process, a `remote_receiver`) or an engine in this process; returns its
        unsubscribe (the target is dropped and its session forgotten)."""
        if not isinstance(receiver, Asker):
            receiver = LocalAsker(self.engine_receiver([receiver]), receiver.name)
        target = self.target_type(receiver)
        self._targets.append(target)

        def unsubscribe() -> None:
            self._targets = [t for t in self._targets if t is not target]
            target.forget()

        return unsubscribe

    def remote_receiver(self, peer: Any, name: str) -> RemoteReceiver:
        return RemoteReceiver(peer, name, self)

    async def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        require_newer(version, self._published)
        started = time.perf_counter()
        async with self._busy:
            await self.stage(version, tensors)
            self._staged = version
            for target in list(self._targets):  # a receiver may join or leave while a version goes out
                await self._deliver(target, self.retries + 1)
        self._published = version
        self.stats["versions"] += 1
        self.stats["state_bytes"] += state_bytes(tensors)
        self.stats["seconds"] += time.perf_counter() - started

    async def resend(self, receiver: Any) -> None:
        """One attempt at catching `receiver` up with the staged version, from a fresh session."""
        async with self._busy:
            for target in (t for t in self._targets if t.asker is receiver):
                target.forget()
                try:
                    if self._staged >= 0 and await self._deliver(target, attempts=1):
                        self.stats["resent"] += 1
                except WeightPushError:
                    self.stats["deferred"] += 1

    async def close(self) -> None:
        self._targets.clear()

    @property
    def _busy(self) -> anyio.Lock:
        if self._lock is None:  # made on first use, inside the event loop that uses it
            self._lock = anyio.Lock()
        return self._lock

    async def _deliver(self, target: Target, attempts: int) -> bool:
        """The push loop: True once `target` holds the staged version, False when it is unreachable."""
        reason = ""
        for attempt in range(attempts):
            try:
                answer, nbytes = await self.send(target, attempt)
            except LinkBroken as exc:
                reason = str(exc)
                self.stats["refused"] += 1
                continue
            if answer is None:
                target.forget()
                self.stats["unreachable"] += 1
                return False
            self.stats["bytes"] += nbytes
            reply = msgspec.msgpack.decode(answer, type=ApplyReply)
            if reply.ok:
                return True
            reason = reply.reason
            self.stats["refused"] += 1
        raise WeightPushError(f"receiver {target.asker.name} refused version {self._staged} {attempts} times: {reason}")
