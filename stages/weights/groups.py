"""Process groups outside torch's default group, for weight broadcasts between two parties.

`pair_group(port, name, rank)` forms a 2-member group (gloo on CPU, nccl on GPU) by TCP rendezvous
on 127.0.0.1:port, with rank 0 hosting the store: the same rendezvous SGLang performs on its side
of `init_weights_update_group`, so either end may be an SGLang server. Neither end needs (or
touches) `torch.distributed`'s default process group.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

_LOCK = threading.Lock()


def pair_group(
    port: int, name: str, rank: int, backend: str = "gloo", timeout_s: float = 120.0, host: str = "127.0.0.1"
) -> Any:
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=timeout_s)
    # the rendezvous waits for the other party (up to the timeout): outside the lock, so a party that
    # never comes holds up no other pair's group
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{port}", rank, 2, timeout=timeout))
    store.set_timeout(timeout)
    with _LOCK:  # torch's group registry is process-global
        group, _ = _new_process_group_helper(
            world_size, rank, [], backend, PrefixStore(name, store), group_name=name, timeout=timeout
        )
        _world.pg_group_ranks[group] = {0: 0, 1: 1}
        return group
