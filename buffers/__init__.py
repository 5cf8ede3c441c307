"""Where rollout data lives: the codec, the ObjectStore protocol, its backends and the replay buffer."""

from buffers.codec import RolloutBatch, decode, encode
from buffers.memory import MemoryStore
from buffers.replay import ReplayBuffer
from buffers.store import KeyNotFound, ObjectStore, StoreError, StoreFull

__all__ = [
    "KeyNotFound", "MemoryStore", "ObjectStore", "ReplayBuffer", "RolloutBatch", "StoreError", "StoreFull",
    "decode", "encode",
]
