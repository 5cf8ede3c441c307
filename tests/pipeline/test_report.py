"""The report explains a run at a glance: throughput over a sliding window, staleness on integer bins,
only panels with data, and a timeline of where the time goes; drawn for a real sync run and a real
async run with drops, and for records with eval metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baton.builder import build_pipeline
from baton.config import validate
from baton.schema import RunConfig
from pipeline.dsl import reasons_panels
from pipeline.telemetry import Panel, render_report, sliding_rate
from policies.staleness import MaxStaleness
from stages.learner import GRPOLearner
from stages.learner.timeline import engine_lanes, learner_lane, timeline_panel


def test_sliding_rate_shows_a_stall_that_a_cumulative_average_hides() -> None:
    ts = [1, 2, 3, 4, 10, 11]  # a 6 s stall after t = 4
    rates = sliding_rate(ts, [10] * 6, window_s=2)
    assert rates[:4] == [10, 10, 10, 10]  # t=1: 10 over (0, 1]; later: 20 over 2 s
    assert rates[4] == 5  # only t=10 in (8, 10]
    assert rates[5] == 10
    assert sliding_rate([], [], 5) == []


def test_timeline_lanes_end_each_call_at_its_time() -> None:
    calls = [{"engine": "e0", "t": 3.0, "gate_s": 0.5, "prompts_s": 0.5, "gen_s": 1.0, "put_s": 0.25, "send_s": 0.25}]
    assert engine_lanes(calls) == {"engine e0": [(0.5, 1.0, "waiting"), (1.5, 1.0, "generating"),
                                                 (2.5, 0.5, "storing + sending")]}
    records = [{"t": 5.0, "version_s": 2.0, "collect_s": 0.5, "step_s": 1.0, "push_s": 0.25}]
    assert learner_lane(records) == [(3.0, 0.5, "waiting"), (3.5, 1.0, "computing"), (4.5, 0.25, "pushing weights"),
                                     (4.75, 0.25, "other")]
    late = [{"t": 500.0, "version_s": 1.0, "step_s": 1.0}]
    panel = timeline_panel(None, records + late, horizon_s=60)
    assert panel is not None and panel.until == 60 and panel.lanes == {"learner": learner_lane(records)}
    assert timeline_panel(None, []) is None


def test_panels_without_data_are_left_out_and_titles_are_returned(tmp_path: Path) -> None:
    records = [{"version": 1, "a": 1.0}, {"version": 2, "a": 2.0}]
    drawn = render_report(tmp_path / "r.png", records, [
        Panel("a", "line", x="version", y=["a"]), Panel("missing", "line", x="version", y=["b"]),
        Panel("empty counts", "hist", counts={"x": {}}),
        Panel("lanes", "timeline", lanes={"one": [(0.0, 1.0, "waiting")], "empty": []}),
        Panel("given series", "line", series={"s": ([0.0, 1.0], [1.0, 2.0])}),
    ])
    assert drawn == ["a", "lanes", "given series"]
    assert render_report(tmp_path / "none.png", [], [Panel("missing", "line", y=["b"])]) == []
    assert (tmp_path / "none.png").read_bytes()[:4] == b"\x89PNG"


def test_filtered_gets_a_panel_only_when_something_was(tmp_path: Path) -> None:
    records = [{"version": v, "t": v, "reward": 0.5, "staleness_hist": [0], "filtered_frac": 0.0} for v in (1, 2, 3)]
    titles = [p.title for p in GRPOLearner.report_panels(None, records)]  # type: ignore[arg-type]
    assert not any("filtered" in t for t in titles) and not any(t.startswith("eval") for t in titles)
    records[1]["filtered_frac"] = 0.25
    panels = GRPOLearner.report_panels(None, records)  # type: ignore[arg-type]
    assert any("filtered" in p.title for p in panels)


def _run(tmp_path: Path, mode: str, admission: str | None = None) -> tuple[dict, list[str], list[Panel]]:
    cfg = validate(RunConfig, {
        "name": mode, "mode": mode, "steps": 8, "run_root": str(tmp_path), "model": {"path": str(tmp_path / "model")},
        "telemetry": {"progress": False, "log_level": "warning"},
        "learner": {"groups_per_step": 4}, "engine": {"batch_groups": 4}, "rollout": {"group_size": 4},
        **({"staleness": {"k": 1}} if mode == "async" else {}),
    })
    pipe = build_pipeline(cfg)
    if admission is not None:  # eager admission with k = 1 makes work that goes stale: drops to show
        pipe.staleness = MaxStaleness(k=1, admission=admission)
    summary = pipe.run()
    run_dir = Path(summary["run_dir"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    panels = pipe.consumer.report_panels(records, run_dir)
    drawn = render_report(tmp_path / f"{mode}.png", records, panels)
    assert (run_dir / "report.png").read_bytes()[:4] == b"\x89PNG"
    return summary, drawn, panels


def _by_title(panels: list[Panel], start: str) -> Panel:
    return next(p for p in panels if p.title.startswith(start))


@pytest.mark.slow
def test_report_of_a_sync_run(tmp_path: Path) -> None:
    summary, drawn, panels = _run(tmp_path, "sync")
    assert summary["samples"]["dropped"] == 0
    assert drawn[:2] == ["mean reward per step", "staleness of trained groups"]
    assert drawn[2].startswith("throughput: trained samples/s over the last")
    assert not any(t.startswith("trained vs dropped") or "filtered" in t for t in drawn)  # nothing to compare
    assert drawn[-1].startswith("where the time goes")
    assert _by_title(panels, "staleness").counts == {"trained groups": {"0": 8 * 4}}  # on-policy: one integer bin
    lanes = _by_title(panels, "where the time goes").lanes
    assert set(lanes) == {"engine torch-0", "learner"}
    assert {state for _, _, state in lanes["engine torch-0"]} >= {"generating", "waiting"}
    assert {state for _, _, state in lanes["learner"]} >= {"computing", "waiting"}


@pytest.mark.slow
def test_report_of_an_async_run_with_drops(tmp_path: Path) -> None:
    summary, drawn, panels = _run(tmp_path, "async", admission="eager")
    assert summary["samples"]["dropped"] > 0
    assert [t for t in drawn if t.startswith("trained vs dropped")] == [
        "trained vs dropped: response length (tokens, bins 0, 1, 2-3, 4-7 ...)",
        "trained vs dropped: reward (bins of 0.1)",
    ]
    counts = _by_title(panels, "staleness").counts["trained groups"]
    assert list(counts) == [str(k) for k in range(len(counts))] and len(counts) <= 2  # integer bins 0..k
    assert sum(counts.values()) == 8 * 4
    assert any(set(p.counts) >= {"trained (n=128)"} and len(p.counts) > 1
               for p in panels if p.title.startswith("trained vs dropped"))
    why = reasons_panels(summary["reasons"])  # the run's report.png has it after the consumer's panels
    assert render_report(tmp_path / "why.png", [], why) == ["samples not trained, by reason"]
    dropped = why[0].counts[f"dropped (n={summary['samples']['dropped']})"]
    assert "stale" in dropped and sum(dropped.values()) == summary["samples"]["dropped"]
    assert drawn[-1].startswith("where the time goes")


def test_evaluations_reach_the_summary_and_the_report_tagged_with_their_versions(tmp_path: Path) -> None:
    evaluations = [
        {"version": 0, "version_max": 0, "eval/n": 8, "eval/reward_mean": 0.1, "eval/pass_rate": 0.0},
        {"version": 50, "version_max": 51, "eval/n": 8, "eval/reward_mean": 0.6, "eval/pass_rate": 0.5},
    ]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evaluations))
    learner = GRPOLearner("unused-model-path")
    records = [{"version": v, "reward": 0.5, "staleness_max": 1} for v in range(1, 5)]

    summary = learner.summary(records, tmp_path)
    assert summary["eval"]["first"]["version"] == 0 and summary["eval"]["last"]["version"] == 50
    assert summary["eval"]["last"]["eval/pass_rate"] == 0.5
    assert "eval" not in learner.summary(records, tmp_path / "elsewhere")

    panel = next(p for p in learner.report_panels(records, tmp_path) if p.title.startswith("eval"))
    assert panel.series["eval/pass_rate"] == ([0, 50], [0.0, 0.5])
    drawn = render_report(tmp_path / "report.png", records, learner.report_panels(records, tmp_path), title="e")
    assert any(title.startswith("eval") for title in drawn)
