"""An engine process for the weight-transport tests: `python tests/helpers/p2p_peer.py MODEL_DIR`,
and `PeerProcess`, the tests' handle on one.

The process hosts a real TorchEngine behind the engine-side receivers (slots, disk, delta, broadcast)
and serves length-prefixed msgpack requests on stdin/stdout (no pickle): [box, header] -> reply bytes.
Besides the receivers' boxes it answers "state": the engine applies what it was given and replies
[version, rejected so far, xxh3 of every parameter's bytes]; and "restart": it becomes what a restarted
engine process is (a fresh engine on the checkpoint, fresh receivers: no version, slots or group),
without paying for a new process.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

import anyio
import msgspec
import torch
import xxhash

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
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


def learner_version(model: Path, seed: int) -> dict[str, torch.Tensor]:
    """A new version of `model`'s weights, as a learner step makes one (seeded)."""
    from stages.data.model import load_model

    torch.manual_seed(seed)
    m = load_model(model)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return m.state_dict()


class PeerProcess:
    """An engine process (this file, run) reached over its stdin/stdout: an `Asker`. Its `ask`
    returns None once the process is gone, as a dead engine process's mailbox does."""

    def __init__(self, model: Path, name: str) -> None:
        self.name = name
        self.proc = subprocess.Popen([sys.executable, __file__, str(model)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, cwd=ROOT)
        self.lock = threading.Lock()

    def _call(self, box: str, header: bytes) -> bytes | None:
        with self.lock:
            try:
                write_frame(self.proc.stdin, msgspec.msgpack.encode([box, header]))
                return read_frame(self.proc.stdout)
            except (BrokenPipeError, OSError):
                return None

    async def ask(self, box: str, header: bytes) -> bytes | None:
        return await anyio.to_thread.run_sync(self._call, box, header)

    async def state(self) -> tuple[int, int, dict[str, int]]:
        return msgspec.msgpack.decode(await self.ask("state", b""))

    async def restart(self) -> None:
        """Become a freshly started engine process (see the module docstring)."""
        assert msgspec.msgpack.decode(await self.ask("restart", b"")) is True

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


class _Engine:
    """What the process hosts: an engine and the receivers of every transport in front of it."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir

    async def start(self) -> _Engine:
        from stages.engines.torch import TorchEngine
        from stages.weights.broadcast import BroadcastReceiver
        from stages.weights.delta import DeltaReceiver
        from stages.weights.disk import DiskReceiver
        from stages.weights.mooncake_p2p import SlotReceiver

        self.engine = TorchEngine(self.model_dir, name="peer")
        await self.engine.start()
        kinds = (SlotReceiver, DiskReceiver, DeltaReceiver, BroadcastReceiver)
        self.receivers = [kind([self.engine]) for kind in kinds]
        self.handlers = {box: handler for r in self.receivers for box, handler in r.handlers().items()}
        return self

    def state(self) -> bytes:
        self.engine._apply_staged()
        rejected = sum(r.rejected for r in self.receivers)
        return msgspec.msgpack.encode([self.engine.version, rejected, digest(self.engine._model.state_dict())])

    async def stop(self) -> None:
        self.receivers[0].close()
        await self.engine.stop()


async def main(model_dir: str) -> None:
    torch.set_num_threads(1)
    hosted = await _Engine(model_dir).start()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while (frame := await anyio.to_thread.run_sync(read_frame, stdin)) is not None:
        box, header = msgspec.msgpack.decode(frame)
        if box == "state":
            reply = hosted.state()
        elif box == "restart":
            await hosted.stop()
            hosted = await _Engine(model_dir).start()
            reply = msgspec.msgpack.encode(True)
        else:
            reply = await hosted.handlers[box](header, None)
        write_frame(stdout, reply)
    await hosted.stop()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
