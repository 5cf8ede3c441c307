"""How new weight versions reach the engines: one module per transport, chosen by name.

A transport is one class with both of its sides: the learner's (`WeightTransport`) and the engine's,
its class attribute `receiver` (an `EngineReceiver` class: the mailbox handlers an engine process
registers). `TRANSPORTS` names the built-ins; a user's transport is a `"pkg.module:Class"` path and
takes the same path everywhere: `transport_class` resolves either, `transport_options` are its
constructor's keywords (the config keys it gets), `make_transport` makes it, and every engine process
answers every built-in transport plus the run's own (`engine_mailboxes`), so the transport is the
learner's choice alone. A transport's module is imported only when it is resolved.
"""

from __future__ import annotations

import inspect
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


def transport_class(kind: str) -> type:
    """The transport `kind` names: a built-in's name or a `"pkg.module:Class"` path (PluginError, a
    ValueError naming `weights.transport` and the built-ins, when it names none)."""
    if kind not in TRANSPORTS and ":" not in kind:
        raise ValueError(f"unknown weights.transport {kind!r}; known: {', '.join(TRANSPORTS)}, or a plug-in's "
                         "'pkg.module:Class' path")
    cls = resolve(TRANSPORTS.get(kind, kind), what="weights.transport")
    if not isinstance(cls, type) or not isinstance(getattr(cls, "receiver", None), type):
        raise ValueError(f"weights.transport {kind!r} is not a transport class with a `receiver` class (its engine "
                         "side, stages.weights.base.EngineReceiver)")
    return cls


def transport_options(kind: str) -> tuple[str, ...]:
    """The keyword arguments its constructor takes (what a config may set), `name` aside."""
    params = inspect.signature(transport_class(kind)).parameters.values()
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "name")


def make_transport(kind: str, **options: Any) -> WeightTransport:
    """The transport `kind` names, made with `options` (its constructor's keyword arguments)."""
    return transport_class(kind)(**options)


def engine_mailboxes(engines: list[Any], transport: str | None = None) -> dict[str, Any]:
    """The mailbox handlers an engine process registers: every built-in transport's receiver and the
    receiver of the run's `transport` (a plug-in's path reaches this process with the producer stage)."""
    kinds = [*TRANSPORTS, *([transport] if transport and transport not in TRANSPORTS else [])]
    receivers = dict.fromkeys(transport_class(kind).receiver for kind in kinds)  # one each, in order
    return {box: handler for receiver in receivers for box, handler in receiver(engines).handlers().items()}
