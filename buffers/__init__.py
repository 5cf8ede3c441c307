"""Where rollout data lives: the codec, the ObjectStore protocol, its backends and the ref buffer (each
name exported here loads its module on first use). `ReplayBuffer`, its old name (it never replayed:
reuse happens in the learner's ReplayWindow), is an alias of `RefBuffer` for one release (0.1.x) and goes
in the next."""

from __future__ import annotations

import importlib
from typing import Any

# each name -> (its module, its name there), imported on first use: `buffers.mooncake_master` and the other
# light modules load without the codec's numpy
_EXPORTS: dict[str, tuple[str, str]] = {
    **{name: ("buffers.codec", name) for name in ("RolloutBatch", "decode", "encode", "encode_parts")},
    "MemoryStore": ("buffers.memory", "MemoryStore"),
    "RefBuffer": ("buffers.ref_buffer", "RefBuffer"),
    "ReplayBuffer": ("buffers.ref_buffer", "RefBuffer"),
    **{name: ("buffers.store", name) for name in ("Gathered", "KeyNotFound", "ObjectStore", "StoreError", "StoreFull")},
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    return getattr(importlib.import_module(module), attribute)


__all__ = [
    "Gathered", "KeyNotFound", "MemoryStore", "ObjectStore", "RefBuffer", "ReplayBuffer", "RolloutBatch", "StoreError",
    "StoreFull", "decode", "encode", "encode_parts",
]
