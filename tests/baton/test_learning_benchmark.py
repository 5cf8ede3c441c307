"""benchmarks/learning.py's figures from rows it would record, and its rows validating with the config they build
on (a row that fails to start shows only as an error in a matrix of an hour: k = 0 on the quickstart was refused so)."""

from __future__ import annotations

import argparse

from baton.schema import load_run_config
from benchmarks import learning


def row(k: int, seed: int, versions: int | None, seconds: float | None, objective: str = "m2po") -> dict:
    return {"task": "reverse2", "k": k, "seed": seed, "objective": objective, "reached": versions is not None,
            "versions_to_target": versions, "seconds_to_target": seconds,
            "policy_version_at_target": versions - k if versions is not None else None}  # staleness k throughout


def test_versions_against_k2_take_the_worst_seed_and_need_every_seed() -> None:
    rows = [row(2, 0, 300, 60.0), row(2, 1, 400, 80.0), row(8, 0, 330, 40.0), row(8, 1, 520, 50.0),
            row(32, 0, 350, 30.0), row(32, 1, None, None)]
    ratios = learning.summarise(rows)["ratios"]
    assert ratios["versions_vs_k2/reverse2/k8/m2po"] == 1.3  # seed 1: 520 / 400, worse than seed 0's 1.1
    assert ratios["versions_vs_k2/reverse2/k32/m2po"] is None  # seed 1 never reached the target
    assert ratios["reached_fraction"] == round(5 / 6, 3)
    # counted by the weights that made the target's samples: seed 1 (520 - 8) / (400 - 2)
    assert ratios["policy_versions_vs_k2/reverse2/k8/m2po"] == round(512 / 398, 3)


def test_the_policy_version_of_a_target_is_its_version_less_the_staleness() -> None:
    assert learning._policy_version({"version": 340, "staleness_mean": 7.9}) == 332
    assert learning._policy_version({"version": 50}) == 50  # an evaluation: the weights it evaluated
    assert learning._policy_version(None) is None


def test_seconds_against_sync_compare_medians_and_take_sync_of_any_objective() -> None:
    rows = [row(0, 0, 280, 100.0, "none"), row(0, 1, 300, 140.0, "none"),
            row(2, 0, 300, 60.0), row(2, 1, 400, 80.0), row(8, 0, None, None), row(8, 1, None, None)]
    ratios = learning.summarise(rows)["ratios"]
    assert ratios["seconds_vs_sync/reverse2/k2/m2po"] == round(70.0 / 120.0, 3)
    assert ratios["seconds_vs_sync/reverse2/k8/m2po"] is None
    assert not any(key.startswith("seconds_vs_sync") for key in learning.summarise(rows[2:])["ratios"])


def test_the_ray_form_of_a_row_is_a_config_baton_accepts(tmp_path) -> None:
    args = argparse.Namespace(correction="decoupled", runtime="ray", overrides=[])
    config, task_sets = learning.TASKS["reverse3"]
    for k in (0, 8):
        sets = [*task_sets, f"run_root='{tmp_path}'", *learning.objective_sets(k, "m2po", args), *learning.RAY_SETS]
        cfg = load_run_config(config, sets)
        assert cfg.runtime == "ray" and cfg.store.kind == "ray" and cfg.weights.transport == "mooncake_p2p"
        assert cfg.staleness.k == k and cfg.correction.kind == "m2po"


def test_without_objectives_a_row_takes_the_configs_auto_or_the_correction_asked(tmp_path) -> None:
    config, task_sets = learning.TASKS["reverse2"]

    def kind(k: int, correction: str | None) -> str:
        args = argparse.Namespace(correction=correction, runtime="local", overrides=[])
        sets = [*task_sets, f"run_root='{tmp_path}'", *learning.objective_sets(k, None, args)]
        return load_run_config(config, sets).correction.kind

    assert [kind(k, None) for k in (0, 2, 8)] == ["none", "none", "m2po"]  # auto: m2po above k = 2
    assert [kind(k, "decoupled") for k in (2, 8)] == ["none", "decoupled"]  # --correction: above k = 2 only


def test_with_repeats_a_seed_counts_its_median_run() -> None:
    rows = [row(2, 0, 300, 60.0), row(2, 0, 310, 61.0), row(2, 0, 900, 90.0),  # seed 0 at k = 2: median 310
            row(8, 0, 330, 40.0), row(8, 0, 372, 41.0), row(8, 0, None, None)]  # a miss counts as latest: 372
    assert learning.seed_medians(rows[3:], "versions_to_target") == {0: 372.0}
    assert learning.summarise(rows)["ratios"]["versions_vs_k2/reverse2/k8/m2po"] == round(372 / 310, 3)
    two_misses = [*rows[:3], row(8, 0, 330, 40.0), row(8, 0, None, None), row(8, 0, None, None)]
    assert learning.summarise(two_misses)["ratios"]["versions_vs_k2/reverse2/k8/m2po"] is None


def test_the_defaults_at_k_are_compared_with_the_defaults_at_k2_whatever_objective_each_resolved_to() -> None:
    auto = [{**r, "auto_objective": True} for r in (row(2, 0, 300, 60.0, "none"), row(8, 0, 345, 50.0, "m2po"))]
    assert learning.summarise(auto)["ratios"]["versions_vs_k2/reverse2/k8/m2po"] == 1.15
    # an objective asked for by name above k = 2 is not the defaults: no k = 2 run with it, no ratio
    asked = [auto[0], {**row(8, 0, 345, 50.0, "m2po"), "auto_objective": False}]
    assert "versions_vs_k2/reverse2/k8/m2po" not in learning.summarise(asked)["ratios"]


def test_the_matrix_runs_in_parallel_and_keeps_its_order(monkeypatch, tmp_path) -> None:
    import threading
    import time

    running, most = set(), []

    def fake_run(task, seed, k, a, root, objective=None, repeat=None):
        running.add((seed, k, repeat))
        most.append(len(running))
        time.sleep(0.3 if seed == 0 else 0.05)  # seed 0 ends last
        running.discard((seed, k, repeat))
        return {"task": task, "seed": seed, "k": k, "repeat": repeat, "thread": threading.get_ident()}

    monkeypatch.setattr(learning, "run_once", fake_run)
    args = argparse.Namespace(objectives=None, repeats=2, ks="2,8", tasks="reverse2", seeds="0,1", parallel=3)
    rows = learning.run_matrix(args, tmp_path)
    assert [(r["k"], r["seed"], r["repeat"]) for r in rows] == [
        (k, seed, repeat) for k in (2, 8) for seed in (0, 1) for repeat in (0, 1)]
    assert max(most) == 3 and len({r["thread"] for r in rows}) == 3
