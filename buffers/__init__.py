"""Where rollout data lives: the codec, the ObjectStore protocol, its backends and the ref buffer.

`ReplayBuffer` is the old name of `RefBuffer`, kept as an alias for one release (0.1.x); it will be
removed in the next. The buffer never replayed anything: reuse happens in the learner's ReplayWindow.
"""

from buffers.codec import RolloutBatch, decode, encode
from buffers.memory import MemoryStore
from buffers.ref_buffer import RefBuffer
from buffers.store import KeyNotFound, ObjectStore, StoreError, StoreFull

ReplayBuffer = RefBuffer

__all__ = [
    "KeyNotFound", "MemoryStore", "ObjectStore", "RefBuffer", "ReplayBuffer", "RolloutBatch", "StoreError",
    "StoreFull", "decode", "encode",
]
