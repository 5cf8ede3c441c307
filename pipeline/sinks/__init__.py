"""Metric sinks: the run's metrics.jsonl forwarded to TensorBoard, Weights & Biases and MLflow.

    async with metric_sinks(folder, ["jsonl", "tensorboard"], run_name="quickstart", config=cfg) as sinks:
        ...  # the run: the learner appends to folder/metrics.jsonl
        sinks.finish(summary)

Invariants:
- The learner writes metrics.jsonl, in whichever process it runs; only the driver (the process that
  runs `Pipeline.arun`) writes to sinks: a thread follows the file, reading only bytes it has not read,
  and forwards each complete record. The local and Ray runtimes share this one path, and a sink holds
  nothing the file does not.
- Each record goes to every sink with its `version` (the learner version) as the step, as flat scalars
  (`flatten`). The config goes with the first, the summary with the last (`finish`).
- `jsonl` is always on: it is metrics.jsonl itself. Opening a sink whose library is missing raises
  `SinkUnavailable` naming the extra to install, before the run starts.
- A sink that fails while the run goes on is logged and left out from then on: a dashboard never stops
  a training run. Records written before the sinks closed all reach the sinks that still work.
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

import anyio

from pipeline.telemetry import METRICS_FILE, get_logger

__all__ = ["SINKS", "JsonlTail", "MetricSink", "SinkUnavailable", "flatten", "metric_sinks", "open_sinks"]


class SinkUnavailable(RuntimeError):
    """A configured sink's library is not installed; the message names the extra that installs it."""

    def __init__(self, sink: str, package: str) -> None:
        super().__init__(
            f"telemetry.sinks has {sink!r}, but {package!r} is not installed: "
            f"pip install 'baton-rl[{sink}]' (or remove {sink!r} from telemetry.sinks)"
        )


class MetricSink(Protocol):
    """Where metric records go besides metrics.jsonl. Called from one thread at a time."""

    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self, summary: Mapping[str, Any] | None) -> None:
        """The run ended: with its summary, or None when it failed."""
        ...


def _tensorboard(folder: Path, run_name: str, config: Mapping[str, Any]) -> MetricSink:
    from pipeline.sinks.tensorboard import TensorBoardSink

    return TensorBoardSink(folder, run_name, config)


def _wandb(folder: Path, run_name: str, config: Mapping[str, Any]) -> MetricSink:
    from pipeline.sinks.wandb import WandbSink

    return WandbSink(folder, run_name, config)


def _mlflow(folder: Path, run_name: str, config: Mapping[str, Any]) -> MetricSink:
    from pipeline.sinks.mlflow import MlflowSink

    return MlflowSink(folder, run_name, config)


# name -> opener(run folder, run name, config); "jsonl" has none: metrics.jsonl is written by the learner
SINKS: dict[str, Callable[[Path, str, Mapping[str, Any]], MetricSink] | None] = {
    "jsonl": None,
    "tensorboard": _tensorboard,
    "wandb": _wandb,
    "mlflow": _mlflow,
}


def _is_binned(value: Mapping[Any, Any]) -> bool:
    """Pre-binned counts ({bin edge: count}, pipeline.histograms) are keyed by numbers."""
    try:
        [float(k) for k in value]
    except (TypeError, ValueError):
        return False
    return bool(value)


def flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The record's numbers as `{"a/b": value}`: nested mappings joined by "/"; lists, strings, booleans
    and pre-binned counts (mappings keyed by bin edges) left out."""
    flat: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            if not _is_binned(value):
                flat.update(flatten(value, f"{name}/"))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            flat[name] = float(value)
    return flat


def flat_params(config: Mapping[str, Any]) -> dict[str, str | int | float | bool]:
    """A nested config as `{"section.key": value}`; lists and other values as JSON text."""
    params: dict[str, str | int | float | bool] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            params.update({f"{key}.{k}": v for k, v in flat_params(value).items()})
        elif isinstance(value, str | int | float | bool):
            params[key] = value
        else:
            params[key] = json.dumps(value, default=str)
    return params


class JsonlTail:
    """Reads a JSONL file that another process appends to, one new slice at a time: each `read()`
    returns the complete lines written since the last one (a torn last line waits for its end)."""

    def __init__(self, path: Path | str, *, from_end: bool = False) -> None:
        self.path = Path(path)
        self.offset = self.path.stat().st_size if from_end and self.path.exists() else 0

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        records = []
        for line in data[: end + 1].splitlines():
            if line.strip():
                records.append(json.loads(line))
        return records


def open_sinks(names: Sequence[str], folder: Path, run_name: str, config: Mapping[str, Any]) -> dict[str, MetricSink]:
    """The sinks named (unknown names and missing libraries raise before any is opened)."""
    unknown = [n for n in names if n not in SINKS]
    if unknown:
        raise ValueError(f"telemetry.sinks: unknown {unknown} (choose from {sorted(SINKS)})")
    opened: dict[str, MetricSink] = {}
    try:
        for name in dict.fromkeys(names):
            opener = SINKS[name]
            if opener is not None:
                opened[name] = opener(folder, run_name, config)
    except BaseException:
        for sink in opened.values():
            sink.close(None)
        raise
    return opened


class SinkSet:
    """The open sinks of one run and the thread that forwards metrics.jsonl to them."""

    def __init__(self, sinks: dict[str, MetricSink], tail: JsonlTail, poll_s: float) -> None:
        self.sinks = sinks
        self.tail = tail
        self.poll_s = poll_s
        self.forwarded = 0
        self._summary: Mapping[str, Any] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="metric-sinks", daemon=True)
        self._log = get_logger("sinks")

    def finish(self, summary: Mapping[str, Any]) -> None:
        """The run's summary: it goes to every sink when the sinks close."""
        self._summary = summary

    def forward(self) -> None:
        """Send every record appended since the last call to every working sink."""
        for record in self.tail.read():
            step = int(record.get("version", self.forwarded + 1))
            scalars = {k: v for k, v in flatten(record).items() if k != "version"}
            self.forwarded += 1
            for name, sink in list(self.sinks.items()):
                try:
                    sink.log(step, scalars)
                except Exception as exc:  # noqa: BLE001 - a dashboard must not stop the run
                    self._log.warning("metric sink failed; left out from now on", sink=name, error=repr(exc))
                    del self.sinks[name]

    def _follow(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.forward()

    def start(self) -> None:
        if self.sinks:
            self._thread.start()

    def close(self) -> None:
        """Stop following, forward what is left, then close every sink with the summary (if any)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.forward()
        for name, sink in self.sinks.items():
            try:
                sink.close(self._summary)
            except Exception as exc:  # noqa: BLE001
                self._log.warning("metric sink failed to close", sink=name, error=repr(exc))


@asynccontextmanager
async def metric_sinks(
    folder: Path | str,
    names: Sequence[str],
    *,
    run_name: str,
    config: Mapping[str, Any] | None = None,
    poll_s: float = 1.0,
) -> AsyncIterator[SinkSet]:
    """Open the sinks `names` for the run folder `folder`, follow its metrics.jsonl from its current end
    (a resumed run forwards only its new records) until the block ends, then close them; call
    `finish(summary)` inside the block once the run succeeded."""
    folder = Path(folder)
    sinks = await anyio.to_thread.run_sync(open_sinks, names, folder, run_name, dict(config or {}))
    hub = SinkSet(sinks, JsonlTail(folder / METRICS_FILE, from_end=True), poll_s)
    hub.start()
    try:
        yield hub
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(hub.close)
