"""The learner's part of a checkpoint (pipeline.checkpoint writes the run's part around it).

Files, in the checkpoint's `consumer/` folder; none is read back with pickle:
* `shards/`: the model's and the optimizer's state, written by every rank with
  torch.distributed.checkpoint (DCP): each rank writes its own shards and rank 0 the metadata, keyed
  by parameter name, so a checkpoint written at one world size loads at another (2 -> 1, 1 -> 2);
* `rng.safetensors`: torch's CPU (and each CUDA device's) generator state;
* `learner.json` (msgspec): the version, Python's and numpy's global RNG states and the selection
  policy's RNG state (None for policies without one).
Checkpoints written before 0.2 hold `model.safetensors` and `optimizer.pt` instead of `shards/`;
they still load, at any world size. A LoRA learner's `shards/` hold the adapter's weights and their
optimizer state only (the base is the model folder), and `learner.json` its `lora` settings: it
resumes only with the same rank, alpha and target modules, and `read_adapter` reads the adapter alone
(for an export) without a model.

`read_model_weights` reads the model's weights alone, in one process (an export: stages.learner.export).

Restoring sets all of them back, so a resumed learner continues with the checkpoint's weights, moments
and random streams.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import msgspec
import numpy as np
import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from pipeline.checkpoint import RandomState, python_random_state, random_state
from policies.selection import Selection
from stages.learner.lora import LoraSpec

SHARDS_DIR = "shards"
RNG_FILE = "rng.safetensors"
STATE_FILE = "learner.json"
LEGACY_MODEL_FILE, LEGACY_OPTIMIZER_FILE = "model.safetensors", "optimizer.pt"  # before 0.2


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
    world_size: int = 1  # the ranks that wrote `shards/` (any world size reads them)
    lora: LoraSpec | None = None  # a LoRA learner's: `shards/` hold the adapter only
    entropy_cap: float | None = None  # the bonus's cap measured on the first step (`entropy_cap = "initial"`)


def write_learner_state(
    folder: Path, version: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, selection: Selection,
    sharded: bool = False, lora: LoraSpec | None = None, entropy_cap: float | None = None,
) -> None:
    """Write the learner's state for `version` into `folder` (see the module docstring). A `sharded` model's
    every rank calls it (DCP's save is a collective of the default group); rank 0 writes the rest."""
    state = {"model": _model_state(model, lora), "optimizer": get_optimizer_state_dict(model, optimizer)}
    with warnings.catch_warnings():  # one process: DCP says it assumes so
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(state, checkpoint_id=folder / SHARDS_DIR, no_dist=not sharded)
    if sharded and dist.get_rank() != 0:
        return
    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, cuda in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"torch_cuda_{i}"] = cuda
    safetensors.torch.save_file(rng, str(folder / RNG_FILE))
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    selection_rng = selection.rng_state()
    learner = LearnerState(
        version=version,
        python_rng=random_state(random.getstate()),
        numpy_rng=NumpyRNG(str(kind), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)),
        selection_rng=random_state(selection_rng) if selection_rng is not None else None,
        world_size=dist.get_world_size() if sharded else 1,
        lora=lora,
        entropy_cap=entropy_cap,
    )
    (folder / STATE_FILE).write_bytes(msgspec.json.encode(learner))


def read_learner_state(
    folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, selection: Selection,
    sharded: bool = False, lora: LoraSpec | None = None,
) -> LearnerState:
    """Load what `write_learner_state` wrote (at any world size), or a pre-0.2 checkpoint, into `model`,
    `optimizer`, the RNGs and `selection`; returns the rest of the state (its version, the measured entropy
    cap). A `sharded` model's every rank calls it."""
    learner = msgspec.json.decode((folder / STATE_FILE).read_bytes(), type=LearnerState)
    _check_same_adapter(folder, learner.lora, lora)
    try:
        if (folder / SHARDS_DIR).is_dir():
            _load_shards(folder / SHARDS_DIR, model, optimizer, sharded, lora is not None)
        else:
            _load_legacy(folder, model, optimizer)
    except (RuntimeError, KeyError, ValueError, dcp.CheckpointException) as exc:
        raise ValueError(
            f"checkpoint {folder} does not fit the model ({_cause(exc)}); resume with "
            "the model the run was started with (model.path)"
        ) from None
    rng = safetensors.torch.load_file(str(folder / RNG_FILE))
    torch.set_rng_state(rng["torch_cpu"])
    if torch.cuda.is_available():
        cuda = [rng[k] for k in sorted(rng) if k.startswith("torch_cuda_")]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    random.setstate(python_random_state(learner.python_rng))
    n = learner.numpy_rng
    np.random.set_state((n.kind, np.asarray(n.keys, dtype=np.uint32), n.pos, n.has_gauss, n.cached_gaussian))
    if learner.selection_rng is not None:
        selection.set_rng_state(python_random_state(learner.selection_rng))
    return learner


