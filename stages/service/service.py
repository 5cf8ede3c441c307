"""`Service`: what the endpoints act on: sessions and their heartbeats, the training models, the saved samplers
and the futures. Each method checks its request first and raises `Refused` naming what it does not support,
so an unsupported call fails at the call that names it; the work itself runs as a future (`Futures`).

Ids: sessions `session-N`, models `{session}:train:{model_seq_id}` (as the SDK derives them), sampling sessions
`sampler-N`; a saved sampler checkpoint is
`tinker://{model_id}/sampler_weights/{name}`. The calls of one model run in the order they arrived, one at a time.

World size: 1 (each model a `TrainingModel` in this process) or N (`world_size`: each model sharded over N ranks,
`stages.service.ranked.RankedModel`; the models' calls then run one at a time across all models, as the ranks'
collectives must not interleave).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np

from stages.learner.export import export_model
from stages.learner.lora import LoraSpec
from stages.learner.state import STATE_FILE, LearnerState
from stages.service import wire
from stages.service.futures import Futures, Result
from stages.service.losses import check_loss
from stages.service.ranked import RankedModel, ServiceRanks
from stages.service.refusals import Refused, check_lora_config, check_sampling_request, refuse_unless
from stages.service.sampling import BASE, Samplers, SamplerSettings
from stages.service.training import AdamSettings, TrainingModel, lora_spec
from stages.weights.adapter import write_peft_folder


class Sessions:
    """The SDK's sessions (`session-N`) and when each was last heard of (its heartbeats)."""

    def __init__(self) -> None:
        self.seen: dict[str, float] = {}  # id -> time of its last heartbeat
        self._ids = itertools.count(1)

    def create(self) -> str:
        session = f"session-{next(self._ids)}"
        self.seen[session] = time.monotonic()
        return session

    def heartbeat(self, session: str) -> None:
        refuse_unless(session in self.seen, f"unknown session_id {session!r}")
        self.seen[session] = time.monotonic()


