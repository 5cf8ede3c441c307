"""A checkpoint's model out, as a Hugging Face folder that transformers, SGLang or vLLM loads.

`export_checkpoint(checkpoint, model_path, out)` writes into `out`:
* `config.json` (the model folder's, its `dtype` the export's), `generation_config.json` (the model
  folder's, copied as it is, when it has one);
* the tokenizer as the run used it (the tiny demo model's BOS included), with its chat template;
* the weights as safetensors in the dtype asked (default: the model config's, else float32), sharded
  past `max_shard_size` (`model-0000k-of-0000n.safetensors` and `model.safetensors.index.json`) as
  transformers' `save_pretrained` writes them; a tied head is written once, under the embedding's name.

The weights are the checkpoint's `consumer/` learner state (stages.learner.state.read_model_weights:
DCP shards of any world size, or a pre-0.2 `model.safetensors`) loaded into a model built from the
run's model folder, in one process with no process group; the optimizer's state is never read.

Invariants: the export is written into a temporary folder beside `out` and renamed at the end, so a
failed export leaves `out` as it was (absent, empty, or with `force` the previous export); `out` is
never written over when it holds files, unless `force`. A float32 export's weights equal the
checkpoint's exactly.

`ExportsAsRunGoes` is the run's side (`[checkpoint] export_every`): each checkpoint of a version that is a
multiple of `export_every` is exported to `RUN_DIR/exports/v{version:08d}/` in a worker thread while
the learner trains on; a failed export is a warning and a `learner.export_failed` run event, never a
failed run.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec
import torch

from pipeline.checkpoint import CONSUMER_DIR, complete_checkpoints, latest_checkpoint
from stages.data.model import load_model, load_tokenizer
from stages.learner.lora_export import merged_adapter, merged_checkpoint, write_adapter_folder
from stages.learner.state import STATE_FILE, LearnerState, read_model_weights
from stages.weights.adapter import unpack_adapter

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_SHARD_SIZE = "5GB"
EXPORTS_DIR = "exports"  # in the run folder: exports/v{version:08d}/ (export_every)
GENERATION_CONFIG = "generation_config.json"


class ExportError(ValueError):
    """Bad input to an export: no such checkpoint or version, a dtype or size that is not one, an output
    folder that holds files, a model folder that does not fit the checkpoint (the message says the fix)."""


@dataclass(frozen=True)
class Exported:
    """What an export wrote: the folder, the checkpoint's version, its files (sorted), their bytes, the dtype."""

    out: str
    version: int
    files: list[str]
    bytes: int
    dtype: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def find_checkpoint(run_dir: str | Path, version: int | None = None) -> Path:
    """The checkpoint folder of `version` in `run_dir` (default: the latest complete one)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"{str(run_dir)!r} is not a run folder (no such folder)")
    found = complete_checkpoints(run_dir)
    if not found:
        raise ExportError(
            f"{str(run_dir)!r} holds no complete checkpoint: runs write them with checkpoint.every > 0, after that "
            "many versions (the run's last version is not checkpointed)"
        )
    if version is None:
        latest = latest_checkpoint(run_dir)
        assert latest is not None
        return latest
    if version not in found:
        raise ExportError(f"{str(run_dir)!r} has no checkpoint of version {version}; it has version(s) "
                          f"{', '.join(map(str, found))} (checkpoint.keep says how many are kept)")
    return found[version]


SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
              "GIB": 2**30, "TIB": 2**40}


def size_in_bytes(size: str | int) -> int:
    """`size` ("2GB", "500MB", "1.5GiB", or bytes) in bytes; ExportError unless it is a positive size."""
    text = str(size).strip().upper()
    number = text.rstrip("KMGTIB")
    unit = text[len(number):] or "B"
    try:
        value = int(float(number) * SIZE_UNITS[unit])
    except (ValueError, KeyError):
        value = 0
    if value <= 0:
        raise ExportError(f"max shard size {size!r} is not a size; give one such as 2GB, 500MB or 1.5GiB")
    return value


def default_dtype(model_path: str | Path) -> str:
    """The model folder's config dtype (`dtype`, or `torch_dtype` before transformers 5) when it is one an
    export writes, else float32."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    named = config.get("dtype") or config.get("torch_dtype")
    return named if named in EXPORT_DTYPES else "float32"


def export_checkpoint(
    checkpoint: str | Path, model_path: str | Path, out: str | Path, *, dtype: str | None = None,
    max_shard_size: str | int = DEFAULT_SHARD_SIZE, force: bool = False,
) -> Exported:
    """Write `checkpoint`'s model as a Hugging Face folder `out` (see the module docstring); a LoRA run's
    checkpoint is written with its adapter merged into the base."""
    checkpoint = Path(checkpoint)
    consumer = checkpoint / CONSUMER_DIR
    learner = msgspec.json.decode((consumer / STATE_FILE).read_bytes(), type=LearnerState)
    fill = functools.partial(_merged, consumer, Path(model_path), learner.version) if learner.lora is not None \
        else functools.partial(read_model_weights, consumer)
    return export_model(model_path, out, fill, dtype=dtype, max_shard_size=max_shard_size, force=force,
                        source=str(checkpoint))


def _merged(consumer: Path, model_path: Path, version: int, model: torch.nn.Module) -> int:
    """A LoRA checkpoint's adapter merged into `model` (an adapter on a tied head unties it)."""
    return _load_merged(model, *merged_checkpoint(consumer, model_path), version)


def _load_merged(model: torch.nn.Module, weights: dict[str, torch.Tensor], untied: bool, version: int) -> int:
    if untied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(weights["lm_head.weight"].clone())
    model.load_state_dict(weights, strict=False)  # a tied head may be named once
    return version


