"""`resume_run`: continue a checkpointed run from Python, as `baton run --resume RUN_DIR` does.

    summary = resume_run("runs/quickstart-20261129-153340")            # the run's own config.toml
    summary = resume_run(run_dir, overrides=["steps=480"])            # ... with keys changed

The run folder's `config.toml` (the resolved config the run last ran with) builds the same pipeline,
which then continues from the folder's latest checkpoint (pipeline.checkpoint states what that keeps,
re-uses, regenerates and rolls back). The resumed run's own resolved config (overrides applied) becomes
the folder's `config.toml`, the one before kept as `attempts/<n>/config.toml`; the summary's `resume`
entry reports what was resumed, and under `changed` the keys that differ from the attempt before.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from baton.builder import build_pipeline
from baton.schema import load_run_config
from pipeline.checkpoint import CheckpointError


def resume_run(run_dir: str | Path, overrides: Sequence[str] = (), config: str | Path | None = None) -> dict[str, Any]:
    """Continue the run in `run_dir` to its `steps` and return its summary. `config`: another config file
    to build the pipeline from (default: `run_dir/config.toml`); it must describe the same run."""
    run_dir = Path(run_dir)
    source = Path(config) if config is not None else run_dir / "config.toml"
    if not source.is_file():
        raise CheckpointError(f"--resume {str(run_dir)!r}: {source} is missing; give the run's config explicitly")
    return build_pipeline(load_run_config(source, overrides)).resume(run_dir)


__all__ = ["resume_run"]
