"""How new weight versions reach the engines: one module per transport, chosen by name.

Learner side, `TRANSPORTS[name]()` is a `WeightTransport`. Engine side, every engine process
answers every transport (`engine_mailboxes`), so the transport is the learner's choice alone.
"""

from __future__ import annotations

from typing import Any

from stages.weights.broadcast import BroadcastReceiver, BroadcastTransport
from stages.weights.delta import DeltaReceiver, DeltaTransport
from stages.weights.disk import DiskReceiver, DiskTransport
from stages.weights.inproc import InprocTransport
from stages.weights.mooncake_p2p import MooncakeP2PTransport, SlotReceiver
from stages.weights.packed import MAILBOX, mailbox_for

TRANSPORTS = {
    "inproc": InprocTransport,
    "mooncake_p2p": MooncakeP2PTransport,
    "disk": DiskTransport,
    "delta": DeltaTransport,
    "broadcast": BroadcastTransport,
}


def engine_mailboxes(engines: list[Any]) -> dict[str, Any]:
    """The mailbox handlers an engine process registers: packed versions through Ray, TransferEngine
    slots (started lazily, on the learner's first hello), safetensors notices, deltas and broadcast
    groups (formed on the learner's first join)."""
    return {
        MAILBOX: mailbox_for(engines),
        **SlotReceiver(engines).handlers(),
        **DiskReceiver(engines).handlers(),
        **DeltaReceiver(engines).handlers(),
        **BroadcastReceiver(engines).handlers(),
    }
