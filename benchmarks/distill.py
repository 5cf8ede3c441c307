"""On-policy distillation against RL alone, and a classifier reward against a rule reward, on this machine.

    python benchmarks/distill.py [--seeds 3] [--digits 4] [--teacher-steps 1000] [--steps 900] [--skip-learning]
                                 [--quick]

- time to reward 0.8 (the first version whose trailing 10-version mean train reward reaches 0.8; seconds
  from the run's start) on reverse-`--digits` (the quickstart's task and tiny model, lr 1.5e-3), per seed:
  RL alone (GRPO on the task's reward) against pure distillation (`[distill] mode = "loss"`: the reward
  trains nothing) from the same start (the same random-init student and run seed). The teacher is a model
  baton trained and exported: seed 0's RL run continued to `--teacher-steps` versions, then `baton export`
  (goal: distillation's time at most 0.5 of RL alone's; a run that never reaches 0.8 counts as None);
- samples/s of a quickstart-shaped run with a classifier reward (`[reward.classifier]`: a random-init
  Qwen2ForSequenceClassification of the tiny model's shape, on an SGLang server baton launches) against the
  task's rule reward, same config and steps, from the 10th version on (the server's start left out; the
  runs' own samples/s, start included, are reported beside); left out (None) when no SGLang environment exists.

`--quick`: a smoke form (one seed, a handful of versions, no SGLang server: ~20 s); its figures mean nothing.

Last stdout line: one JSON object with "figures" and "ratios": time_to_reward_0_8_distill_vs_rl (the mean
over seeds of each seed's ratio, over the seeds where both reached 0.8), versions_to_reward_0_8_distill_vs_rl,
samples_per_s_classifier_vs_rule.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from baton import cli  # noqa: E402
from baton.builder import build_pipeline  # noqa: E402
from baton.config import load_toml, validate  # noqa: E402
from baton.schema import RunConfig  # noqa: E402
from stages.engines.sglang_server import SGLangUnavailable, sglang_python  # noqa: E402
from tests.helpers.scorers import make_tiny_classifier  # noqa: E402

TARGET_REWARD, WINDOW, LR = 0.8, 10, 1.5e-3


def run(root: Path, name: str, seed: int, steps: int, digits: int, **tables: Any) -> dict:
    """A quickstart-shaped run (reverse-`digits`, student seed `seed`): its summary and per-version metrics."""
    data = load_toml(ROOT / "configs" / "quickstart.toml")
    data.update(name=name, seed=seed, steps=steps, run_root=str(root / "runs"), task={"kind": "reverse-digits",
                "digits": digits}, model={"path": str(root / f"student-{seed}"), "seed": seed},
                telemetry={"progress": False, "log_level": "warning"}, **tables)
    data["learner"]["lr"] = LR
    t0 = time.perf_counter()
    summary = build_pipeline(validate(RunConfig, data)).run()
    summary["wall_s"] = round(time.perf_counter() - t0, 2)
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    summary["metrics"] = [json.loads(line) for line in lines]
    return summary


def to_target(summary: dict) -> dict:
    """The first version whose trailing WINDOW-version mean reward reaches TARGET_REWARD, and its second."""
    metrics = summary["metrics"]
    for i in range(WINDOW - 1, len(metrics)):
        if statistics.mean(m["reward"] for m in metrics[i + 1 - WINDOW: i + 1]) >= TARGET_REWARD:
            return {"version": metrics[i]["version"], "seconds": round(metrics[i]["t"], 2)}
    return {"version": None, "seconds": None}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def make_teacher(root: Path, steps: int, digits: int) -> tuple[Path, dict]:
    """Seed 0's RL run of `steps` versions, its last version (checkpointed at the run's end) exported with
    `baton export`; the run's own time to target."""
    summary = run(root, "teacher", 0, steps, digits, checkpoint={"every": steps})
    folder = root / "teacher"
    code = cli.main(["export", summary["run_dir"], str(folder)])
    if code != 0:
        raise SystemExit(f"baton export {summary['run_dir']} failed with exit code {code}")
    tail = [m["reward"] for m in summary["metrics"][steps - WINDOW: steps]]
    return folder, {"to_target": to_target(summary), "reward_end": round(statistics.mean(tail), 4),
                    "wall_s": summary["wall_s"]}


