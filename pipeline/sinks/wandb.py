"""Weights & Biases: offline by default, in `<run folder>/wandb` (upload later with `wandb sync`);
online only when asked (`WANDB_MODE=online`). Project: `WANDB_PROJECT`, default the run's name."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline.sinks import SinkUnavailable, flatten


class WandbSink:
    """One W&B run per baton run: the config at init, each record at step = learner version, the summary
    into the run's summary at close (exit code 1 when the run failed)."""

    def __init__(self, folder: Path, run_name: str, config: Mapping[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise SinkUnavailable("wandb", "wandb") from None
        self.run = wandb.init(
            mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
            dir=str(folder),
            project=os.environ.get("WANDB_PROJECT", run_name),
            name=folder.name,
            config=dict(config),
            reinit="create_new",
            settings=wandb.Settings(console="off", quiet=True),
        )

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self, summary: Mapping[str, Any] | None) -> None:
        if summary is not None:
            self.run.summary.update(flatten(summary))
        self.run.finish(exit_code=0 if summary is not None else 1)
