"""Reuse in a real run at small k (the quickstart's own queues): `max_reuse = 2` at k = 4 passes `baton check`
with replays riding along, and the run's ledger shows the bound held: every use within k, no group used more
than twice, nothing dropped, and every version trained `groups_per_step` new groups plus its replays. And reuse
happens all run long, not only in the warm-up: the derived `staleness.lead` (k - 1) keeps the engine, which
outpaces the learner here, from delivering groups k old, which could never be trained again."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from baton.builder import build_pipeline
from baton.schema import load_run_config
from tests.helpers.ledger_checks import check_ledger

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
K, STEPS, GROUPS = 4, 30, 16


def test_reuse_at_k4_holds_the_bound_in_a_real_run(tmp_path: Path) -> None:
    cfg = load_run_config(ROOT / "configs" / "quickstart.toml", [
        f"staleness.k={K}", "replay.max_reuse=2", f"steps={STEPS}", f"run_root='{tmp_path}'",
        f"model.path='{tmp_path / 'model'}'", "telemetry.progress=false", "telemetry.log_level='warning'",
    ])
    assert cfg.replay.ride_along and cfg.staleness.lead == K - 1  # the quickstart's setting; derived from reuse
    summary = build_pipeline(cfg).run()
    run_dir = Path(summary["run_dir"])
    assert summary["version"] == STEPS and summary["ledger_balanced"]
    assert summary["samples"]["dropped"] == 0 and summary["samples"]["reused"] > 0
    assert summary["max_staleness_trained"] <= K
    records = check_ledger(run_dir, bound=K, max_uses=2)
    first_use = Counter(r["trained_at"][0] for r in records if r["trained_at"])
    group_size = cfg.rollout.group_size
    assert all(first_use[v] == GROUPS * group_size for v in range(STEPS)), first_use  # new groups per version
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["groups_reused"] for m in metrics) * group_size == summary["samples"]["reused"]
    assert all(m["groups_reused"] == GROUPS for m in metrics[1:]), [m["groups_reused"] for m in metrics]
    twice = Counter(len(r["trained_at"]) for r in records if r["trained_at"] and r["trained_at"][0] < STEPS - 1)
    assert set(twice) == {2}, twice  # every sample but the last version's new ones was trained twice
