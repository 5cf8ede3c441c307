"""The segment holder for `benchmarks/datapath.py`: `python benchmarks/_datapath_peer.py MASTER SEGMENT_BYTES`.

Mounts a Mooncake segment of SEGMENT_BYTES, touches all of it once (it fills the segment with
objects and then removes them, so the benchmark does not time the page faults of the segment's
first use), prints "ready", and then sleeps until it gets SIGTERM or SIGINT. It closes its store
before it exits.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import anyio  # noqa: E402

from buffers.mooncake import MooncakeSettings, MooncakeStore  # noqa: E402

PREFAULT_CHUNK = 64 << 20


def prefault(store: MooncakeStore, segment_bytes: int) -> int:
    """Put objects into this process's own segment until it is (nearly) full, then remove them."""
    client, buf = store._client, store.pool.take(PREFAULT_CHUNK)
    buf[:] = 0
    keys = []
    for i in range(segment_bytes // PREFAULT_CHUNK):
        key = f"_datapath_prefault/{i}"
        if client.put_from(key, buf.ctypes.data, PREFAULT_CHUNK, store._config) != 0:
            break
        keys.append(key)
    for key in keys:
        client.remove(key)
    return len(keys)


def main(master: str, segment_bytes: int) -> None:
    def stop(*_: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    store = MooncakeStore(MooncakeSettings(master_server_address=master, global_segment_size=segment_bytes))
    try:
        touched = prefault(store, segment_bytes)
        print(f"ready {touched}", flush=True)
        while True:
            time.sleep(3600)
    finally:
        anyio.run(store.close)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
