"""Bias accounting: the ledger keys each sample's values by outcome, sparse histograms add up,
admission `pace` vs `eager`, and a real local run that counts trained vs dropped samples."""

from __future__ import annotations

import json
from pathlib import Path

import torch

torch.set_num_threads(1)

import pytest  # noqa: E402

from baton.builder import build_pipeline  # noqa: E402
from baton.config import ConfigError, validate  # noqa: E402
from baton.schema import RunConfig  # noqa: E402
from pipeline.histograms import Bins, merge  # noqa: E402
from pipeline.ledger import Ledger, LedgerError, outcome_of  # noqa: E402
from policies.staleness import MaxStaleness  # noqa: E402
from stages.learner.bias import run_outcomes, step_outcomes  # noqa: E402


def ids(prefix: str, n: int) -> list[str]:
    return [f"{prefix}/{i}" for i in range(n)]


# ------------------------------------------------------------------------------- ledger


def test_ledger_hands_over_values_by_outcome_once() -> None:
    ledger = Ledger(max_uses=2)
    ledger.produced(ids("a", 2), "a", (0, 0), values={"length": [3, 5], "reward": [1.0, 0.0]})
    ledger.produced(ids("b", 2), "b", (0, 0), values={"length": [7, 9], "reward": [0.5, 0.5]})
    ledger.produced(ids("c", 1), "c", (0, 0), values={"length": [2], "reward": [0.25]})
    ledger.produced(ids("d", 1), "d", (0, 0))  # no values: counted in fates, absent from the histograms
    assert ledger.take_settled() == {}
    ledger.trained(ids("a", 2), at_version=0)
    ledger.dropped(ids("b", 2), reason="stale: 3 > 2")
    ledger.dropped(ids("d", 1), reason="stale: 3 > 2")
    assert ledger.take_settled() == {
        "trained": {"length": [3.0, 5.0], "reward": [1.0, 0.0]},
        "dropped:stale": {"length": [7.0, 9.0], "reward": [0.5, 0.5]},
    }
    ledger.trained(ids("a", 2), at_version=1)  # a second use (replay reuse) is not a second sample
    ledger.lost(["c/0"], reason="StoreError: gone")
    assert ledger.take_settled() == {"lost:StoreError": {"length": [2.0], "reward": [0.25]}}
    assert ledger.take_settled() == {}
    assert ledger.balanced()


def test_ledger_rejects_values_that_do_not_match_the_items() -> None:
    with pytest.raises(LedgerError, match=r"values\['reward'\] has 1 entries for 2 items"):
        Ledger().produced(ids("a", 2), "a", (0, 0), values={"reward": [1.0]})


@pytest.mark.parametrize(
    ("fate", "reason", "outcome"),
    [
        ("trained", "", "trained"),
        ("dropped", "stale: 4 > 2", "dropped:stale"),
        ("dropped", "filtered", "dropped:filtered"),
        ("dropped", "", "dropped"),
        ("regenerated", "stale: 3 > 1", "regenerated:stale"),
    ],
)
def test_outcome_is_fate_and_reason_kind(fate: str, reason: str, outcome: str) -> None:
    assert outcome_of(fate, reason) == outcome


# ------------------------------------------------------------------------------- histograms


def test_linear_bins_put_values_on_their_lower_edge() -> None:
    bins = Bins(width=0.1)
    assert bins.count([0.0, 0.05, 0.3, 0.3, 0.99, 1.0]) == {"0": 2, "0.3": 2, "0.9": 1, "1": 1}
    assert bins.count([float("nan")]) == {}


def test_log2_bins_for_sizes() -> None:
    assert Bins(log2=True).count([0, 1, 2, 3, 4, 7, 8, 1000]) == {"0": 1, "1": 1, "2": 2, "4": 2, "8": 1, "512": 1}


def test_histograms_add_up_bin_by_bin() -> None:
    bins = Bins(log2=True)
    a, b = [1, 2, 2, 9], [3, 16, 0]
    assert merge(bins.count(a), bins.count(b)) == bins.count(a + b)
    assert list(merge({"8": 1}, {"2": 1, "16": 2})) == ["2", "8", "16"]  # ordered by edge, not text
    with pytest.raises(ValueError, match="exactly one of"):
        Bins()


def test_run_outcomes_are_the_sum_of_step_outcomes() -> None:
    step1 = {
        "trained": {"length": [1, 2, 2], "reward": [0.0, 0.5, 1.0]},
        "dropped:stale": {"length": [2], "reward": [0.0]},
    }
    step2 = {"trained": {"length": [2], "reward": [1.0]}}
    records = [{"outcomes": step_outcomes(step1)}, {"outcomes": step_outcomes(step2)}, {}]
    total = run_outcomes(records)
    assert total["trained"] == {
        "n": 4,
        "length_mean": 1.75,
        "reward_mean": 0.625,
        "length": {"1": 1, "2": 3},
        "reward": {"0": 1, "0.5": 1, "1": 2},
    }
    assert total["dropped:stale"]["n"] == 1 and total["dropped:stale"]["length"] == {"2": 1}
    json.dumps(total)  # plain JSON for summary.json


# ------------------------------------------------------------------------------- admission


