"""The checkpoint listing (`GET /api/v1/training_runs/{model_id}/checkpoints`, the SDK's
`RestClient.list_checkpoints`): a model's `save_state` checkpoints ("training", `tinker://{model_id}/weights/NAME`)
and its `save_weights_for_sampler` saves ("sampler", `tinker://{model_id}/sampler_weights/NAME`), oldest first,
each with when it was saved and its size where the service knows it.

A training checkpoint is listed from its folder (`checkpoints/{model_id}/NAME/state/`, written whole before its
call answered): a crashed `save_state` that left no learner-state file is not listed. A sampler save is listed from
the service's samplers (`Samplers.saved`), which a restart fills again from the journal, with the time it was saved.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from stages.learner.state import STATE_FILE
from stages.weights.adapter import AdapterVersion
from stages.weights.disk import DiskNotice


def _iso(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC).isoformat()


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def training_checkpoints(model_id: str, checkpoints: Path) -> list[dict[str, Any]]:
    """The model's `save_state` checkpoints under `checkpoints/{model_id}/`."""
    listed = []
    for folder in sorted((checkpoints / model_id).glob("*")):
        state = folder / "state" / STATE_FILE
        if folder.name == "sampler_weights" or not state.is_file():
            continue
        listed.append({"checkpoint_id": f"weights/{folder.name}", "checkpoint_type": "training",
                       "time": _iso(state.stat().st_mtime), "tinker_path": f"tinker://{model_id}/weights/{folder.name}",
                       "size_bytes": _folder_bytes(folder)})
    return listed


def _size(weights: AdapterVersion | DiskNotice | None) -> int | None:
    if isinstance(weights, AdapterVersion):
        return sum(t.numel() * t.element_size() for t in weights.tensors.values())
    if isinstance(weights, DiskNotice) and Path(weights.path).is_file():
        return Path(weights.path).stat().st_size
    return None


def sampler_checkpoints(model_id: str, saved: dict[str, Any], when: dict[str, Any]) -> list[dict[str, Any]]:
    """The model's sampler saves among `saved` (path -> weights), with their times (`when`: path -> `SaveInfo`)."""
    prefix = f"tinker://{model_id}/sampler_weights/"
    return [{"checkpoint_id": path.removeprefix(f"tinker://{model_id}/"), "checkpoint_type": "sampler",
             "time": _iso(when[path].at), "tinker_path": path, "size_bytes": _size(weights)}
            for path, weights in saved.items() if path.startswith(prefix)]


def checkpoints_of(model_id: str, checkpoints: Path, saved: dict[str, Any], when: dict[str, Any]) -> dict:
    """The `CheckpointsListResponse` of `model_id`: every checkpoint, oldest first."""
    listed = training_checkpoints(model_id, checkpoints) + sampler_checkpoints(model_id, saved, when)
    return {"checkpoints": sorted(listed, key=lambda c: c["time"]), "cursor": None}
