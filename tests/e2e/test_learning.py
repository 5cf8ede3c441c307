"""The learning test where stale data hurts: with a large learning rate and k = 8 (producers run up
to 8 versions ahead, so most trained tokens come from weights 6-8 versions old), the corrected loss
learns and the uncorrected one does worse.

Why `none` does worse: its PPO clip is centred on the behaviour policy. Once the learner has moved
away from weights that are 7 versions old, most tokens sit outside that clip range in the direction
their advantage pushes, so they give no gradient, and the ones that do pull the policy back towards
the stale weights. `decoupled` and `tis` clip against the learner's own weights at the step's start
and weight each token by pi_prox / pi_behav instead.

What is asserted is an ordering over seeds, not a threshold tuned to one seed: the mean reward over
each run (its learning curve's area, which counts learning speed, not one lucky final step) of the
corrected loss beats `none` on average over the seeds and in a majority of them, and the corrected
runs learn (averaged over the seeds, their late reward is above their early reward; one seed alone
may not learn in 60 steps at this learning rate, as happened once in CI).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

torch.set_num_threads(1)

import pytest  # noqa: E402

from baton.builder import build_pipeline  # noqa: E402
from baton.config import validate  # noqa: E402
from baton.schema import RunConfig  # noqa: E402

pytestmark = pytest.mark.slow

SEEDS = (0, 1, 2)
STEPS = 60


def _rewards(tmp_path: Path, seed: int, correction: str) -> list[float]:
    """Per-step mean train reward of one quickstart-sized run with k = 8 and lr = 1e-2 at every staleness
    (the staleness-scaled lr would take most of the staleness's harm away, and this compares corrections)."""
    cfg = validate(
        RunConfig,
        {
            "name": f"{correction}-{seed}",
            "seed": seed,
            "steps": STEPS,
            "run_root": str(tmp_path / "runs"),
            "model": {"path": str(tmp_path / "model")},  # the same random init for every run
            "telemetry": {"progress": False, "log_level": "warning"},
            "task": {"kind": "reverse-digits", "digits": 2},
            "engine": {"kind": "torch", "batch_groups": 16},
            "rollout": {"group_size": 8},
            "learner": {"lr": 1e-2, "groups_per_step": 16, "lr_staleness_power": 0.0},
            "staleness": {"k": 8},
            "correction": {"kind": correction},
        },
    )
    summary = build_pipeline(cfg).run()
    assert summary["version"] == STEPS and summary["ledger_balanced"]
    metrics = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    stale = statistics.mean(m["staleness_mean"] for m in metrics)
    assert stale >= 3, f"the data should be stale for this test to mean anything; mean staleness {stale}"
    return [m["reward"] for m in metrics]


@pytest.mark.nightly  # two objectives x seeds of stale runs: see pyproject's markers
def test_corrected_loss_beats_uncorrected_on_stale_data(tmp_path: Path) -> None:
    runs = {(kind, seed): _rewards(tmp_path, seed, kind) for seed in SEEDS for kind in ("none", "decoupled")}
    area = {key: statistics.mean(rewards) for key, rewards in runs.items()}
    report = {f"{kind}/{seed}": round(a, 4) for (kind, seed), a in area.items()}
    print("mean reward per run:", report)  # shown with `pytest -rP`
    corrected = [area["decoupled", s] for s in SEEDS]
    uncorrected = [area["none", s] for s in SEEDS]
    assert statistics.mean(corrected) > statistics.mean(uncorrected), report
    assert sum(c > u for c, u in zip(corrected, uncorrected, strict=True)) > len(SEEDS) / 2, report
    quarter = STEPS // 4  # the corrected loss learns: over the seeds, its last quarter beats its first
    gains = [statistics.mean(runs["decoupled", s][-quarter:]) - statistics.mean(runs["decoupled", s][:quarter])
             for s in SEEDS]
    assert statistics.mean(gains) > 0, (gains, report)


NO_COLLAPSE_SEEDS = (0, 1, 2)  # nightly: three runs of 900 versions, as benchmarks/learning.py --tasks reverse3
STEPS_REVERSE3 = 900  # measured (2026-12-02, lr 4e-4): the trailing reward reaches 0.8 at versions 412-678
# A collapsed policy's entropy: the old defaults fell to 0.003 on reverse-4 (926 versions) and stalled, today's
# model at lr 3e-3 to 0.006 on reverse-3 (7 of 8 groups without signal); runs with the current defaults stay at
# 0.02-0.6 before the target (the entropy is averaged over a few answer tokens, most of them already certain), so
# the floor sits below those and above a collapse.
ENTROPY_FLOOR = 0.01
TARGET, WINDOW = 0.8, 20  # trailing mean train reward over WINDOW versions, as benchmarks/learning.py
# Every seed reached TARGET with the current defaults (v678 / 412 / 645); with the lr before (1.5e-3) seed 0 did
# once only at version 691, hovering at 0.76-0.78 first (an async run's timing changes its trajectory). What must
# hold in every run is LEARNED without a collapse on the way; a missed TARGET is reported as an expected failure
# (issue 20).
LEARNED = 0.7


def _quickstart_run(tmp_path: Path, seed: int, steps: int, sets: tuple[str, ...] = (), **task) -> list[dict]:
    """The quickstart config as it ships (its learner and staleness defaults), with `task`, `seed` and `sets`."""
    from baton.schema import load_run_config

    cfg = load_run_config(Path(__file__).resolve().parents[2] / "configs" / "quickstart.toml", [
        f"seed={seed}", f"steps={steps}", f"run_root='{tmp_path / 'runs'}'", f"model.path='{tmp_path / 'model'}'",
        "telemetry.progress=false", "telemetry.log_level='warning'", "checkpoint.every=0",
        *(f"task.{key}={value}" for key, value in task.items()), *sets,
    ])
    summary = build_pipeline(cfg).run()
    assert summary["ledger_balanced"]
    return [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.nightly
@pytest.mark.timeout(900)  # up to 900 versions on a shared 2-core machine (about 90 s alone)
@pytest.mark.parametrize("seed", NO_COLLAPSE_SEEDS)
def test_reverse3_learns_without_collapse(tmp_path: Path, seed: int) -> None:
    """With the quickstart's defaults, reverse-3's trailing reward reaches LEARNED and then TARGET, and until
    it does the policy's entropy never falls below the collapse floor (a collapsed policy samples the same
    answer eight times a group, so its groups stop carrying signal and the reward stalls). Missing TARGET
    after reaching LEARNED without a collapse is issue 20's open plateau: an expected failure, not a pass."""
    records = _quickstart_run(tmp_path, seed, steps=STEPS_REVERSE3, digits=3)
    rewards = [r["reward"] for r in records]
    trailing = [statistics.fmean(rewards[max(0, i + 1 - WINDOW): i + 1]) for i in range(len(rewards))]
    for goal in (LEARNED, TARGET):
        reached = next((i for i, value in enumerate(trailing) if i + 1 >= WINDOW and value >= goal), None)
        if reached is None and goal == TARGET:
            pytest.xfail(f"issue 20: seed {seed} plateaued, its trailing reward peaked at {max(trailing):.3f}")
        assert reached is not None, f"seed {seed}: trailing reward peaked at {max(trailing):.3f}, below {goal}"
        lowest = min(r["entropy"] for r in records[: reached + 1])
        assert lowest >= ENTROPY_FLOOR, f"seed {seed}: entropy fell to {lowest:.4f} before the reward reached {goal}"


K8_SEED, K8_STEPS, K8_REACHES = 0, 400, 0.6  # measured (2026-12-05, night, these defaults): 0.6 at v292, 0.8 at v381


@pytest.mark.nightly
@pytest.mark.timeout(600)
def test_k8_learns_per_version_like_k2(tmp_path: Path) -> None:
    """The quickstart with staleness bound k = 8 and nothing else changed (the defaults above k = 2: `m2po`
    with good samples at weight 1, the full step, the entropy bonus capped at the policy's initial entropy):
    producers run up to 8 versions ahead, and the trailing reward still reaches K8_REACHES within K8_STEPS
    versions (k = 2 reaches 0.8 at about version 315 on this seed)."""
    records = _quickstart_run(tmp_path, K8_SEED, K8_STEPS, sets=("staleness.k=8",))
    assert statistics.fmean(r["staleness_mean"] for r in records[50:]) >= 4, "the data should really be stale"
    rewards = [r["reward"] for r in records]
    trailing = [statistics.fmean(rewards[max(0, i + 1 - WINDOW): i + 1]) for i in range(len(rewards))]
    assert max(trailing[WINDOW - 1:]) >= K8_REACHES, f"k = 8 peaked at {max(trailing):.3f} in {K8_STEPS} versions"
