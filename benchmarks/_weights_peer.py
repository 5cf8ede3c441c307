"""The engine process of benchmarks/weights.py (not a benchmark itself).

Hosts the engine-side receivers (TransferEngine slots, disk) in front of `StepEngine`, an engine
that keeps decoding (one small matmul per step, in its own thread) and applies a received version
between two steps by making it its parameters (no copy), and whose `receive_weights` returns once
it did, as the torch engine does. Serves
length-prefixed msgpack frames on stdin/stdout: [box, header] -> reply. Extra boxes:
  "steps"      -> [version, step timestamps since the last call]
  "gloo"       [port, names, shapes] -> joins a 2-member gloo group as rank 1, receives a broadcast
               of those bf16 tensors, applies them, replies the seconds it took
"""

from __future__ import annotations

import os
import sys
import threading
import time

import anyio
import msgspec
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from tests.helpers.p2p_peer import read_frame, write_frame  # noqa: E402


class StepEngine:
    name = "step-engine"

    def __init__(self) -> None:
        self.version = 0
        self.params: dict[str, torch.Tensor] = {}
        self._staged: tuple[int, dict[str, torch.Tensor]] | None = None
        self._lock = threading.Lock()
        self.steps: list[float] = []
        self._stop = False
        threading.Thread(target=self._decode, daemon=True).start()

    async def receive_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        with self._lock:
            self._staged = (version, tensors)
        while self.version < version:  # applied between two decode steps
            await anyio.sleep(0.002)

    def _decode(self) -> None:
        a = torch.randn(192, 192)
        while not self._stop:
            with self._lock:
                staged, self._staged = self._staged, None
            if staged is not None:  # between two steps, as the torch engine applies a version
                version, tensors = staged
                self.params = dict(tensors)
                self.version = version
            a = torch.tanh(a @ a) * 0.5
            self.steps.append(time.perf_counter())

    def take_steps(self) -> list[float]:
        steps, self.steps = self.steps, []
        return steps


def receive_broadcast(port: int, names: list[str], shapes: list[list[int]]) -> dict[str, torch.Tensor]:
    from stages.weights.groups import pair_group

    group = pair_group(port, "bench", 1)
    tensors = {}
    for name, shape in zip(names, shapes, strict=True):
        t = torch.empty(shape, dtype=torch.bfloat16)
        torch.distributed.broadcast(t, src=0, group=group)
        tensors[name] = t
    torch.distributed.destroy_process_group(group)
    return tensors


async def main() -> None:
    from stages.weights.disk import DiskReceiver
    from stages.weights.mooncake_p2p import SlotReceiver

    torch.set_num_threads(1)
    engine = StepEngine()
    receivers = [SlotReceiver([engine]), DiskReceiver([engine])]
    handlers = {box: h for r in receivers for box, h in r.handlers().items()}
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while (frame := await anyio.to_thread.run_sync(read_frame, stdin)) is not None:
        box, header = msgspec.msgpack.decode(frame)
        if box == "steps":
            reply = msgspec.msgpack.encode([engine.version, engine.take_steps()])
        elif box == "gloo":
            port, names, shapes = msgspec.msgpack.decode(header)
            t0 = time.perf_counter()
            tensors = await anyio.to_thread.run_sync(receive_broadcast, port, names, shapes)
            await engine.receive_weights(engine.version + 1, tensors)
            reply = msgspec.msgpack.encode(time.perf_counter() - t0)
        else:
            reply = await handlers[box](header, None)
        write_frame(stdout, reply)
    engine._stop = True
    receivers[0].close()


if __name__ == "__main__":
    anyio.run(main)