class Service:
    """With `world_size` > 1 every training model is sharded over that many ranks (`stages.service.ranked`;
    their processes start here, from the caller's thread, and stop with `close`); `sampling` says which engine
    serves the saved weights (`stages.service.sampling`)."""

    def __init__(self, model_path: Path, checkpoints: Path, device: str = "cpu", seed: int = 0,
                 sampling: SamplerSettings | None = None, world_size: int = 1) -> None:
        self.model_path, self.checkpoints = model_path.resolve(), checkpoints
        self.name = str(self.model_path)  # the base model's name: its folder, which the SDK loads a tokenizer from
        self.device = device
        self.vocab = int(json.loads((self.model_path / "config.json").read_text()).get("vocab_size", 0))
        self.ranks: ServiceRanks | None = None
        if world_size > 1:
            self.ranks = ServiceRanks(self.model_path, world_size, device)
            self.ranks.start()
        self.sessions = Sessions()
        self.models: dict[str, TrainingModel | RankedModel] = {}
        self.lora: dict[str, LoraSpec | None] = {}  # model id -> its adapter's settings (None: full), known at once
        self.order: dict[str, asyncio.Lock] = {}  # per model: its calls run one at a time, in arrival order
        self.sampling_sessions: dict[str, str] = {}  # id -> the checkpoint it samples (BASE: the base model)
        self.sampling = sampling or SamplerSettings()
        self.samplers = Samplers(self.model_path, seed, device, self.sampling, log_dir=checkpoints.parent)
        self.futures = Futures()
        self._ids = itertools.count(1)

    def _new(self, kind: str) -> str:
        return f"{kind}-{next(self._ids)}"

    def _base(self, name: str | None) -> None:
        refuse_unless(name in (self.name, self.model_path.name),
                      f"base_model {name!r} is not served here; this service serves {self.name!r}")

    def create_model(self, body: dict[str, Any]) -> str:
        self._base(body.get("base_model"))
        lora = body.get("lora_config")  # absent: full fine-tuning, every weight trained
        if lora is not None:
            check_lora_config(lora)
        optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
        refuse_unless(optimizer == "adamw", f"optimizer_config.type {optimizer!r} is not supported; adamw only")
        spec = None if lora is None else lora_spec(lora["rank"], lora.get("train_attn", True),
                                                   lora.get("train_mlp", True), lora.get("train_unembed", True))
        model_id = self._model_id(body)
        self.lora[model_id] = spec

        async def make() -> Result:
            self.models[model_id] = await anyio.to_thread.run_sync(self._new_model, model_id, spec)
            return {"model_id": model_id, "type": "create_model"}

        self.order[model_id] = asyncio.Lock()
        return self.futures.start(self._in_order(model_id, make()))

    def _new_model(self, model_id: str, lora: LoraSpec | None, state: Path | None = None,
                   optimizer: bool = False) -> TrainingModel | RankedModel:
        """A model of this service's world size; from the checkpoint `state` (with its AdamW moments when
        `optimizer`), else from the base."""
        if self.ranks is not None:
            return RankedModel.create(self.ranks, model_id, lora, state, optimizer)
        model = TrainingModel(self.model_path, lora, self.device)
        if state is not None:
            model.read_state(state, optimizer)
        return model

    def _model_id(self, body: dict[str, Any]) -> str:
        """`{session_id}:train:{model_seq_id}`, the id the SDK derives for a model it creates by loading."""
        session, seq = body.get("session_id", ""), body.get("model_seq_id")
        refuse_unless(session in self.sessions.seen, f"unknown session_id {session!r}")
        model_id = f"{session}:train:{seq}"
        refuse_unless(isinstance(seq, int) and model_id not in self.order, f"model_seq_id {seq!r} is taken or not "
                                                                           "an integer")
        return model_id

    def _retried(self, model_id: str, seq_id: int | None) -> str | None:
        """The request id of the model's call `seq_id` when a request with that seq_id came before: a retried
        request gets the first one's future and is applied once. None for a new call (or one without seq_id)."""
        return self.futures.by_key((model_id, seq_id)) if seq_id else None

    def _start(self, model_id: str, seq_id: int | None, work) -> str:
        """Start the model's call `seq_id` (in arrival order, `_in_order`) and remember it for a retry."""
        return self.futures.start(self._in_order(model_id, work), (model_id, seq_id) if seq_id else None)

    async def _in_order(self, model_id: str, work) -> Result:
        async with self.order[model_id]:
            return await work

    def _model(self, model_id: str) -> TrainingModel | RankedModel:
        refuse_unless(model_id in self.order, f"unknown model_id {model_id!r}")
        return self.models[model_id]

    def info(self, model_id: str) -> dict[str, Any]:
        model = self._model(model_id)
        lora = model.lora
        return {"type": "get_info", "model_id": model_id, "is_lora": lora is not None,
                "lora_rank": None if lora is None else lora.rank,
                "model_name": self.name, "model_data": {"arch": "causal_lm", "model_name": self.name,
                                                        "tokenizer_id": self.name}}

    def forward_backward(self, body: bytes) -> str:
        request = wire.decode_forward_backward(body)
        refuse_unless(request.model_id in self.order, f"unknown model_id {request.model_id!r}")
        if retried := self._retried(request.model_id, request.seq_id):
            return retried
        names = [set(d.inputs) for d in request.data]
        refuse_unless(all(n == names[0] for n in names), "every datum must carry the same loss_fn_inputs")
        settings = check_loss(request.loss_fn, request.config, names[0])
        self._check_tokens(request.data)

        async def run() -> Result:
            model = self.models[request.model_id]
            rows, metrics = await anyio.to_thread.run_sync(model.forward_backward, request.data, request.loss_fn,
                                                           settings, not request.forward_only)
            return wire.forward_backward_output(rows, metrics)

        return self._start(request.model_id, request.seq_id, run())

    def _check_tokens(self, data: list[wire.Datum]) -> None:
        """Every input and target token is an id of the base model's vocabulary (a bad id would fail the forward
        part-way, on one rank of several)."""
        for i, datum in enumerate(data):
            for name, ids in (("model_input", datum.tokens), ("target_tokens", datum.inputs.get("target_tokens"))):
                bad = np.zeros(0) if ids is None or self.vocab <= 0 else ids[(ids < 0) | (ids >= self.vocab)]
                if bad.size:
                    raise Refused(f"datum {i}: {name} holds token id {int(bad[0])}, outside the model's "
                                  f"vocabulary (0..{self.vocab - 1})")

    def optim_step(self, body: dict[str, Any]) -> str:
        model_id = body.get("model_id", "")
        refuse_unless(model_id in self.order, f"unknown model_id {model_id!r}")
        if retried := self._retried(model_id, body.get("seq_id")):
            return retried
        params = body.get("adam_params")
        refuse_unless(params is not None, "optim_step takes adam_params only (AdamW); other optimizers are refused")
        unknown = sorted(set(params) - set(AdamSettings.__dataclass_fields__))
        refuse_unless(not unknown, f"adam_params keys {unknown} are not supported")
        adam = AdamSettings(**params)

        async def run() -> Result:
            metrics = await anyio.to_thread.run_sync(self.models[model_id].optim_step, adam)
            return {"metrics": metrics}

        return self._start(model_id, body.get("seq_id"), run())

    def save_for_sampler(self, body: dict[str, Any]) -> str:
        model_id = body.get("model_id", "")
        refuse_unless(model_id in self.order, f"unknown model_id {model_id!r}")
        if retried := self._retried(model_id, body.get("seq_id")):
            return retried
        refuse_unless(body.get("kind", "snapshot") == "snapshot", "kind 'inflight' samplers are not supported yet")
        refuse_unless(body.get("ttl_seconds") is None, "ttl_seconds is not supported: what is saved here stays")
        name, seq = body.get("path"), body.get("sampling_session_seq_id")
        refuse_unless((name is None) != (seq is None), "save_weights_for_sampler takes a path or a "
                                                       "sampling_session_seq_id")
        why = self.samplers.refusal(self.lora[model_id])
        refuse_unless(why is None, f"save_weights_for_sampler: {why}")

        async def run() -> Result:
            model = self.models[model_id]
            folder = self.checkpoints / model_id / "sampler_weights" / str(next(self._ids))  # a full model's file
            weights = await anyio.to_thread.run_sync(model.sampler_weights, folder)
            path = f"tinker://{model_id}/sampler_weights/{name or f'step-{model.steps}-{next(self._ids)}'}"
            await self.samplers.save(path, weights)
            if name is not None:
                return {"path": path, "type": "save_weights_for_sampler"}
            session = self._new("sampler")
            self.sampling_sessions[session] = path
            return {"path": path, "sampling_session_id": session, "type": "save_weights_for_sampler"}

        return self._start(model_id, body.get("seq_id"), run())

    def save_state(self, body: dict[str, Any]) -> str:
        """`save_weights` (the SDK's `save_state`): the learner's checkpoint of the model (its trained weights: the
        adapter, or all of them; and the optimizer state; `PolicyTrainer.write_state`) in
        `checkpoints/{model_id}/{name}/state`, and beside it the adapter as a PEFT folder (`adapter`), which any
        peft user can load, or a fully fine-tuned model as a Hugging Face folder (`model`, float32)."""
        model_id, name = body.get("model_id", ""), body.get("path")
        refuse_unless(model_id in self.order, f"unknown model_id {model_id!r}")
        if retried := self._retried(model_id, body.get("seq_id")):
            return retried
        refuse_unless(isinstance(name, str) and name.replace("-", "").replace("_", "").isalnum(),
                      f"save_weights path must be a plain name (letters, digits, - and _), got {name!r}")
        refuse_unless(body.get("ttl_seconds") is None, "ttl_seconds is not supported: what is saved here stays")
        folder = self.checkpoints / model_id / name
        refuse_unless(body.get("overwrite", False) or not folder.exists(),
                      f"checkpoint {name!r} of {model_id} exists; pass overwrite=True to replace it")

        def write() -> None:
            model = self.models[model_id]
            model.write_state(folder / "state")
            if model.lora is None:
                export_model(self.model_path, folder / "model", model.load_into, dtype="float32", force=True)
                return
            adapter = model.adapter()
            write_peft_folder(folder / "adapter", adapter.spec, adapter.tensors, self.model_path)

        async def run() -> Result:
            await anyio.to_thread.run_sync(write)
            return {"path": f"tinker://{model_id}/weights/{name}", "type": "save_weights"}

        return self._start(model_id, body.get("seq_id"), run())

    def load_state(self, body: dict[str, Any]) -> str:
        """`load_weights` as the SDK's `create_training_client_from_state[_with_optimizer]` sends it: a new model
        (`session_id`, `model_seq_id`) made from a checkpoint `save_state` wrote, of its kind (LoRA with its
        adapter settings, or full fine-tuning), with its optimizer state when `optimizer` is true (else a fresh
        AdamW)."""
        path = body.get("path", "")
        refuse_unless(body.get("model_id") is None, "load_weights into an existing model is not supported; create "
                                                    "a training client from the state instead")
        refuse_unless(not body.get("weights_access_token"), "weights_access_token is not supported")
        if body.get("base_model") is not None:
            self._base(body["base_model"])
        prefix, _, rest = path.partition("tinker://")
        owner, _, name = rest.partition("/weights/")
        state = self.checkpoints / owner / name / "state"
        refuse_unless(not prefix and bool(owner) and bool(name) and (state / STATE_FILE).is_file(),
                      f"path {path!r} names no checkpoint save_state wrote here (tinker://MODEL_ID/weights/NAME)")
        lora = msgspec.json.decode((state / STATE_FILE).read_bytes(), type=LearnerState).lora  # None: full
        model_id = self._model_id(body)
        self.lora[model_id] = lora

        async def make() -> Result:  # without optimizer: weights only, AdamW starts afresh
            self.models[model_id] = await anyio.to_thread.run_sync(self._new_model, model_id, lora, state,
                                                                   bool(body.get("optimizer")))
            return {"path": path, "model_id": model_id, "type": "load_weights"}

        self.order[model_id] = asyncio.Lock()
        return self.futures.start(self._in_order(model_id, make()))

    def create_sampling_session(self, body: dict[str, Any]) -> str:
        path = body.get("model_path")
        if path is None:
            self._base(body.get("base_model"))
            path = BASE
        refuse_unless(self.samplers.knows(path), f"model_path {path!r} names no sampler weights saved here")
        session = self._new("sampler")
        self.sampling_sessions[session] = path
        return session

    def sampler(self, session: str) -> dict[str, Any]:
        refuse_unless(session in self.sampling_sessions, f"unknown sampling session {session!r}")
        path = self.sampling_sessions[session]
        return {"sampler_id": session, "base_model": self.name, "model_path": None if path == BASE else path}

    def sample(self, body: dict[str, Any]) -> tuple[str, list[str]]:
        check_sampling_request(body)
        session = body.get("sampling_session_id")
        if session is not None:
            refuse_unless(session in self.sampling_sessions, f"unknown sampling_session_id {session!r}")
            path = self.sampling_sessions[session]
        else:
            path = body.get("model_path") or BASE
            refuse_unless(self.samplers.knows(path), f"model_path {path!r} names no sampler weights saved here")
        chunks = body["prompt"]["chunks"]
        refuse_unless(all(c.get("type", "encoded_text") == "encoded_text" for c in chunks),
                      "prompt chunks other than encoded_text are not supported")
        prompt = [int(t) for c in chunks for t in c["tokens"]]
        refuse_unless(bool(prompt), "the prompt is empty")
        n = int(body.get("num_samples", 1))

        async def run() -> Result:
            scored = await self.samplers.prompt_logprobs(path, prompt) if body.get("prompt_logprobs") else None
            return wire.sample_response(await self.samplers.sample(path, prompt, n, body["sampling_params"]), scored)

        request_id = self.futures.start(run())
        return request_id, [f"{request_id}-{i}" for i in range(n)]

    async def close(self) -> None:
        await self.futures.close()
        await self.samplers.close()
        if self.ranks is not None:
            await anyio.to_thread.run_sync(self.ranks.close)
