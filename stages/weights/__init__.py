"""How new weight versions reach the engines: one module per transport, chosen by name.

Learner side, `make_transport(name, **options)` is a `WeightTransport` (`TRANSPORTS` names every
one; a transport's module is imported only when it is made). Engine side, every engine process
answers every transport (`engine_mailboxes`), so the transport is the learner's choice alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.plugins import resolve

if TYPE_CHECKING:
    from stages.weights.base import WeightTransport

TRANSPORTS: dict[str, str] = {
    "inproc": "stages.weights.inproc:InprocTransport",
    "mooncake_p2p": "stages.weights.mooncake_p2p:MooncakeP2PTransport",
    "disk": "stages.weights.disk:DiskTransport",
    "delta": "stages.weights.delta:DeltaTransport",
    "broadcast": "stages.weights.broadcast:BroadcastTransport",
}


def make_transport(kind: str, **options: Any) -> WeightTransport:
    """The transport named `kind`, made with `options` (its constructor's keyword arguments)."""
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown weight transport {kind!r}; known: {', '.join(TRANSPORTS)}")
    return resolve(TRANSPORTS[kind])(**options)


def engine_mailboxes(engines: list[Any]) -> dict[str, Any]:
    """The mailbox handlers an engine process registers: packed versions through Ray, TransferEngine
    slots (started lazily, on the learner's first hello), safetensors notices, deltas and broadcast
    groups (formed on the learner's first join)."""
    from stages.weights import broadcast, delta, disk, mooncake_p2p, packed

    receivers = (mooncake_p2p.SlotReceiver, disk.DiskReceiver, delta.DeltaReceiver, broadcast.BroadcastReceiver)
    return {packed.MAILBOX: packed.mailbox_for(engines)} | {
        box: handler for receiver in receivers for box, handler in receiver(engines).handlers().items()
    }