def test_eager_admits_everything_and_pace_keeps_the_window() -> None:
    pace, eager = MaxStaleness(k=1), MaxStaleness(k=1, admission="eager")
    assert pace.admission == "pace"
    assert pace.admit(version=0, started=7, discarded=0, groups_per_step=4)
    assert not pace.admit(version=0, started=8, discarded=0, groups_per_step=4)
    assert eager.admit(version=0, started=10_000, discarded=0, groups_per_step=4)
    assert eager.accept(5, 3) == "drop"  # eager still never trains stale work
    with pytest.raises(ValueError, match="staleness.admission must be 'pace' or 'eager'"):
        MaxStaleness(admission="lazy")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="admission"):
        validate(RunConfig, {"staleness": {"admission": "lazy"}})


# ------------------------------------------------------------------------------- a real run


def _run(tmp_path: Path, admission: str) -> tuple[dict, list[dict], list[dict]]:
    cfg = validate(
        RunConfig,
        {
            "steps": 8,
            "run_root": str(tmp_path / admission),
            "model": {"path": str(tmp_path / "model")},
            "telemetry": {"progress": False, "log_level": "warning"},
            "learner": {"groups_per_step": 4},
            "engine": {"batch_groups": 4},
            "rollout": {"group_size": 4},
            "staleness": {"k": 1},
        },
    )
    pipe = build_pipeline(cfg)
    # `baton check` refuses eager with queues deeper than k steps (they waste work); the Python API lets
    # this test make exactly that waste, to see it counted
    pipe.staleness = MaxStaleness(k=1, admission=admission)
    summary = pipe.run()
    run_dir = Path(summary["run_dir"])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, metrics, json.loads((run_dir / "ledger.json").read_text())


@pytest.mark.slow
def test_histograms_count_trained_and_dropped_and_pace_drops_nothing(tmp_path: Path) -> None:
    eager, eager_metrics, eager_ledger = _run(tmp_path, "eager")
    pace, pace_metrics, _ = _run(tmp_path, "pace")
    steps, trained = 8, 8 * 4 * 4

    for summary, metrics in ((eager, eager_metrics), (pace, pace_metrics)):
        outcomes = summary["outcomes"]
        assert outcomes["trained"]["n"] == summary["samples"]["trained"] == trained
        assert sum(outcomes["trained"]["length"].values()) == sum(outcomes["trained"]["reward"].values()) == trained
        for m in metrics:  # the ledger's values (from the producer) agree with the payloads the learner trained on
            assert m["outcomes"]["trained"]["n"] == 16
            assert m["outcomes"]["trained"]["reward_mean"] == pytest.approx(m["reward"], abs=1e-3)
        assert summary["outcomes"] == run_outcomes(metrics)

    # eager makes work the bound then refuses: it is dropped, and its lengths and rewards are counted
    dropped = eager["samples"]["dropped"]
    assert dropped > 0, eager["samples"]
    stale = [r for r in eager_ledger if r["fate"] == "dropped"]
    assert len(stale) == dropped and all(r["reason"].startswith("stale:") for r in stale)
    # drops after the learner's last step (at version `steps`) may settle after its last look at the ledger
    before_end = [r for r in stale if r["versions"][0] + int(r["reason"].split()[1]) < steps]
    counted = eager["outcomes"]["dropped:stale"]["n"]
    assert len(before_end) <= counted <= dropped
    assert sum(eager["outcomes"]["dropped:stale"]["length"].values()) == counted

    # pace: producers wait instead, so nothing is dropped for staleness and nothing is wasted
    assert pace["samples"]["dropped"] == 0 and "dropped:stale" not in pace["outcomes"]
    assert pace["samples"]["produced"] < eager["samples"]["produced"]
    assert (Path(pace["run_dir"]) / "report.png").stat().st_size > 0


def test_report_draws_binned_counts_per_outcome(tmp_path: Path) -> None:
    from pipeline.telemetry import Panel, render_report
    from stages.learner.bias import outcome_panels

    trained_only = [{"outcomes": step_outcomes({"trained": {"length": [1, 2], "reward": [0.0, 1.0]}})}]
    assert outcome_panels(trained_only) == []  # nothing dropped: nothing to compare, no panel
    records = [{"outcomes": step_outcomes({"trained": {"length": [1, 2], "reward": [0.0, 1.0]},
                                           "dropped:stale": {"length": [8], "reward": [0.5]}})}]
    panels = outcome_panels(records)
    assert [set(p.counts) for p in panels] == [{"trained (n=2)", "dropped:stale (n=1)"}] * 2
    assert panels[0].counts["trained (n=2)"] == {"1": 1, "2": 1}
    assert panels[0].counts["dropped:stale (n=1)"] == {"8": 1}
    drawn = render_report(tmp_path / "r.png", records, [*panels, Panel("empty", "hist", counts={})])
    assert drawn == [p.title for p in panels]  # the empty panel is left out
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_tokens_carried_over_from_a_preempted_engine_are_summed_per_outcome() -> None:
    """Samples carrying `carried` (tokens a preempted engine made, continued elsewhere) sum them per outcome and
    over the run; samples without it add nothing."""
    step = step_outcomes({"trained": {"length": [4.0, 6.0], "carried": [2.0, 3.0]}, "dropped:stale": {"length": [5.0]}})
    assert step["trained"]["carried_tokens"] == 5 and "carried_tokens" not in step["dropped:stale"]
    later = step_outcomes({"trained": {"length": [4.0], "carried": [1.0]}})
    assert run_outcomes([{"outcomes": step}, {"outcomes": later}])["trained"]["carried_tokens"] == 6
