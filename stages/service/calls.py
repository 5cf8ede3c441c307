"""`Calls`: the work of a model's call, made from its journal record (`journal.CallRecord`) alone, so the same
work runs when the call arrives and when a restarted service runs it again (`stages.service.recovery`).

The request bodies were checked when they were accepted (`Service`); here they are parsed again by the same pure
functions (`spec_of`, `adam_settings`, `checkpoint_state`) and acted on. An `optim_step` commits the model's
learner state when it finishes (`Store`) if `commit_every_s` has passed since the model's last commit (its first
step always commits; 0: every step): a restart comes back at the last commit and runs the calls after it again
(deterministic), so a longer interval costs a longer restart, never a lost or doubled step. A sampler's adapter is
written to the state folder (a full model's to its own file) before its path is answered, and journaled, so it
samples after a restart.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np

from stages.learner.export import export_model
from stages.learner.lora import LoraSpec
from stages.learner.state import STATE_FILE, LearnerState
from stages.service import wire
from stages.service.futures import Result
from stages.service.journal import CallRecord, Commit, Journal, Outcome, SamplerRecord
from stages.service.ledger import Ledger
from stages.service.losses import check_loss
from stages.service.ranked import RankedModel, ServiceRanks
from stages.service.refusals import Refused, refuse_unless
from stages.service.sampling import Samplers
from stages.service.store import Store
from stages.service.training import AdamSettings, TrainingModel, lora_spec
from stages.weights.adapter import AdapterVersion, write_peft_folder

COMMIT_EVERY_S = 10.0  # a model's learner state is committed at most this often (its first step always)


def loss_tokens(data: list[wire.Datum]) -> int:
    """The positions a loss counts: a nonzero `weights` (cross_entropy) or `advantages` (the policy losses)."""
    return sum(int(np.count_nonzero(d.inputs["weights"] if "weights" in d.inputs else d.inputs["advantages"]))
               for d in data)


def spec_of(body: dict[str, Any]) -> LoraSpec | None:
    """The `LoraSpec` of a `create_model` body (its lora_config checked by the service); None without one: full
    fine-tuning."""
    lora = body.get("lora_config")
    if lora is None:
        return None
    return lora_spec(lora["rank"], lora.get("train_attn", True), lora.get("train_mlp", True),
                     lora.get("train_unembed", True))


def adam_settings(body: dict[str, Any]) -> AdamSettings:
    """An `optim_step` body's AdamW settings; `Refused` for another optimizer or an unknown key."""
    params = body.get("adam_params")
    refuse_unless(params is not None, "optim_step takes adam_params only (AdamW); other optimizers are refused")
    unknown = sorted(set(params) - set(AdamSettings.__dataclass_fields__))
    refuse_unless(not unknown, f"adam_params keys {unknown} are not supported")
    return AdamSettings(**params)


def checkpoint_state(checkpoints: Path, path: str) -> tuple[Path, LoraSpec | None]:
    """The learner-state folder `save_state` wrote for `tinker://MODEL_ID/weights/NAME`, and its LoRA settings
    (None: a fully fine-tuned model's)."""
    prefix, _, rest = path.partition("tinker://")
    owner, _, name = rest.partition("/weights/")
    state = checkpoints / owner / name / "state"
    refuse_unless(not prefix and bool(owner) and bool(name) and (state / STATE_FILE).is_file(),
                  f"path {path!r} names no checkpoint save_state wrote here (tinker://MODEL_ID/weights/NAME)")
    return state, msgspec.json.decode((state / STATE_FILE).read_bytes(), type=LearnerState).lora


def lora_of(maker: CallRecord, checkpoints: Path) -> LoraSpec | None:
    """The adapter settings of the model `maker` (its call 0) makes; None for full fine-tuning, or for a
    checkpoint that is no longer there (making the model again then fails by name)."""
    body = msgspec.json.decode(maker.body)
    if maker.kind == "create_model":
        return spec_of(body)
    try:
        return checkpoint_state(checkpoints, body.get("path", ""))[1]
    except Refused:
        return None


