"""baton's runtime: refs, versions, channels, actors, the ledger, the two runtimes and the Pipeline.

Nothing here knows about models, rewards or gradients; see `stages` for that. `pipeline.contracts`
declares every method a stage may implement and every call it may make on the run. Each name exported
here loads its module on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

# each name -> the module that defines it, imported on first use: a light module of the package (plugins,
# faults, placement) loads without the runtime (asyncio actors, structlog, aiohttp)
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("Actor", "ActorFailed", "BaseActor"), "pipeline.actor"),
    **dict.fromkeys(("Channel", "ChannelClosed"), "pipeline.channel"),
    **dict.fromkeys(("Buffer", "Consumer", "Producer", "Services", "Stage"), "pipeline.contracts"),
    **dict.fromkeys(("Pipeline", "RunContext"), "pipeline.dsl"),
    "Ledger": "pipeline.ledger",
    **dict.fromkeys(("Ref", "make_key", "parse_key"), "pipeline.refs"),
    "VersionClock": "pipeline.versions",
    **dict.fromkeys(("PipelineHung", "WatchdogSettings"), "pipeline.watchdog"),
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = [
    "Actor", "ActorFailed", "BaseActor", "Buffer", "Channel", "ChannelClosed", "Consumer", "Ledger", "Pipeline",
    "PipelineHung", "Producer", "Ref", "RunContext", "Services", "Stage", "VersionClock", "WatchdogSettings",
    "make_key", "parse_key",
]
