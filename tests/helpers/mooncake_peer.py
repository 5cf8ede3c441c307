"""A second process for the Mooncake tests: `python tests/helpers/mooncake_peer.py MASTER SEGMENT_BYTES CMD...`.

Commands (one JSON line of results on stdout when done):
  put KEY SIZE      put deterministic bytes of SIZE under KEY (as a client of the store)
  get KEY SIZE      get KEY and check it equals the deterministic bytes of SIZE
  hold SECONDS      stay alive (holding its segment) for SECONDS, after printing "ready"
"""

from __future__ import annotations

import json
import os
import sys

import anyio
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def payload(size: int) -> bytes:
    return np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()


async def main(master: str, segment: int, args: list[str]) -> None:
    from buffers.mooncake import MooncakeSettings, MooncakeStore

    store = MooncakeStore(MooncakeSettings(master_server_address=master, global_segment_size=segment))
    results = []
    try:
        while args:
            cmd, arg, *rest = args
            if cmd == "put":
                size = int(rest[0])
                await store.put(arg, payload(size))
                results.append(["put", arg, size])
                args = rest[1:]
            elif cmd == "get":
                size = int(rest[0])
                got = await store.get(arg)
                results.append(["get", arg, bytes(got) == payload(size)])
                args = rest[1:]
            elif cmd == "hold":
                print("ready", flush=True)
                await anyio.sleep(float(arg))
                args = rest
            else:
                raise SystemExit(f"unknown command {cmd}")
        print(json.dumps(results), flush=True)
    finally:
        await store.close()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], int(sys.argv[2]), sys.argv[3:])
