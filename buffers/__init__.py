"""Where rollout data lives: the codec, the ObjectStore protocol, its backends and the ref buffer.
`ReplayBuffer`, its old name (it never replayed: reuse happens in the learner's ReplayWindow), is an
alias of `RefBuffer` for one release (0.1.x) and goes in the next."""

from buffers.codec import RolloutBatch, decode, encode
from buffers.memory import MemoryStore
from buffers.ref_buffer import RefBuffer
from buffers.store import KeyNotFound, ObjectStore, StoreError, StoreFull

ReplayBuffer = RefBuffer

__all__ = [
    "KeyNotFound", "MemoryStore", "ObjectStore", "RefBuffer", "ReplayBuffer", "RolloutBatch", "StoreError",
    "StoreFull", "decode", "encode",
]