def export_adapter(checkpoint: str | Path, model_path: str | Path, out: str | Path, *, force: bool = False) -> Exported:
    """Write a LoRA run's checkpoint's adapter alone as a PEFT folder `out` (`PeftModel.from_pretrained`, SGLang's
    `/load_lora_adapter`); all or nothing."""
    checkpoint, out = Path(checkpoint), Path(out)
    consumer = checkpoint / CONSUMER_DIR
    learner = msgspec.json.decode((consumer / STATE_FILE).read_bytes(), type=LearnerState)
    if learner.lora is None:
        raise ExportError(f"{checkpoint} holds full weights, not a LoRA adapter; export it without --adapter")
    _check_out(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        write_adapter_folder(consumer, Path(model_path), tmp)
        files = _readable_files(tmp, "adapter_config.json")
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(str(out), learner.version, files, sum((out / f).stat().st_size for f in files), "adapter")


def export_model(
    model_path: str | Path, out: str | Path, fill: Callable[[torch.nn.Module], int], *, dtype: str | None = None,
    max_shard_size: str | int = DEFAULT_SHARD_SIZE, force: bool = False, source: str = "the weights",
) -> Exported:
    """Write a Hugging Face folder `out`: the model of `model_path` with the weights `fill(model)` puts in it
    (returning their version), its tokenizer and generation config; all or nothing."""
    model_path, out = Path(model_path), Path(out)
    dtype = dtype or default_dtype(model_path)
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"dtype {dtype!r} is not one an export writes; use one of {', '.join(EXPORT_DTYPES)}")
    shard_bytes = size_in_bytes(max_shard_size)
    _check_out(out, force)
    try:
        model = load_model(model_path)
        version = fill(model)
        tokenizer = load_tokenizer(model_path, pad=False)
    except FileNotFoundError as exc:  # also a model folder that is gone (ModelFolderError)
        raise ExportError(f"cannot export {source}: {exc}") from None
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        model.to(EXPORT_DTYPES[dtype]).eval()
        model.save_pretrained(tmp, max_shard_size=shard_bytes)
        tokenizer.save_pretrained(tmp)
        if (model_path / GENERATION_CONFIG).is_file():
            shutil.copyfile(model_path / GENERATION_CONFIG, tmp / GENERATION_CONFIG)
        files = _readable_files(tmp)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(str(out), version, files, sum((out / f).stat().st_size for f in files), dtype)


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"{str(out)!r} exists and is not a folder; choose another OUT")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"{str(out)!r} exists and is not empty; choose another OUT, or replace it with --force")


def _readable_files(folder: Path, config: str = "config.json") -> list[str]:
    """The folder's file names, sorted; the weights (safetensors writes 0600) made as readable as `config`,
    which a plain open() wrote as the umask allows (the umask itself is never touched: other threads of the
    learner's process may be creating files)."""
    mode = (folder / config).stat().st_mode & 0o777
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    for name in names:
        os.chmod(folder / name, mode)
    return names


def _replace(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`; an `out` already there (empty, or replaced with force) is removed only once
    `tmp` has taken its name."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class ExportsAsRunGoes:
    """The run's exports (`[checkpoint] export_every`): `after_checkpoint` starts one in a worker thread
    when the checkpoint's version is due; `wait` returns once the last one is done (the learner calls it
    before writing the next checkpoint, which may remove the folder being read)."""

    def __init__(self, every: int, model_path: str | Path, run_dir: Path, ctx: Any) -> None:
        self.every, self.model_path, self.run_dir, self.ctx = every, Path(model_path), run_dir, ctx
        self.log = ctx.log("export")
        self.done: anyio.Event | None = None  # the running export's; set when it ends

    def due(self, version: int) -> bool:
        return self.every > 0 and version % self.every == 0

    def running(self) -> bool:
        return self.done is not None and not self.done.is_set()

    async def wait(self) -> None:
        if self.done is not None:
            await self.done.wait()

    def after_checkpoint(self, tasks: anyio.abc.TaskGroup, checkpoint: Path, version: int) -> None:
        """Export `checkpoint` (of `version`) in `tasks` when the version is due."""
        if self.due(version):
            self.done = anyio.Event()
            write = functools.partial(export_checkpoint, checkpoint, self.model_path, force=True)
            tasks.start_soon(self._export, write, version, self.done)

    async def last(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Export the run's last version from the learner's own weights (no checkpoint is written at the end)."""
        if not self.every:
            return
        await self.wait()

        def fill(model: torch.nn.Module) -> int:
            adapter = unpack_adapter(weights)  # a LoRA learner publishes its adapter alone
            if adapter is not None:
                return _load_merged(model, *merged_adapter(self.model_path, *adapter), version)
            model.load_state_dict(weights, strict=False)  # a tied head may be named once
            return version

        self.done = anyio.Event()
        await self._export(lambda out: export_model(self.model_path, out, fill, force=True), version, self.done)

    async def _export(self, write: Any, version: int, done: anyio.Event) -> None:
        """`write(out)` into RUN_DIR/exports/v{version}/ in a worker thread; a failure is a run event."""
        out = self.run_dir / EXPORTS_DIR / f"v{version:08d}"
        try:
            exported = await anyio.to_thread.run_sync(write, out, abandon_on_cancel=True)
            self.log.info("model exported", **exported.as_dict())
        except Exception as exc:  # any failure: a warning and a run event; the run goes on
            self.ctx.event("learner.export_failed", version=version, out=str(out),
                           error=f"{type(exc).__name__}: {str(exc)[:300]}")
        finally:
            done.set()


__all__ = ["EXPORT_DTYPES", "EXPORTS_DIR", "ExportError", "Exported", "ExportsAsRunGoes", "default_dtype",
           "export_adapter", "export_checkpoint", "find_checkpoint", "size_in_bytes"]