class Calls:
    """Makes each model call's work (see the module docstring). `models` is shared with the service."""

    def __init__(self, model_path: Path, checkpoints: Path, device: str, journal: Journal, store: Store,
                 samplers: Samplers, sampling_session: Callable[[str], str], ranks: ServiceRanks | None = None,
                 commit_every_s: float = COMMIT_EVERY_S, ledger: Ledger | None = None) -> None:
        self.model_path, self.checkpoints, self.device, self.ranks = model_path, checkpoints, device, ranks
        self.commit_every_s, self.ledger = commit_every_s, ledger
        self.committed_at: dict[str, float] = {}  # model id -> when (time.monotonic) its last commit was written
        self.journal, self.store, self.samplers = journal, store, samplers
        self.sampling_session = sampling_session  # a new sampling session of a checkpoint path: its id
        self.models: dict[str, TrainingModel | RankedModel] = {}

    def work(self, call: CallRecord, commit: Commit | None = None) -> Awaitable[Result]:
        """The call's work; for the call that made a model, `commit` is the step it comes back at."""
        body = call.body if call.kind == "forward_backward" else msgspec.json.decode(call.body)
        if call.kind in ("create_model", "load_weights"):
            return self._make(call, body, commit)
        return {"forward_backward": self._forward_backward, "optim_step": self._optim_step,
                "save_weights_for_sampler": self._save_for_sampler, "save_weights": self._save_state,
                }[call.kind](call, body)

    def _build(self, call: CallRecord, body: dict[str, Any], commit: Commit | None) -> TrainingModel | RankedModel:
        """The model `call` makes, or, with `commit`, that model at its committed step (weights and moments)."""
        if call.kind == "create_model":
            lora, state, optimizer = spec_of(body), None, False
        else:  # load_weights: from a checkpoint save_state wrote, with its optimizer state when asked
            (state, lora), optimizer = checkpoint_state(self.checkpoints, body["path"]), bool(body.get("optimizer"))
        if commit is not None:
            state, optimizer = self.store.step_folder(call.model, commit.step), True
        return self._new_model(call.model, lora, state, optimizer)

    def _new_model(self, model_id: str, lora: LoraSpec | None, state: Path | None,
                   optimizer: bool) -> TrainingModel | RankedModel:
        """A model of the service's world size; from the checkpoint `state` (with its AdamW moments when
        `optimizer`), else from the base."""
        if self.ranks is not None:
            return RankedModel.create(self.ranks, model_id, lora, state, optimizer)
        model = TrainingModel(self.model_path, lora, self.device)
        if state is not None:
            model.read_state(state, optimizer)
        return model

    async def _make(self, call: CallRecord, body: dict[str, Any], commit: Commit | None) -> Result:
        self.models[call.model] = await anyio.to_thread.run_sync(self._build, call, body, commit)
        if call.kind == "create_model":
            return {"model_id": call.model, "type": "create_model"}
        return {"path": body["path"], "model_id": call.model, "type": "load_weights"}

    async def _forward_backward(self, call: CallRecord, body: bytes) -> Result:
        request = wire.decode_forward_backward(body)
        settings = check_loss(request.loss_fn, request.config, set(request.data[0].inputs))
        model = self.models[call.model]
        rows, metrics = await anyio.to_thread.run_sync(model.forward_backward, request.data, request.loss_fn,
                                                       settings, not request.forward_only)
        if self.ledger is not None and not request.forward_only:
            self.ledger.trained(call.model, call.seq, request.loss_fn, len(request.data),
                                loss_tokens(request.data), model.steps + 1)
        return wire.forward_backward_output(rows, metrics)

    async def _optim_step(self, call: CallRecord, body: dict[str, Any]) -> Result:
        model = self.models[call.model]
        result: Result = {"metrics": await anyio.to_thread.run_sync(model.optim_step, adam_settings(body))}
        if time.monotonic() - self.committed_at.get(call.model, -math.inf) >= self.commit_every_s:
            await anyio.to_thread.run_sync(self._commit, call, model, result)
            self.committed_at[call.model] = time.monotonic()
        return result

    def _commit(self, call: CallRecord, model: TrainingModel | RankedModel, result: Result) -> None:
        """The model's learner state after this step, written whole (by every rank), then committed."""
        folder = self.store.step_folder(call.model, model.steps)
        shutil.rmtree(folder, ignore_errors=True)  # what a kill left of this step's earlier try
        model.write_state(folder)
        self.store.commit(call.model, model.steps, call.seq, Outcome.of(result))

    async def _save_for_sampler(self, call: CallRecord, body: dict[str, Any]) -> Result:
        """The weights as they are now, kept for sampling under their `tinker://` path: a LoRA adapter written to
        the state folder, a full model's file in `checkpoints/{model_id}/sampler_weights/{seq}/`; journaled."""
        model = self.models[call.model]
        folder = self.checkpoints / call.model / "sampler_weights" / str(call.seq)  # a full model's file
        weights = await anyio.to_thread.run_sync(model.sampler_weights, folder)
        name = body.get("path") or f"step-{model.steps}-{call.seq}"
        path = f"tinker://{call.model}/sampler_weights/{name}"
        if isinstance(weights, AdapterVersion):
            file = await anyio.to_thread.run_sync(self.store.save_sampler, weights)
            self.journal.append(SamplerRecord(path, file=file, at=time.time(), version=model.steps))
        else:
            self.journal.append(SamplerRecord(path, notice=weights, at=time.time(), version=model.steps))
        await self.samplers.save(path, weights, version=model.steps)
        if body.get("path") is not None:
            return {"path": path, "type": "save_weights_for_sampler"}
        return {"path": path, "sampling_session_id": self.sampling_session(path), "type": "save_weights_for_sampler"}

    async def _save_state(self, call: CallRecord, body: dict[str, Any]) -> Result:
        folder = self.checkpoints / call.model / body["path"]

        def write() -> None:
            model = self.models[call.model]
            model.write_state(folder / "state")
            if model.lora is None:
                export_model(self.model_path, folder / "model", model.load_into, dtype="float32", force=True)
                return
            adapter = model.adapter()
            write_peft_folder(folder / "adapter", adapter.spec, adapter.tensors, self.model_path)

        await anyio.to_thread.run_sync(write)
        return {"path": f"tinker://{call.model}/weights/{body['path']}", "type": "save_weights"}
