"""MLflow: a local store in the run folder by default (`<run folder>/mlflow.db`, SQLite: MLflow 3 refuses
its old `./mlruns` file store unless MLFLOW_ALLOW_FILE_STORE is set), or `MLFLOW_TRACKING_URI` (a server,
or any store MLflow takes). Browse it with `mlflow ui --backend-store-uri sqlite:///<run folder>/mlflow.db`.
Experiment: `MLFLOW_EXPERIMENT_NAME`, default the run's name; the MLflow run is named after the folder."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline.sinks import SinkUnavailable, flat_params, flatten

STORE_FILE = "mlflow.db"
_BATCH = 100  # params per log_batch call (MLflow's limit)


def mlflow_name(key: str) -> str:
    """A metric name MLflow takes: its characters outside letters, digits and `_ - . : /` and space become
    `_` (a user's environment may report any name)."""
    return re.sub(r"[^\w\-.:/ ]", "_", key)


def tracking_uri(folder: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(folder / STORE_FILE).resolve()}"


class MlflowSink:
    """The config as params at open, each record as metrics at step = learner version, the summary's
    numbers as `summary/...` metrics at close; the run ends FINISHED, or FAILED when the run failed."""

    def __init__(self, folder: Path, run_name: str, config: Mapping[str, Any]) -> None:
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise SinkUnavailable("mlflow", "mlflow") from None
        self.client = MlflowClient(tracking_uri=tracking_uri(folder))
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", run_name)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=folder.name).info.run_id
        params = [Param(k, str(v)) for k, v in flat_params(config).items()]
        for i in range(0, len(params), _BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + _BATCH])
        self.last_step = 0

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_name(k), v, now, step) for k, v in scalars.items()])
        self.last_step = step

    def close(self, summary: Mapping[str, Any] | None) -> None:
        if summary is not None:
            self.log(self.last_step, {f"summary/{k}": v for k, v in flatten(summary).items()})
        self.client.set_terminated(self.run_id, "FINISHED" if summary is not None else "FAILED")
