"""The Tinker SDK's RL loop against `baton serve` beside `baton run`, on the same model and batch: samples/s.

    pip install -e '.[tinker]'
    python benchmarks/tinker_sdk.py [--steps 30] [--warmup 5]

Both train the quickstart's task (reverse-digits, 2 digits) on the tiny Qwen2 (random init, made here) with a
rank-8 LoRA adapter, 16 groups of 8 samples a step:

- `baton run configs/quickstart-lora.toml` (in this process, `--steps` versions, asynchronous with staleness
  bound 2: the engine generates the next groups while the learner trains);
- `examples/tinker/rl.py`'s loop through the official SDK against a `baton serve` it starts (synchronous, as
  a Tinker client loop is: save the adapter for sampling, sample every group, score, forward_backward,
  optim_step), with the target reward out of reach so it runs every step.

samples/s is over the steps after `--warmup` (start-up left out): sampled completions trained per second.
Where the SDK loop's time goes comes from its own clock (save for sampler, sample, train) and from the cost,
measured here, of what the service does for every new sampler: a torch engine started over the base folder
and the adapter merged and probed in it.

Last stdout line: one JSON object with "figures" and "ratios": sdk_vs_baton_run_samples_per_s. (Not named
tinker.py: a script of that name would shadow the SDK's package on its own path.)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import anyio
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "tinker"))

from common import serving, tiny_model  # noqa: E402
from rl import learn, parse  # noqa: E402

from baton.builder import build_pipeline  # noqa: E402
from baton.config import load_toml, validate  # noqa: E402
from baton.schema import RunConfig  # noqa: E402

GROUPS, GROUP_SIZE = 16, 8


def per_second(ends: list[float], versions: list[int], warmup: int) -> float:
    """Samples/s between the end of step `warmup` and the last one (`ends` seconds, `versions` their steps)."""
    i = versions.index(warmup)
    return (versions[-1] - versions[i]) * GROUPS * GROUP_SIZE / (ends[-1] - ends[i])


def baton_run(model: Path, steps: int, warmup: int, root: Path) -> dict:
    data = load_toml(ROOT / "configs" / "quickstart-lora.toml")
    data.update(steps=steps, run_root=str(root), model={"path": str(model)},
                telemetry={"progress": False, "log_level": "warning"}, checkpoint={"every": 0})
    assert data["learner"]["groups_per_step"] == GROUPS and data["rollout"]["group_size"] == GROUP_SIZE
    summary = build_pipeline(validate(RunConfig, data)).run()
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "version" in r and "t" in r]
    return {"samples_per_s": per_second([r["t"] for r in rows], [r["version"] for r in rows], warmup),
            "reward_end": summary["reward_end"], "seconds": rows[-1]["t"]}


def sdk_loop(folder: Path, steps: int, warmup: int) -> dict:
    args = parse(["--steps", str(steps), "--groups", str(GROUPS), "--group-size", str(GROUP_SIZE),
                  "--target", "2"])
    with serving(folder) as (service, model):
        result = learn(service, model, args)
    ends = result["step_ends_s"]
    return {"samples_per_s": per_second(ends, list(range(1, len(ends) + 1)), warmup),
            "trailing_reward": result["trailing_reward"], "seconds": result["seconds"],
            "seconds_by_phase": result["seconds_by_phase"]}


async def sampler_start_s(model: Path, repeats: int = 3) -> float:
    """What the service pays for each new sampler: a torch engine started over the base folder, an adapter
    merged into it and probed (the median of `repeats`)."""
    from stages.engines.torch import TorchEngine
    from stages.learner import GRPOLearner
    from stages.learner.step import PolicyTrainer
    from stages.service.training import lora_spec
    from stages.weights.adapter import as_received

    trainer = PolicyTrainer(GRPOLearner(model, lora=lora_spec(8, True, True, True), device="cpu"), steps=1)
    adapter = as_received(trainer.weights(1))
    times = []
    for i in range(repeats):
        started = time.monotonic()
        engine = TorchEngine(model, name=f"probe-{i}")
        await engine.start()
        await engine.receive_weights(1, adapter)
        times.append(time.monotonic() - started)
        await engine.stop()
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of samples/s (start-up)")
    a = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="baton-tinker-") as tmp:
        root = Path(tmp)
        model = tiny_model(root)
        run = baton_run(model, a.steps, a.warmup, root / "runs")
        sdk = sdk_loop(root, a.steps, a.warmup)
        start_s = anyio.run(sampler_start_s, model)
    steps_timed = a.steps
    figures = {"steps": a.steps, "warmup": a.warmup, "groups": GROUPS, "group_size": GROUP_SIZE,
               "baton_run": run, "sdk": sdk, "sampler_start_s": round(start_s, 3),
               "sampler_start_share_of_sdk_time": round(start_s * steps_timed / sdk["seconds"], 3)}
    ratios = {"sdk_vs_baton_run_samples_per_s": round(sdk["samples_per_s"] / run["samples_per_s"], 4)}
    print(json.dumps(figures, indent=1), file=sys.stderr)
    print(json.dumps({"figures": figures, "ratios": ratios}))


if __name__ == "__main__":
    main()
