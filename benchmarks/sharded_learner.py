"""The learner of N ranks against the learner of one, on this machine (gloo on CPU, real processes).

    python benchmarks/sharded_learner.py [--steps 5] [--push-mib 64,512] [--skip-push]

- parity: the weights after `--steps` steps on the same groups, 2 ranks (micro-batches, FSDP2) vs 1
  (max abs difference; goal <= 1e-5 in fp32);
- state bytes per rank: parameters + gradients + AdamW moments held by rank 0 at N = 2, over the same at
  N = 1 (goal <= 0.55: half, plus the rows an uneven split gives rank 0);
- step time at N = 2 over N = 1 on the same groups (reported: 2 cores cannot show scaling, both ranks
  and their gloo traffic share them);
- push from shards vs gather (mooncake_p2p, one engine process, at each of `--push-mib` MiB of fp32
  weights): every rank writes its own rows straight into the engine's receive slot, against rank 0
  gathering every parameter and writing it all (goal <= 0.8), with each rank's peak memory while pushing.

Last stdout line: one JSON object with "figures", "reference" (the one-rank learner, or the gather) and
"ratios": parity_max_abs_diff, state_bytes_per_rank_vs_single, step_s_vs_single, push_from_shards_vs_gather.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from weights import Peer  # noqa: E402  (benchmarks/weights.py's engine process)

from stages.data.model import make_tiny_model  # noqa: E402
from stages.learner import GRPOLearner  # noqa: E402
from stages.learner.ranks import RankedTrainer, RankGroup  # noqa: E402
from stages.learner.step import PolicyTrainer  # noqa: E402
from stages.weights.mooncake_p2p import MooncakeP2PTransport  # noqa: E402
from tests.stages.learner.test_ranks import groups  # noqa: E402  (the parity test's groups)

MODELS = {64: {"hidden_size": 256, "layers": 17}, 512: {"hidden_size": 768, "layers": 15}}  # ~MiB of fp32 weights
BUCKET = 32 << 20


def state_bytes(trainer: PolicyTrainer) -> int:
    """Bytes of parameters, gradients and optimizer state this rank holds (its shards when sharded)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's own shard

    total = 0
    for p in trainer.model.parameters():
        total += local(p).nbytes + (local(p.grad).nbytes if p.grad is not None else 0)
    for state in trainer.optimizer.state.values():
        total += sum(local(v).nbytes for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total


def timed_steps(trainer, steps: int) -> list[float]:
    seconds = []
    for step in range(steps):
        t0 = time.perf_counter()
        trainer.train(groups(step, n=16), 1.0)
        seconds.append(time.perf_counter() - t0)
    return seconds


def compare_learners(folder: Path, steps: int) -> tuple[dict, dict, dict]:
    spec = GRPOLearner(folder, device="cpu", micro_batch_tokens=256)  # the default lr
    one = PolicyTrainer(spec, 1000)
    one.schedule(0)
    one_s = timed_steps(one, steps)
    group = RankGroup(replace(spec, world_size=2), steps=1000)
    group.spawn()
    group.join()
    try:
        two = RankedTrainer(PolicyTrainer(replace(spec, world_size=2), 1000, world_size=2), group)
        two.schedule(0)
        two_s = timed_steps(two, steps)
        a, b = one.weights(), two.weights()
        diff = max(float((a[k] - b[k]).abs().max()) for k in a)
        sharded_bytes = state_bytes(two.trainer)
    finally:
        group.close()
    reference = {"step_s_median": round(statistics.median(one_s), 4), "state_bytes": state_bytes(one)}
    figures = {"step_s_median": round(statistics.median(two_s), 4), "state_bytes_rank0": sharded_bytes,
               "parity_max_abs_diff": diff, "steps": steps}
    ratios = {"parity_max_abs_diff": diff,
              "state_bytes_per_rank_vs_single": round(sharded_bytes / reference["state_bytes"], 4),
              "step_s_vs_single": round(figures["step_s_median"] / reference["step_s_median"], 3)}
    return figures, reference, ratios


class PeakRSS:
    """The most resident memory each of `pids` held above its level at the start, sampled every 5 ms."""

    def __init__(self, pids: list[int]) -> None:
        self.pids, self.base = pids, [self._rss(p) for p in pids]
        self.peak = list(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def _rss(pid: int) -> int:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = [max(p, self._rss(pid)) for p, pid in zip(self.peak, self.pids, strict=True)]

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def above(self) -> list[int]:
        return [p - b for p, b in zip(self.peak, self.base, strict=True)]


async def timed_pushes(transport: MooncakeP2PTransport, ranked: RankedTrainer, version: int, sharded: bool,
                       pids: list[int], repeats: int = 3) -> dict:
    seconds, peaks = [], []
    for i in range(repeats):
        with PeakRSS(pids) as rss:
            t0 = time.perf_counter()
            if sharded:
                await transport.publish_shards(version + i, ranked)
            else:  # gather every parameter on rank 0, then push the whole version from there
                await transport.publish(version + i, await anyio.to_thread.run_sync(ranked.weights))
            seconds.append(time.perf_counter() - t0)
        peaks.append(rss.above())
    return {"push_s_median": round(statistics.median(seconds), 4),
            "peak_extra_mib_per_rank": [round(max(p[r] for p in peaks) / 2**20, 1) for r in range(len(pids))]}


def compare_pushes(tmp: Path, mib: int) -> tuple[dict, dict]:
    folder = make_tiny_model(tmp / f"model-{mib}", **MODELS[mib])
    spec = GRPOLearner(folder, device="cpu", world_size=2)
    group = RankGroup(spec, steps=10)
    group.spawn()
    group.join()
    peer = Peer()
    try:
        ranked = RankedTrainer(PolicyTrainer(spec, 10, world_size=2), group)
        nbytes = sum(p.numel() * 4 for p in ranked.model.parameters())
        pids = [os.getpid(), group.helpers[0].pid]

        async def both() -> tuple[dict, dict]:
            transport = MooncakeP2PTransport(bucket_bytes=BUCKET)
            transport.subscribe(peer)
            await transport.publish_shards(1, ranked)  # warm: hello, slots, registration, the plan
            sharded = await timed_pushes(transport, ranked, 2, True, pids)
            gathered = await timed_pushes(transport, ranked, 10, False, pids)
            return sharded, gathered

        sharded, gathered = anyio.run(both)
    finally:
        peer.stop()
        group.close()
    return {**sharded, "weight_mib": round(nbytes / 2**20, 1), "bucket_mib": BUCKET >> 20}, gathered


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--push-mib", default="64,512")
    p.add_argument("--skip-push", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="baton-sharded-") as tmp:
        folder = make_tiny_model(Path(tmp) / "model", hidden_size=128, layers=4)
        figures, reference, ratios = compare_learners(folder, a.steps)
        for mib in ([] if a.skip_push else [int(x) for x in a.push_mib.split(",")]):
            figures[f"push_{mib}mib"], reference[f"push_{mib}mib_gather"] = compare_pushes(Path(tmp), mib)
            ratios[f"push_from_shards_vs_gather_{mib}mib"] = round(
                figures[f"push_{mib}mib"]["push_s_median"] / reference[f"push_{mib}mib_gather"]["push_s_median"], 3)
            print(f"{mib} MiB: from the shards {figures[f'push_{mib}mib']}, "
                  f"gathered {reference[f'push_{mib}mib_gather']}")
    print(f"2 ranks vs 1: weights within {ratios['parity_max_abs_diff']:.2e} after {a.steps} steps; rank 0 holds "
          f"{figures['state_bytes_rank0']} state bytes vs {reference['state_bytes']} "
          f"(x{ratios['state_bytes_per_rank_vs_single']}); step {figures['step_s_median']} s vs "
          f"{reference['step_s_median']} s (x{ratios['step_s_vs_single']})")
    print(json.dumps({"figures": figures, "reference": reference, "ratios": ratios}))


if __name__ == "__main__":
    main()
