"""The learner's part of a checkpoint (pipeline.checkpoint writes the run's part around it).

Files, in the checkpoint's `consumer/` folder; none is read back with pickle:
* `model.safetensors`: the model's state dict (tied tensors are written once per name);
* `optimizer.pt`: the optimizer's state dict (`torch.save`; read with `torch.load(weights_only=True)`,
  which only rebuilds tensors and plain containers);
* `rng.safetensors`: torch's CPU (and each CUDA device's) generator state;
* `learner.json` (msgspec): the version, Python's and numpy's global RNG states and the selection
  policy's RNG state (None for policies without one).

Restoring sets all of them back, so a resumed learner continues with the checkpoint's weights, moments
and random streams.
"""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import numpy as np
import safetensors.torch
import torch

from pipeline.checkpoint import RandomState, python_random_state, random_state
from policies.selection import Selection

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.safetensors"
STATE_FILE = "learner.json"


class NumpyRNG(msgspec.Struct, frozen=True):
    kind: str
    keys: list[int]
    pos: int
    has_gauss: int
    cached_gaussian: float


class LearnerState(msgspec.Struct, kw_only=True):
    version: int
    python_rng: RandomState
    numpy_rng: NumpyRNG
    selection_rng: RandomState | None = None


def write_learner_state(
    folder: Path, version: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, selection: Selection
) -> None:
    """Write the learner's state for `version` into `folder` (see the module docstring)."""
    tensors = {name: t.detach().to("cpu").clone().contiguous() for name, t in model.state_dict().items()}
    safetensors.torch.save_file(tensors, str(folder / MODEL_FILE), metadata={"version": str(version)})
    torch.save(optimizer.state_dict(), folder / OPTIMIZER_FILE)
    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"torch_cuda_{i}"] = state
    safetensors.torch.save_file(rng, str(folder / RNG_FILE))
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    selection_rng = selection.rng_state()
    state = LearnerState(
        version=version,
        python_rng=random_state(random.getstate()),
        numpy_rng=NumpyRNG(str(kind), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)),
        selection_rng=random_state(selection_rng) if selection_rng is not None else None,
    )
    (folder / STATE_FILE).write_bytes(msgspec.json.encode(state))


def read_learner_state(
    folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, selection: Selection
) -> int:
    """Load what `write_learner_state` wrote into `model`, `optimizer`, the RNGs and `selection`; returns
    the checkpoint's version."""
    state = msgspec.json.decode((folder / STATE_FILE).read_bytes(), type=LearnerState)
    device = next(model.parameters()).device
    weights = safetensors.torch.load_file(str(folder / MODEL_FILE), device=str(device))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {folder} does not fit the model: missing {sorted(missing)[:5]}, unexpected "
            f"{sorted(unexpected)[:5]}; resume with the model the run was started with (model.path)"
        )
    optimizer.load_state_dict(torch.load(folder / OPTIMIZER_FILE, weights_only=True, map_location=device))
    rng = safetensors.torch.load_file(str(folder / RNG_FILE))
    torch.set_rng_state(rng["torch_cpu"])
    if torch.cuda.is_available():
        cuda = [rng[k] for k in sorted(rng) if k.startswith("torch_cuda_")]
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
    random.setstate(python_random_state(state.python_rng))
    n = state.numpy_rng
    np.random.set_state((n.kind, np.asarray(n.keys, dtype=np.uint32), n.pos, n.has_gauss, n.cached_gaussian))
    if state.selection_rng is not None:
        selection.set_rng_state(python_random_state(state.selection_rng))
    return state.version


__all__ = ["LearnerState", "read_learner_state", "write_learner_state"]
