"""An engine process for the weight-transport tests: `python tests/p2p_peer.py MODEL_DIR`.

It hosts a real TorchEngine behind the engine-side receivers (slots, disk, delta, broadcast) and
serves length-prefixed msgpack requests on stdin/stdout (no pickle): [box, header] -> reply bytes.
Besides the receivers' boxes it answers "state": the engine applies what it was given and replies
[version, rejected so far, xxh3 of every parameter's bytes].
"""

from __future__ import annotations

import os
import struct
import sys

import anyio
import msgspec
import torch
import xxhash

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def read_frame(stream) -> bytes | None:
    head = stream.read(4)
    if len(head) < 4:
        return None
    return stream.read(struct.unpack("<I", head)[0])


def write_frame(stream, data: bytes) -> None:
    stream.write(struct.pack("<I", len(data)) + data)
    stream.flush()


def digest(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    return {
        n: xxhash.xxh3_64_intdigest(t.detach().contiguous().view(-1).view(torch.uint8).numpy())
        for n, t in tensors.items()
    }


async def main(model_dir: str) -> None:
    from stages.engines.torch import TorchEngine
    from stages.weights.broadcast import BroadcastReceiver
    from stages.weights.delta import DeltaReceiver
    from stages.weights.disk import DiskReceiver
    from stages.weights.mooncake_p2p import SlotReceiver

    torch.set_num_threads(1)
    engine = TorchEngine(model_dir, name="peer")
    await engine.start()
    receivers = [SlotReceiver([engine]), DiskReceiver([engine]), DeltaReceiver([engine]), BroadcastReceiver([engine])]
    handlers = {box: handler for r in receivers for box, handler in r.handlers().items()}
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while (frame := await anyio.to_thread.run_sync(read_frame, stdin)) is not None:
        box, header = msgspec.msgpack.decode(frame)
        if box == "state":
            engine._apply_staged()
            rejected = sum(r.rejected for r in receivers)
            reply = msgspec.msgpack.encode([engine.version, rejected, digest(engine._model.state_dict())])
        else:
            reply = await handlers[box](header, None)
        write_frame(stdout, reply)
    receivers[0].close()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
