"""Pushing weights to an engine process: `mooncake_p2p` against a raw TransferEngine write of the
same bytes, a gloo broadcast and the `disk` transport, in one run; and how long the engine's
generation stalls per update while it keeps decoding.

For each size (`--sizes`, MiB of bf16 weights in 16 MiB tensors) this process is the learner and
`benchmarks/_weights_peer.py` the engine process (TransferEngine receive slots, disk receiver, and
an engine that decodes in a loop and applies a version between two steps by copying it in):
  raw_te       one `batch_transfer_sync_write` of the packed bytes into the engine's slot (reference)
  p2p          `MooncakeP2PTransport.publish`: write each bucket's tensors from the learner's own
               memory into the engine's free slot while checksumming them, commit; the engine
               verifies every bucket and runs on views of the slot from its next decode step
  broadcast    torch.distributed gloo broadcast of the same tensors into the engine process
  disk         `DiskTransport.publish`: safetensors written and renamed, checksum, load, stage
  stall        the longest gap between two decode steps during a p2p push, minus the median step
Ratios (last stdout line, JSON): `p2p_vs_raw_te` = raw_te time / p2p time (goal >= 0.8),
`stall_vs_push` = stall / p2p time (goal <= 0.1), `p2p_vs_broadcast` = broadcast time / p2p time.
A table goes to stderr. Everything runs on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import anyio
import msgspec
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.net import free_port  # noqa: E402
from stages.weights.disk import DiskTransport  # noqa: E402
from stages.weights.groups import pair_group  # noqa: E402
from stages.weights.layout import fill, plan  # noqa: E402
from stages.weights.mooncake_p2p import HELLO, Hello, HelloReply, MooncakeP2PTransport  # noqa: E402
from stages.weights.transfer_engine import transfer_engine  # noqa: E402
from tests.helpers.p2p_peer import read_frame, write_frame  # noqa: E402

TENSOR_MIB = 16


class Peer:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks" / "_weights_peer.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
        )
        self.name, self.lock = "engine", threading.Lock()

    def _call(self, box: str, header: bytes) -> bytes | None:
        with self.lock:
            write_frame(self.proc.stdin, msgspec.msgpack.encode([box, header]))
            return read_frame(self.proc.stdout)

    async def ask(self, box: str, header: bytes) -> bytes | None:
        return await anyio.to_thread.run_sync(self._call, box, header)

    async def steps(self) -> tuple[int, list[float]]:
        return msgspec.msgpack.decode(await self.ask("steps", b""))

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def weights(mib: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = TENSOR_MIB * 2**20 // 2
    return {f"layer{i}.weight": torch.randn(n, generator=g).to(torch.bfloat16) for i in range(mib // TENSOR_MIB)}


class RawWrite:
    """The reference: the same bytes, already packed and registered, written into the engine's slot
    with one `batch_transfer_sync_write` (nothing checksummed, committed or applied)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        layout = plan(0, tensors, 1 << 62)
        self.src = np.zeros(layout.total, dtype=np.uint8)
        fill(self.src, tensors, layout)
        self.te = transfer_engine("tcp", "")
        self.te.register_memory(self.src.ctypes.data, self.src.nbytes)
        self.peer, self.slot = "", 0

    async def connect(self, peer: Peer) -> None:
        hello = Hello(self.src.nbytes)
        reply = msgspec.msgpack.decode(await peer.ask(HELLO, msgspec.msgpack.encode(hello)), type=HelloReply)
        self.peer, self.slot = reply.peer, reply.slots[0]
        self.write()  # warm the connection

    def write(self) -> float:
        t0 = time.perf_counter()
        rc = self.te.batch_transfer_sync_write(self.peer, [self.src.ctypes.data], [self.slot], [self.src.nbytes])
        assert rc == 0, rc
        return time.perf_counter() - t0

    def close(self) -> None:
        self.te.unregister_memory(self.src.ctypes.data)


async def broadcast(peer: Peer, tensors: dict[str, torch.Tensor]) -> float:
    port = free_port()
    names = list(tensors)
    header = msgspec.msgpack.encode([port, names, [list(tensors[n].shape) for n in names]])
    result: dict = {}

    def learner_side() -> None:
        group = pair_group(port, "bench", 0)
        t0 = time.perf_counter()
        for n in names:
            torch.distributed.broadcast(tensors[n], src=0, group=group)
        result["s"] = time.perf_counter() - t0
        torch.distributed.destroy_process_group(group)

    async with anyio.create_task_group() as tg:
        tg.start_soon(peer.ask, "gloo", header)
        await anyio.to_thread.run_sync(learner_side)
    return result["s"]


