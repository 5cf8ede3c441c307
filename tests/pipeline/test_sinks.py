"""Metric sinks: a real short quickstart run writes TensorBoard, W&B (offline) and MLflow (its local store);
each is read back with its own library and holds exactly what metrics.jsonl holds, at the same steps."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import pytest

from baton.builder import build_pipeline
from baton.config import validate
from baton.schema import RunConfig
from pipeline.sinks import JsonlTail, SinkUnavailable, flatten, open_sinks

ALL_SINKS = ["jsonl", "tensorboard", "wandb", "mlflow"]


# ------------------------------------------------------------------------------------------ units


def test_flatten_keeps_numbers_and_joins_nested_keys() -> None:
    record = {
        "version": 3, "reward": 0.5, "ok": True, "name": "x", "staleness_hist": [0, 1],
        "outcomes": {"trained": {"n": 16, "length_mean": 4.5, "length": {"4": 10, "8": 6}}},
    }
    assert flatten(record) == {
        "version": 3.0, "reward": 0.5, "outcomes/trained/n": 16.0, "outcomes/trained/length_mean": 4.5,
    }


def test_jsonl_tail_reads_only_new_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"version": 1}\n')
    fresh, resumed = JsonlTail(path), JsonlTail(path, from_end=True)
    assert fresh.read() == [{"version": 1}] and resumed.read() == []
    with path.open("a") as f:
        f.write('{"version": 2}\n{"vers')  # the writer is mid-line
    assert fresh.read() == [{"version": 2}] == resumed.read()
    assert fresh.read() == []
    with path.open("a") as f:
        f.write('ion": 3}\n')
    assert fresh.read() == [{"version": 3}]


@pytest.mark.parametrize(("sink", "module"), [("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb"),
                                              ("mlflow", "mlflow")])
def test_a_missing_library_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sink: str,
                                           module: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    with pytest.raises(SinkUnavailable, match=rf"pip install 'baton-rl\[{sink}\]'"):
        open_sinks(["jsonl", sink], tmp_path, "run", {})


def test_an_unknown_sink_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown.*'csv'"):
        open_sinks(["jsonl", "csv"], tmp_path, "run", {})


# ------------------------------------------------------------------------------- a real short run


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, monkeypatch_module) -> tuple[dict, list[dict]]:
    tmp = tmp_path_factory.mktemp("sinks")
    monkeypatch_module.delenv("WANDB_MODE", raising=False)
    monkeypatch_module.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = validate(RunConfig, {
        "name": "sinks", "steps": 4, "run_root": str(tmp), "model": {"path": str(tmp / "model")},
        "telemetry": {"progress": False, "log_level": "warning"},
        "learner": {"groups_per_step": 2}, "engine": {"batch_groups": 2}, "rollout": {"group_size": 4},
    })
    pipe = build_pipeline(cfg)
    pipe.sinks = ALL_SINKS
    summary = pipe.run()
    run_dir = Path(summary["run_dir"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in records] == [1, 2, 3, 4]
    return summary, records


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def expected(records: list[dict]) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} as every sink must hold it."""
    series: dict[str, dict[int, float]] = {}
    for record in records:
        for key, value in flatten(record).items():
            if key != "version":
                series.setdefault(key, {})[record["version"]] = value
    return series


def assert_same(got: dict[str, dict[int, float]], want: dict[str, dict[int, float]], rel: float = 0.0) -> None:
    assert set(want) <= set(got), sorted(set(want) - set(got))
    for key, steps in want.items():
        assert set(got[key]) == set(steps), key
        for step, value in steps.items():
            assert math.isclose(got[key][step], value, rel_tol=rel, abs_tol=rel), (key, step, got[key][step], value)


@pytest.mark.slow
def test_tensorboard_holds_metrics_jsonl(run: tuple[dict, list[dict]]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    summary, records = run
    acc = EventAccumulator(str(Path(summary["run_dir"]) / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    got = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in tags if not tag.startswith("summary/")}
    assert_same(got, expected(records), rel=1e-6)  # event files hold float32
    assert acc.Scalars("summary/reward_end")[0].value == pytest.approx(summary["reward_end"], rel=1e-6)
    assert "_hparams_/session_start_info" in acc.summary_metadata


def _wandb_records(path: Path):
    """The protobuf records of a W&B run file (a LevelDB log: 7-byte file header, 32 KiB blocks of
    chunks with a 7-byte header: crc32, length, type 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, chunks = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


@pytest.mark.slow
def test_wandb_offline_run_holds_metrics_jsonl_and_the_config(run: tuple[dict, list[dict]]) -> None:
    summary, records = run
    files = list((Path(summary["run_dir"]) / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files  # offline by default, inside the run folder
    got: dict[str, dict[int, float]] = {}
    config, summary_keys = {}, {}
    for record in _wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            for item in record.history.item:
                key = "/".join(item.nested_key) or item.key
                if not key.startswith("_"):
                    got.setdefault(key, {})[record.history.step.num] = json.loads(item.value_json)
        elif kind == "run":
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "summary":
            summary_keys |= {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.summary.update}
    assert_same(got, expected(records))
    assert config["steps"] == 4 and config["learner"]["groups_per_step"] == 2
    assert summary_keys["reward_end"] == summary["reward_end"]


@pytest.mark.slow
def test_mlflow_local_store_holds_metrics_jsonl_and_params(run: tuple[dict, list[dict]]) -> None:
    from mlflow.tracking import MlflowClient

    summary, records = run
    run_dir = Path(summary["run_dir"])
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (mlrun,) = client.search_runs([client.get_experiment_by_name("sinks").experiment_id])
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == run_dir.name
    want = expected(records)
    got = {key: {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, key)} for key in want}
    assert_same(got, want)
    assert mlrun.data.params["learner.groups_per_step"] == "2" and mlrun.data.params["steps"] == "4"
    assert mlrun.data.metrics["summary/reward_end"] == summary["reward_end"]


@pytest.mark.long  # a slow integration run: in the long suite
@pytest.mark.slow
def test_on_ray_the_driver_forwards_what_the_learner_process_writes(tmp_path: Path) -> None:
    """The learner runs in its own Ray process; the driver alone writes the sink, the same records."""
    pytest.importorskip("ray")
    pytest.importorskip("mooncake")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from baton.config import load_toml

    root = Path(__file__).resolve().parents[2]
    data = load_toml(root / "configs" / "ray-mooncake.toml", [
        "steps=3", f"run_root='{tmp_path}'", f"model.path='{tmp_path / 'model'}'", "engine.count=1",
        "engine.batch_groups=4", "learner.groups_per_step=4", "store.global_segment_size='512MiB'",
        "telemetry.progress=false",
    ])
    pipe = build_pipeline(validate(RunConfig, data))
    pipe.sinks = ["jsonl", "tensorboard"]
    summary = pipe.run()
    run_dir = Path(summary["run_dir"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in records] == [1, 2, 3]
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    got = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    assert_same(got, expected(records), rel=1e-6)