def read_model_weights(folder: Path, model: torch.nn.Module) -> int:
    """Load only the model's weights of the learner state in `folder` (a checkpoint's `consumer/`, written at
    any world size, or pre-0.2) into `model`, a whole (unsharded) model built from the run's model folder;
    no process group is needed and the optimizer's state is never read. Returns the checkpoint's version;
    raises ValueError when the weights do not fit `model`."""
    learner = msgspec.json.decode((folder / STATE_FILE).read_bytes(), type=LearnerState)
    state = {"model": model.state_dict()}
    try:
        if (folder / SHARDS_DIR).is_dir():
            with warnings.catch_warnings():  # one process: DCP says it assumes so
                warnings.filterwarnings("ignore", "torch.distributed is disabled")
                dcp.load(state, checkpoint_id=folder / SHARDS_DIR, no_dist=True)  # the "model" keys alone
        else:
            state["model"] = safetensors.torch.load_file(str(folder / LEGACY_MODEL_FILE))
        model.load_state_dict(state["model"], strict=True)
    except (RuntimeError, KeyError, ValueError, dcp.CheckpointException) as exc:
        raise ValueError(
            f"checkpoint {folder} does not fit the model ({_cause(exc)}); give the model folder the run was "
            "started with (its config.toml's model.path)"
        ) from None
    return learner.version


def _cause(exc: BaseException) -> str:
    """What went wrong, in one line: a DCP failure (a BaseException carrying each rank's) says its first rank's."""
    if isinstance(exc, dcp.CheckpointException) and exc.failures:
        failure = next(iter(exc.failures.values()))
        exc = failure[0] if isinstance(failure, tuple) else failure  # (exception, traceback) in torch 2.x
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def _model_state(model: torch.nn.Module, lora: LoraSpec | None) -> dict[str, torch.Tensor]:
    """The model's part of a checkpoint: every weight, or with LoRA the adapter's (the trained ones) only."""
    state = get_model_state_dict(model)
    if lora is None:
        return state
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    return {name: t for name, t in state.items() if name in trained}


def _check_same_adapter(folder: Path, written: LoraSpec | None, wanted: LoraSpec | None) -> None:
    """A checkpoint resumes only into a learner of its own kind: full weights, or the same adapter shape."""
    def shape(lora: LoraSpec | None) -> tuple | None:
        return None if lora is None else (lora.rank, float(lora.alpha), tuple(lora.target_modules), lora.target_experts)

    if shape(written) != shape(wanted):
        def say(lora: LoraSpec | None) -> str:
            return "full weights" if lora is None else (f"a LoRA adapter (rank {lora.rank}, alpha {lora.alpha}, "
                                                        f"target_modules {list(lora.target_modules)}, "
                                                        f"target_experts {lora.target_experts})")
        raise ValueError(f"checkpoint {folder} holds {say(written)}, but learner.lora asks for {say(wanted)}; resume "
                         "with the [learner] lora settings the run was started with")


def _load_shards(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, sharded: bool,
                 adapter_only: bool = False) -> None:
    """DCP shards of any world size into this rank's part of the model and optimizer (with `adapter_only`,
    a LoRA checkpoint's adapter: the base stays as loaded from the model folder)."""
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    if adapter_only:
        trained = {name for name, p in model.named_parameters() if p.requires_grad}
        state["model"] = {name: t for name, t in state["model"].items() if name in trained}
    with warnings.catch_warnings():  # one process: DCP says it assumes so
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=not sharded)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not adapter_only))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def read_adapter(folder: Path) -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """A LoRA checkpoint's settings and adapter (`folder`: its `consumer/` folder), whole, in host memory,
    named as peft's `get_peft_model_state_dict` names them; read from the DCP shards of any world size
    without loading the model. ValueError when the checkpoint holds full weights."""
    learner = msgspec.json.decode((folder / STATE_FILE).read_bytes(), type=LearnerState)
    if learner.lora is None:
        raise ValueError(f"checkpoint {folder} holds full weights, not a LoRA adapter")
    reader = dcp.FileSystemReader(str(folder / SHARDS_DIR))
    entries = reader.read_metadata().state_dict_metadata
    model = {key.removeprefix("model."): torch.empty(entry.size, dtype=entry.properties.dtype)
             for key, entry in entries.items() if key.startswith("model.")}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load({"model": model}, storage_reader=reader, no_dist=True)
    return learner.lora, {name.replace(".default.", "."): t for name, t in model.items()}


def _load_legacy(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A pre-0.2 checkpoint: the whole model in safetensors, the optimizer's state dict keyed by parameter
    index; every rank reads both whole and keeps its shards."""
    weights = safetensors.torch.load_file(str(folder / LEGACY_MODEL_FILE))
    full = StateDictOptions(full_state_dict=True, strict=False)
    missing, unexpected = set_model_state_dict(model, weights, options=full)
    if missing or unexpected:
        raise ValueError(f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    by_index = torch.load(folder / LEGACY_OPTIMIZER_FILE, weights_only=True, map_location="cpu")
    names = [name for name, _ in model.named_parameters()]
    by_name = {
        "state": {names[i]: value for i, value in by_index["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in by_index["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


__all__ = ["LearnerState", "read_adapter", "read_learner_state", "read_model_weights", "write_learner_state"]
