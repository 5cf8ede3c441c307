"""TensorBoard: event files in `<run folder>/tensorboard`; the config and the summary as hyperparameters."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline.sinks import SinkUnavailable, flat_params, flatten

LOG_DIR = "tensorboard"


class TensorBoardSink:
    """One scalar per metric at step = learner version; at close, the hparams (the config, flattened)
    with the summary's numbers as their metrics (`summary/...`)."""

    def __init__(self, folder: Path, run_name: str, config: Mapping[str, Any]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise SinkUnavailable("tensorboard", "tensorboard") from None
        self.log_dir = folder / LOG_DIR
        self.config = config
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        self.writer.add_text("run", run_name)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self, summary: Mapping[str, Any] | None) -> None:
        metrics = {f"summary/{k}": v for k, v in flatten(summary or {}).items()}
        self.writer.add_hparams(flat_params(self.config) or {"run": "baton"}, metrics, run_name=".")
        self.writer.close()
