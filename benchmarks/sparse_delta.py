"""Sparse weight deltas over `mooncake_p2p`: a fp32 learner trains a random-init Qwen2-shaped model
(about 122M parameters: hidden 768, 12 layers, vocab 32k, untied head) with AdamW on random tokens
and publishes every version to an engine process twice, in bf16:
  sparse   `MooncakeP2PTransport(engine_dtype="bfloat16", sparse=True)`: per bucket the changed
           elements (indices or bitmask, and values) against what the receiving slot can start from
  full     `MooncakeP2PTransport(engine_dtype="bfloat16")`: the whole bf16 state every version
The engine process (this file with `--peer`) holds one receiver for each; after every version both
engines' weights are hashed and must be bit-identical. Steps run at lr 1e-6, then at 1e-5.

Per step (stderr table, and `steps` in the JSON): the fraction of bf16 elements that changed since
the previous version (`changed_frac`), bytes sent against a full push, the forms chosen, both
publish times and how much of each was packing. Ratios (last stdout line, JSON):
`sparse_bytes_vs_full` (goal <= 0.05 at lr 1e-6) and `sparse_push_vs_full` (publish seconds, goal
<= 0.2), each also per learning rate. Both publishes include packing (converting the fp32 weights
to bf16 and checksumming them); `after_packing@lr` compares the rest (sparse: the diff, the payload
write, the engine's rebuild and verification; full: the whole write and the verification).
Everything runs on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import msgspec
import numpy as np
import torch
import xxhash

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stages.weights.mooncake_p2p import MooncakeP2PTransport, SlotReceiver  # noqa: E402
from tests.helpers.p2p_peer import read_frame, write_frame  # noqa: E402

KINDS = ("sparse", "full")


# ---------------------------------------------------------------- engine process


class Keeper:
    """An engine that runs on what it receives (views over its receive slot)."""

    def __init__(self, name: str) -> None:
        self.name, self.version, self.tensors = name, 0, {}

    async def receive_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self.version, self.tensors = version, tensors

    def digest(self) -> int:
        h = xxhash.xxh3_64()
        for name in sorted(self.tensors):
            h.update(name.encode())
            h.update(self.tensors[name].contiguous().view(-1).view(torch.uint8).numpy())
        return h.intdigest()


async def peer() -> None:
    torch.set_num_threads(1)
    engines = {kind: Keeper(kind) for kind in KINDS}
    receivers = {kind: SlotReceiver([engines[kind]]) for kind in KINDS}
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while (frame := await anyio.to_thread.run_sync(read_frame, stdin)) is not None:
        box, header = msgspec.msgpack.decode(frame)
        kind, _, box = box.partition("/")
        if box == "digest":
            reply = msgspec.msgpack.encode([engines[kind].version, engines[kind].digest()])
        else:
            reply = await receivers[kind].handlers()[box](header, None)
        write_frame(stdout, reply)
    for receiver in receivers.values():
        receiver.close()


# ---------------------------------------------------------------- learner process


class Peer:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            ["nice", "-n", "5", sys.executable, __file__, "--peer"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self.lock = threading.Lock()

    def call(self, box: str, header: bytes) -> bytes | None:
        with self.lock:
            write_frame(self.proc.stdin, msgspec.msgpack.encode([box, header]))
            return read_frame(self.proc.stdout)

    def asker(self, kind: str):
        peer = self

        class Asker:
            name = f"engine-{kind}"

            async def ask(self, box: str, header: bytes) -> bytes | None:
                return await anyio.to_thread.run_sync(peer.call, f"{kind}/{box}", header)

        return Asker()

    async def digest(self, kind: str) -> tuple[int, int]:
        return tuple(msgspec.msgpack.decode(await anyio.to_thread.run_sync(self.call, f"{kind}/digest", b"")))

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def make_model(args) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers, num_attention_heads=12, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).float()


def train_step(model, optimizer, args, step: int) -> float:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def changed_frac(transport: MooncakeP2PTransport, version: int) -> float:
    """Elements (bf16 words) that differ between `version` and the one before, as packed by the learner."""
    versions = transport._planner.versions
    new, old = versions.get(version), versions.get(version - 1)
    return float(np.count_nonzero(new.view(np.uint16) != old.view(np.uint16)) / (new.nbytes // 2))


def time_packing(transport: MooncakeP2PTransport) -> None:
    """Record in `transport.pack_s` how long packing the last version took (converting to bf16 and
    checksumming: the same work for both transports, before either sends a byte)."""
    stage = transport._planner.stage

    def timed(*args):
        started = time.perf_counter()
        packed = stage(*args)
        transport.pack_s = time.perf_counter() - started
        return packed

    transport._planner.stage = timed


async def publish(transport, version: int, state: dict) -> tuple[float, dict]:
    before = dict(transport.stats)
    t0 = time.perf_counter()
    await transport.publish(version, state)
    return time.perf_counter() - t0, {k: transport.stats[k] - before[k] for k in transport.stats}


async def run(args) -> dict:
    torch.set_num_threads(args.threads)
    model = make_model(args)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    peer = Peer()
    transports = {
        "sparse": MooncakeP2PTransport(engine_dtype="bfloat16", sparse=True, retries=0),
        "full": MooncakeP2PTransport(engine_dtype="bfloat16", retries=0),
    }
    for kind, transport in transports.items():
        transport.subscribe(peer.asker(kind))
        time_packing(transport)
    steps, version = [], 1
    try:
        for transport in transports.values():
            await transport.publish(version, model.state_dict())
        for lr in args.lrs:
            for group in optimizer.param_groups:
                group["lr"] = lr
            for _ in range(args.steps):
                t0 = time.perf_counter()
                loss = await anyio.to_thread.run_sync(train_step, model, optimizer, args, version)
                step_s, version = time.perf_counter() - t0, version + 1
                state = model.state_dict()
                sparse_s, sparse = await publish(transports["sparse"], version, state)
                full_s, full = await publish(transports["full"], version, state)
                digests = {kind: await peer.digest(kind) for kind in KINDS}
                steps.append({
                    "version": version, "lr": lr, "loss": round(loss, 4), "train_s": round(step_s, 3),
                    "changed_frac": round(changed_frac(transports["sparse"], version), 6),
                    "sent_changed_frac": round(sparse["changed"] / sparse["elements"], 6),
                    "sparse_bytes": int(sparse["bytes"]), "full_bytes": int(full["bytes"]),
                    "forms": {f: int(sparse[f"buckets_{f}"]) for f in ("index", "bitmask", "full")},
                    "sparse_s": round(sparse_s, 4), "full_s": round(full_s, 4),
                    "sparse_pack_s": round(transports["sparse"].pack_s, 4),
                    "full_pack_s": round(transports["full"].pack_s, 4),
                    "identical": digests["sparse"] == digests["full"] and digests["sparse"][0] == version,
                })
                print(json.dumps(steps[-1]), file=sys.stderr, flush=True)
        fallbacks = {k: int(transports["sparse"].stats[k]) for k in ("full_sends", "refused")}
    finally:
        for transport in transports.values():
            await transport.close()
        peer.stop()
    return summary(steps, params, fallbacks)


def summary(steps: list[dict], params: int, fallbacks: dict) -> dict:
    ratios = {}
    for lr in sorted({s["lr"] for s in steps}):
        at = [s for s in steps if s["lr"] == lr]
        sent, full = sum(s["sparse_bytes"] for s in at), sum(s["full_bytes"] for s in at)
        ratios[f"sparse_bytes_vs_full@{lr:g}"] = round(sent / full, 4)
        ratios[f"sparse_push_vs_full@{lr:g}"] = round(sum(s["sparse_s"] for s in at) / sum(s["full_s"] for s in at), 4)
        after = [(s["sparse_s"] - s["sparse_pack_s"], s["full_s"] - s["full_pack_s"]) for s in at]
        ratios[f"after_packing@{lr:g}"] = round(sum(a for a, _ in after) / sum(b for _, b in after), 4)
        ratios[f"changed_frac@{lr:g}"] = round(float(np.mean([s["changed_frac"] for s in at])), 6)
    low = min(s["lr"] for s in steps)
    ratios["sparse_bytes_vs_full"] = ratios[f"sparse_bytes_vs_full@{low:g}"]
    ratios["sparse_push_vs_full"] = ratios[f"sparse_push_vs_full@{low:g}"]
    return {
        "benchmark": "sparse_delta", "params": params, "bf16_bytes": steps[0]["full_bytes"],
        "all_identical": all(s["identical"] for s in steps), "fallbacks": fallbacks,
        "ratios": ratios, "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=2, help="training steps per learning rate")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.peer:
        anyio.run(peer)
        return
    print(json.dumps(anyio.run(run, args)))


if __name__ == "__main__":
    main()
