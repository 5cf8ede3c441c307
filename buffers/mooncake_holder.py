"""A process that only holds a Mooncake segment: `python -m buffers.mooncake_holder MASTER SEGMENT_BYTES`.

It mounts SEGMENT_BYTES into the store on MASTER, prints "ready" once it holds them, and stays until
it is signalled (SIGTERM ends it cleanly; the store.holder_crash fault SIGKILLs it). With
`store.replicas = 2`, Mooncake places the second copy of every object in a segment of another
process: this one.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def main(master: str, segment_bytes: int) -> int:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from buffers.mooncake import MooncakeSettings, MooncakeStore

    store = MooncakeStore(MooncakeSettings(master_server_address=master, global_segment_size=segment_bytes))
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    print("ready", flush=True)
    done.wait()
    store._client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
