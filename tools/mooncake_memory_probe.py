"""Where does memory go when Mooncake Store serves a long run? A put/get/remove loop against a real
`mooncake_master`, with no pipeline around it, sampling the RSS of the master and of this (client)
process as it goes.

    python tools/mooncake_memory_probe.py [--objects 100000] [--bytes 3000] [--segment-mib 1024]
        [--holder-process] [--remove key|regex] [--same-keys] [--lease-ms 1]

Each round puts `--batch` objects of `--bytes` under versioned keys (like the pipeline's
`run/v{n}/{group}/{sample}`), reads them back, and removes them (one `remove` per key, or one
`remove_by_regex` per version). With `--holder-process` the segment is mounted by a child process
(`buffers.mooncake_holder`) and this process is a pure client, so the three RSS figures separate
master, client and segment holder. Prints one JSON line: RSS MB of each role at 10 %, 55 % and the
end, and its growth per 100k objects from 10 % and over the second half; `segment_rss_mb` is the
resident part of the mounted segment's mapping (read from /proc/PID/smaps), which shows how much of
the growth is the segment's pages being touched for the first time rather than a leak.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from buffers.mooncake import MooncakeSettings, MooncakeStore  # noqa: E402
from buffers.mooncake_master import MooncakeMaster  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb(pid: int) -> float:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE / 1e6


def largest_mapping_rss_mb(pid: int, min_bytes: int) -> float:
    """Resident MB of the mappings of at least `min_bytes` (the mounted segment is one of them)."""
    total, size = 0, 0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0] and ":" not in line.split(" ", 1)[0]:
            lo, hi = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
            size = hi - lo
        elif line.startswith("Rss:") and size >= min_bytes:
            total += int(line.split()[1]) * 1024
    return total / 1e6


async def loop(store: MooncakeStore, a: argparse.Namespace, sample) -> None:
    payload = os.urandom(a.bytes)
    rounds = a.objects // a.batch
    for n in range(rounds):
        version = n if a.fresh_keys else 0
        keys = [f"probe/v{version:08d}/g{i // 8}/s{i % 8}" for i in range(a.batch)]
        for key in keys:
            await store.put(key, payload)
        for key in keys:
            got = await store.get(key, len(payload))
            assert bytes(got) == payload
            del got
        if a.remove == "key":
            for key in keys:
                await store.remove(key)
        else:
            await store.remove_matching(f"probe/v{version:08d}/")
        sample(n + 1, rounds)


def transfer_receiver(nbytes: int) -> None:
    """The child of `--writes`: a TransferEngine with `nbytes` registered; prints "port address"
    and stays until its stdin closes."""
    from stages.weights.transfer_engine import transfer_engine

    te = transfer_engine("tcp", "")
    slot = np.zeros(nbytes, dtype=np.uint8)
    assert te.register_memory(slot.ctypes.data, nbytes) == 0
    print(te.get_rpc_port(), slot.ctypes.data, flush=True)
    sys.stdin.read()


def transfer_loop(a: argparse.Namespace) -> None:
    """`--writes N`: N weight-push-shaped writes (`--bytes` in two buckets, as `mooncake_p2p` does
    for the tiny model) from this process's TransferEngine into a child's registered slot."""
    from stages.weights.transfer_engine import transfer_engine

    child = subprocess.Popen([sys.executable, __file__, "--receiver", str(a.bytes)], cwd=ROOT,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    port, slot = (int(x) for x in child.stdout.readline().split())
    te = transfer_engine("tcp", "")
    source = np.ones(a.bytes, dtype=np.uint8)
    assert te.register_memory(source.ctypes.data, a.bytes) == 0
    half = a.bytes // 2
    marks = {}
    for n in range(1, a.writes + 1):
        rc = te.batch_transfer_sync_write(f"127.0.0.1:{port}", [source.ctypes.data, source.ctypes.data + half],
                                          [slot, slot + half], [half, a.bytes - half])
        assert rc == 0, rc
        mark = {max(a.writes // 10, 1): "start", max(a.writes * 55 // 100, 2): "mid", a.writes: "end"}.get(n)
        if mark:
            marks[mark] = {"writer": rss_mb(os.getpid()), "receiver": rss_mb(child.pid), "objects": n}
    child.stdin.close()
    child.wait()
    report(a, marks)


def report(a: argparse.Namespace, marks: dict[str, dict[str, float]]) -> None:
    """One JSON line: each role's RSS at 10 %, 55 % and the end, and its growth per 100k operations."""

    def rate(x: dict[str, float], y: dict[str, float]) -> dict[str, float]:
        return {k: round((y[k] - x[k]) * 1e5 / (y["objects"] - x["objects"]), 2) for k in x if k != "objects"}

    print(json.dumps({
        "args": vars(a),
        **{f"{name}_mb": {k: round(v, 1) for k, v in marks[name].items()} for name in ("start", "mid", "end")},
        "mb_per_100k_objects": rate(marks["start"], marks["end"]),
        "mb_per_100k_objects_second_half": rate(marks["mid"], marks["end"]),
    }))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--objects", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--bytes", type=int, default=3000)
    p.add_argument("--segment-mib", type=int, default=1024)
    p.add_argument("--remove", choices=("key", "regex"), default="key")
    p.add_argument("--same-keys", dest="fresh_keys", action="store_false", help="reuse one version's keys")
    p.add_argument("--holder-process", action="store_true", help="mount the segment in a child process")
    p.add_argument("--lease-ms", type=int, default=1, help="the master's lease after a get (the pipeline's: 500)")
    p.add_argument("--writes", type=int, default=0, help="probe TransferEngine instead: this many 2-bucket writes")
    p.add_argument("--receiver", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.receiver:
        return transfer_receiver(a.receiver)
    if a.writes:
        return transfer_loop(a)
    segment = a.segment_mib << 20
    with MooncakeMaster(lease_ttl_ms=a.lease_ms) as master:
        holder = None
        if a.holder_process:
            holder = subprocess.Popen(
                [sys.executable, "-m", "buffers.mooncake_holder", master.address, str(segment)],
                cwd=ROOT, stdout=subprocess.PIPE, text=True,
            )
            assert holder.stdout.readline().strip() == "ready"
        store = MooncakeStore(MooncakeSettings(master_server_address=master.address,
                                               global_segment_size=0 if holder else segment))
        segment_pid = holder.pid if holder else os.getpid()
        marks: dict[str, dict[str, float]] = {}

        def sample(n: int, rounds: int) -> None:
            mark = {max(rounds // 10, 1): "start", max(rounds * 55 // 100, 2): "mid", rounds: "end"}.get(n)
            if mark:
                marks[mark] = {
                    "mooncake_master": rss_mb(master.pid), "client": rss_mb(os.getpid()),
                    **({"holder": rss_mb(holder.pid)} if holder else {}),
                    "segment_rss_mb": largest_mapping_rss_mb(segment_pid, segment // 2),
                    "objects": n * a.batch,
                }

        try:
            asyncio.run(loop(store, a, sample))
        finally:
            asyncio.run(store.close())
            if holder:
                holder.terminate()
                holder.wait()
    report(a, marks)


if __name__ == "__main__":
    main()