def learning(root: Path, seeds: int, steps: int, teacher_steps: int, digits: int) -> dict:
    """Per seed: RL alone against pure distillation from the exported teacher, to TARGET_REWARD."""
    teacher, made = make_teacher(root, teacher_steps, digits)
    out: dict[str, Any] = {"teacher": made, "seeds": {}}
    for seed in range(seeds):
        rl = made["to_target"] if seed == 0 and teacher_steps >= steps else to_target(
            run(root, f"rl-{seed}", seed, steps, digits))
        distilled = run(root, f"distill-{seed}", seed, steps, digits,
                        distill={"teacher": str(teacher), "coef": 1.0, "mode": "loss"})
        out["seeds"][seed] = {"rl": rl, "distill": to_target(distilled),
                              "distill_reward_end": round(statistics.mean(
                                  m["reward"] for m in distilled["metrics"][-WINDOW:]), 4)}
    return out


def mean_ratio(seeds: dict, key: str) -> float | None:
    values = [ratio(s["distill"][key], s["rl"][key]) for s in seeds.values()]
    values = [v for v in values if v is not None]
    return round(statistics.mean(values), 4) if values else None


def scoring(root: Path, steps: int) -> dict:
    """samples/s with the task's rule reward, then with a classifier reward on SGLang, same config."""
    try:
        sglang_python()
    except SGLangUnavailable as exc:
        return {"skipped": str(exc)}
    classifier = make_tiny_classifier(root / "rm")
    rule = run(root, "rule-reward", 0, steps, 2, checkpoint={"every": 0})
    model = run(root, "classifier-reward", 0, steps, 2, checkpoint={"every": 0}, reward={
        "weights": {"classifier": 1.0}, "classifier": {"model": str(classifier)}})
    return {"rule_samples_per_s": steady_rate(rule), "classifier_samples_per_s": steady_rate(model),
            "rule_samples_per_s_with_start": rule["samples_per_s"],
            "classifier_samples_per_s_with_start": model["samples_per_s"],
            "classifier_scoring_s": round(statistics.mean(m.get("scoring_s", 0.0) for m in model["metrics"]), 5)}


def steady_rate(summary: dict) -> float | None:
    """Trained samples per second from the run's 10th version to its last (the scorer's server start and the
    first versions left out; the run's own samples_per_s counts them)."""
    metrics = summary["metrics"]
    if len(metrics) <= WINDOW:
        return None
    rows = summary["samples"]["trained"] / len(metrics)
    seconds = metrics[-1]["t"] - metrics[WINDOW - 1]["t"]
    return round(rows * (len(metrics) - WINDOW) / seconds, 1) if seconds > 0 else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--digits", type=int, default=4)
    p.add_argument("--teacher-steps", type=int, default=1000)
    p.add_argument("--steps", type=int, default=900, help="versions of each RL-alone and distillation run")
    p.add_argument("--scoring-steps", type=int, default=60, help="versions of each samples/s run")
    p.add_argument("--skip-learning", action="store_true", help="the samples/s figures alone")
    p.add_argument("--quick", action="store_true", help="a smoke form: one seed, a handful of versions")
    a = p.parse_args()
    if a.quick:
        a.seeds, a.teacher_steps, a.steps, a.scoring_steps = 1, 4, 4, 4
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="baton-distill-") as tmp:
        learned = {"seeds": {}} if a.skip_learning else learning(Path(tmp), a.seeds, a.steps, a.teacher_steps,
                                                                  a.digits)
        scored = {"skipped": "--quick"} if a.quick else scoring(Path(tmp), a.scoring_steps)
    figures = {"learning": learned, "scoring": scored, "seeds": a.seeds, "digits": a.digits,
               "target_reward": TARGET_REWARD}
    ratios = {"time_to_reward_0_8_distill_vs_rl": mean_ratio(learned["seeds"], "seconds"),
              "versions_to_reward_0_8_distill_vs_rl": mean_ratio(learned["seeds"], "version"),
              "samples_per_s_classifier_vs_rule": ratio(scored.get("classifier_samples_per_s"),
                                                        scored.get("rule_samples_per_s"))}
    print(json.dumps(figures, indent=1), file=sys.stderr)
    print(json.dumps({"figures": figures, "ratios": ratios}))


if __name__ == "__main__":
    main()