def stall(steps: list[float], start: float, end: float) -> tuple[float, float]:
    """(longest gap between decode steps that overlaps [start, end], median step) in seconds."""
    gaps = np.diff(np.asarray(steps))
    median = float(np.median(gaps)) if len(gaps) else 0.0
    window = [g for t, g in zip(steps[1:], gaps, strict=True) if t >= start and t - g <= end]
    return (max(window) if window else end - start), median


async def bench_size(mib: int, repeats: int) -> dict:
    peer = Peer()
    try:
        p2p = MooncakeP2PTransport(bucket_bytes=64 << 20)
        p2p.subscribe(peer)
        disk = DiskTransport(root=tempfile.mkdtemp(prefix="baton-bench-weights-"), keep=1)
        disk.subscribe(peer)
        version, p2p_s, stalls, steps_s, disk_s, raw_s, bcast_s = 0, [], [], [], [], [], []
        tensors = weights(mib, 0)  # the learner's parameters: updated in place, version after version
        await p2p.publish(version := version + 1, tensors)  # warm-up: hello, registration
        raw = RawWrite(tensors)
        await raw.connect(peer)
        for _ in range(repeats):  # the four ways interleaved, so a change in the machine's load hits all
            for t in tensors.values():  # an "optimizer step" (outside the timed push)
                t.mul_(-1)
            await peer.steps()  # forget older steps
            t0 = time.perf_counter()
            await p2p.publish(version := version + 1, tensors)
            t1 = time.perf_counter()
            await anyio.sleep(0.3)  # decode steps after the swap, to see its gap
            _, steps = await peer.steps()
            gap, median = stall(steps, t0, time.perf_counter())
            p2p_s.append(t1 - t0)
            stalls.append(max(gap - median, 0.0))
            steps_s.append(median)
            raw_s.append(await anyio.to_thread.run_sync(raw.write))
            bcast_s.append(await broadcast(peer, tensors))
            t0 = time.perf_counter()
            await disk.publish(version := version + 1, tensors)
            disk_s.append(time.perf_counter() - t0)
        raw.close()
        await p2p.close()
    finally:
        peer.stop()
    raw, bcast = statistics.median(raw_s), statistics.median(bcast_s)
    p2p_med, stall_med = statistics.median(p2p_s), statistics.median(stalls)
    return {
        "mib": mib,
        "raw_te_s": round(raw, 3),
        "p2p_s": round(p2p_med, 3),
        "broadcast_s": round(bcast, 3),
        "disk_s": round(statistics.median(disk_s), 3),
        "stall_s": round(stall_med, 4),
        "median_step_s": round(statistics.median(steps_s), 4),
        "raw_te_gib_s": round(mib / 1024 / raw, 2),
        "p2p_gib_s": round(mib / 1024 / p2p_med, 2),
        "ratios": {
            "p2p_vs_raw_te": round(raw / p2p_med, 3),
            "stall_vs_push": round(stall_med / p2p_med, 3),
            "p2p_vs_broadcast": round(bcast / p2p_med, 3),
        },
    }


async def main(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    rows = [await bench_size(int(m), args.repeats) for m in args.sizes.split(",")]
    print(
        f"{'MiB':>6}{'raw TE s':>10}{'p2p s':>8}{'gloo s':>8}{'disk s':>8}{'stall s':>9}"
        f"{'p2p/raw':>9}{'stall/push':>11}{'p2p/gloo':>9}",
        file=sys.stderr,
    )
    for r in rows:
        q = r["ratios"]
        print(
            f"{r['mib']:>6}{r['raw_te_s']:>10}{r['p2p_s']:>8}{r['broadcast_s']:>8}{r['disk_s']:>8}{r['stall_s']:>9}"
            f"{q['p2p_vs_raw_te']:>9}{q['stall_vs_push']:>11}{q['p2p_vs_broadcast']:>9}",
            file=sys.stderr,
        )
    largest = rows[-1]
    return {"sizes": rows, "ratios": largest["ratios"], "ratios_at_mib": largest["mib"]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64,512,2048", help="MiB of bf16 weights, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    print(json.dumps(anyio.run(main, parser.parse_args())))
