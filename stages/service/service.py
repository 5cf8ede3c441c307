"""`Service`: what the endpoints act on: sessions and their heartbeats, the training models, the saved samplers
and the futures. Each method checks its request first and raises `Refused` naming what it does not support,
so an unsupported call fails at the call that names it; the work itself runs as a future (`Futures`), made by
`Calls` from the call's journal record.

Durable: a call that changes state is journaled (`Journal`, in the state folder) before its request id is
answered, and its result when it finishes; each `optim_step` commits the model's learner state (`Store`). A
service restarted over the same state folder (`stages.service.recovery`) comes back with its sessions, models
at their last committed step, samplers and results, and runs again what was accepted after the commit. The
journal is compacted when a restart reads it and when it grows past `COMPACT_BYTES` (`compact`).

Ids: sessions `session-N`, models `{session}:train:{model_seq_id}` (as the SDK derives them), sampling sessions
`sampler-N`; a model's call `seq` has the request id `{model_id}/{seq}` (`call_id`; 0: the call that made it),
in every run of the service. A saved sampler checkpoint is `tinker://{model_id}/sampler_weights/{name}`. The
calls of one model run in the order they arrived, one at a time; they arrive in seq_id order (the SDK sends
each after the one before was accepted), so a seq_id at or below the last accepted one is a retry.

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

from pipeline.telemetry import get_logger
from stages.learner.lora import LoraSpec
from stages.service import wire
from stages.service.calls import COMMIT_EVERY_S, Calls, adam_settings, checkpoint_state, spec_of
from stages.service.futures import Futures, Result, call_id, settle
from stages.service.journal import (
    CallRecord,
    DoneRecord,
    Journal,
    Outcome,
    SamplingRecord,
    SessionRecord,
    StateError,
    compacted,
    plan,
    read_journal,
    rewrite,
)
from stages.service.ledger import Ledger
from stages.service.losses import check_loss
from stages.service.ranked import ServiceRanks
from stages.service.refusals import Refused, check_lora_config, check_sampling_request, refuse_unless
from stages.service.sampling import BASE, Samplers, SamplerSettings
from stages.service.store import Store


class Sessions:
    """The SDK's sessions (`session-N`; with another `kind`, `kind-N`) and when each was last heard of (its
    heartbeats)."""

    def __init__(self, kind: str = "session") -> None:
        self.kind = kind
        self.seen: dict[str, float] = {}  # id -> time of its last heartbeat
        self._ids = itertools.count(1)

    def create(self) -> str:
        session = f"{self.kind}-{next(self._ids)}"
        self.seen[session] = time.monotonic()
        return session

    def restore(self, session: str) -> None:
        """A session a restarted service had: known again, and its number never given out again."""
        self.seen[session] = time.monotonic()
        self._ids = itertools.count(max(next(self._ids), int(session.rsplit("-", 1)[1]) + 1))

    def heartbeat(self, session: str) -> None:
        refuse_unless(session in self.seen, f"unknown session_id {session!r}")
        self.seen[session] = time.monotonic()


COMPACT_BYTES = 64 * 2**20  # a journal past this (and past twice its size after the last compaction) is compacted


def check_base(name: str | None, model_path: Path) -> None:
    refuse_unless(name in (str(model_path), model_path.name),
                  f"base_model {name!r} is not served here; this service serves {str(model_path)!r}")


def check_tokens(data: list[wire.Datum], vocab: int) -> None:
    """Every input and target token is an id of the base model's vocabulary of `vocab` ids (a bad id would fail
    the forward part-way, on one rank of several)."""
    for i, datum in enumerate(data):
        for name, ids in (("model_input", datum.tokens), ("target_tokens", datum.inputs.get("target_tokens"))):
            bad = np.zeros(0) if ids is None or vocab <= 0 else ids[(ids < 0) | (ids >= vocab)]
            if bad.size:
                raise Refused(f"datum {i}: {name} holds token id {int(bad[0])}, outside the model's "
                              f"vocabulary (0..{vocab - 1})")


class Service:
    """With `world_size` > 1 every training model is sharded over that many ranks (`stages.service.ranked`;
    their processes start here, from the caller's thread, and stop with `close`); `sampling` says which engine
    serves the saved weights (`stages.service.sampling`)."""

    def __init__(self, model_path: Path, checkpoints: Path, state: Path, device: str = "cpu", seed: int = 0,
                 sampling: SamplerSettings | None = None, world_size: int = 1,
                 commit_every_s: float = COMMIT_EVERY_S) -> None:
        self.model_path, self.checkpoints = model_path.resolve(), checkpoints
        self.name = str(self.model_path)  # the base model's name: its folder, which the SDK loads a tokenizer from
        self.vocab = int(json.loads((self.model_path / "config.json").read_text()).get("vocab_size", 0))
        self.ranks: ServiceRanks | None = None
        if world_size > 1:
            self.ranks = ServiceRanks(self.model_path, world_size, device)
            self.ranks.start()
        self.sessions = Sessions()
        self.lora: dict[str, LoraSpec | None] = {}  # model id -> its adapter's settings (None: full), known at once
        self.order: dict[str, asyncio.Lock] = {}  # per model: its calls run one at a time, in arrival order
        self.last_seq: dict[str, int] = {}  # per model: the seq_id of the last call it accepted
        self.sampling_sessions: dict[str, str] = {}  # id -> the checkpoint it samples (BASE: the base model)
        self.sampling = sampling or SamplerSettings()
        self.samplers = Samplers(self.model_path, seed, device, self.sampling, log_dir=checkpoints.parent)
        self.futures = Futures()
        self.store = Store(state, self.model_path)  # first: it refuses another model's state folder
        self.journal = Journal(state)
        self.ledger = Ledger(state)  # each datum trained and each sample drawn, by version
        self.calls = Calls(self.model_path, checkpoints, device, self.journal, self.store, self.samplers,
                           self.sampling_session, self.ranks, commit_every_s, self.ledger)
        self.models = self.calls.models
        self.sampler_ids = Sessions("sampler")
        self._compact_at = COMPACT_BYTES

    def create_session(self) -> str:
        session = self.sessions.create()
        self.journal.append(SessionRecord(session))
        return session

    def sampling_session(self, path: str) -> str:
        """A new sampling session of the checkpoint `path` (journaled): its id."""
        session = self.sampler_ids.create()
        self.journal.append(SamplingRecord(session, path))
        self.sampling_sessions[session] = path
        return session

    def run(self, call: CallRecord, work=None) -> str:
        """Start the call (its work made from its record unless given) after the model's earlier calls; its
        result journaled when it finishes. Its request id."""
        work = work if work is not None else self.calls.work(call)
        return self.futures.start(self._in_order(call, work), call_id(call.model, call.seq))

    def _accept(self, model_id: str, seq: int, kind: str, body: bytes | dict[str, Any]) -> str:
        """Journal the call (on disk before its id is answered), then run it."""
        raw = body if isinstance(body, bytes) else msgspec.json.encode(body)
        call = CallRecord(model_id, seq, kind, raw)
        self.journal.append(call)
        self.last_seq[model_id] = seq
        return self.run(call)

    async def _in_order(self, call: CallRecord, work) -> Result:
        async with self.order[call.model]:
            result = await settle(work)
            self.journal.append(DoneRecord(call.model, call.seq, Outcome.of(result), time.time()))
        if self.journal.size() > self._compact_at:
            try:
                self.compact()
            except (OSError, StateError) as exc:  # the call's result stands: the journal is whole, only longer
                self._compact_at = 2 * self.journal.size()
                get_logger("serve").warning("journal compaction failed; kept whole", error=str(exc))
        return result

    def compact(self) -> None:
        """Rewrite the journal with what a restart needs (`journal.compacted`), at once (no await: nothing is
        appended meanwhile); next when it has grown past twice that size (and `COMPACT_BYTES`)."""
        records = read_journal(self.store.folder)
        rewrite(self.store.folder, compacted(records, plan(records, self.store.commits(),
                                                            time.time() - self.futures.keep_s)))
        self.journal.reopen()
        self._compact_at = max(COMPACT_BYTES, 2 * self.journal.size())

    def create_model(self, body: dict[str, Any]) -> str:
        check_base(body.get("base_model"), self.model_path)
        lora = body.get("lora_config")  # absent: full fine-tuning, every weight trained
        if lora is not None:
            check_lora_config(lora)
        optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
        refuse_unless(optimizer == "adamw", f"optimizer_config.type {optimizer!r} is not supported; adamw only")
        model_id = self._model_id(body)
        self.lora[model_id] = spec_of(body)
        self.order[model_id] = asyncio.Lock()
        return self._accept(model_id, 0, "create_model", body)

    def _model_id(self, body: dict[str, Any]) -> str:
        """`{session_id}:train:{model_seq_id}`, the id the SDK derives for a model it creates by loading."""
        session, seq = body.get("session_id", ""), body.get("model_seq_id")
        refuse_unless(session in self.sessions.seen, f"unknown session_id {session!r}")
        model_id = f"{session}:train:{seq}"
        refuse_unless(isinstance(seq, int) and model_id not in self.order, f"model_seq_id {seq!r} is taken or not "
                                                                           "an integer")
        return model_id

    def _retried(self, model_id: str, seq: Any) -> str | None:
        """The request id of the model's call `seq` when it came before (a retry gets the first call's future and
        is applied once); None for a new call. `Refused` for a seq_id that is not a new one."""
        refuse_unless(model_id in self.order, f"unknown model_id {model_id!r}")
        refuse_unless(isinstance(seq, int) and seq > 0, f"seq_id {seq!r}: a model's calls carry a positive "
                                                        "integer seq_id, the SDK's numbering from 1")
        if self.futures.known(call_id(model_id, seq)):
            return call_id(model_id, seq)
        last = self.last_seq.get(model_id, 0)
        refuse_unless(seq > last, f"seq_id {seq} of {model_id} was accepted before (the last is {last}) and its "
                                  "result is no longer kept: it is not applied twice")
        return None

    async def info(self, model_id: str) -> dict[str, Any]:
        """The model's `get_info`, once it is made (a restarted service makes its models again first)."""
        refuse_unless(model_id in self.order, f"unknown model_id {model_id!r}")
        if model_id not in self.models and self.futures.known(call_id(model_id, 0)):
            await self.futures.result(call_id(model_id, 0))
        refuse_unless(model_id in self.models, f"model {model_id!r} was not made: its create call failed, or "
                                               "is still running (ask again)")
        lora = self.models[model_id].lora
        return {"type": "get_info", "model_id": model_id, "is_lora": lora is not None,
                "lora_rank": None if lora is None else lora.rank,
                "model_name": self.name, "model_data": {"arch": "causal_lm", "model_name": self.name,
                                                        "tokenizer_id": self.name}}

    def forward_backward(self, body: bytes) -> str:
        request = wire.decode_forward_backward(body)
        if retried := self._retried(request.model_id, request.seq_id):
            return retried
        names = [set(d.inputs) for d in request.data]
        refuse_unless(all(n == names[0] for n in names), "every datum must carry the same loss_fn_inputs")
        check_loss(request.loss_fn, request.config, names[0])
        check_tokens(request.data, self.vocab)
        return self._accept(request.model_id, request.seq_id, "forward_backward", body)

    def optim_step(self, body: dict[str, Any]) -> str:
        model_id, seq = body.get("model_id", ""), body.get("seq_id")
        if retried := self._retried(model_id, seq):
            return retried
        adam_settings(body)
        return self._accept(model_id, seq, "optim_step", body)

    def save_for_sampler(self, body: dict[str, Any]) -> str:
        model_id, seq = body.get("model_id", ""), body.get("seq_id")
        if retried := self._retried(model_id, seq):
            return retried
        refuse_unless(body.get("kind", "snapshot") == "snapshot", "kind 'inflight' samplers are not supported yet")
        refuse_unless(body.get("ttl_seconds") is None, "ttl_seconds is not supported: what is saved here stays")
        refuse_unless((body.get("path") is None) != (body.get("sampling_session_seq_id") is None),
                      "save_weights_for_sampler takes a path or a sampling_session_seq_id")
        why = self.samplers.refusal(self.lora[model_id])
        refuse_unless(why is None, f"save_weights_for_sampler: {why}")
        return self._accept(model_id, seq, "save_weights_for_sampler", body)

    def save_state(self, body: dict[str, Any]) -> str:
        """`save_weights` (the SDK's `save_state`): the learner's checkpoint of the model (its trained weights: the
        adapter, or all of them; and the optimizer state; `PolicyTrainer.write_state`) in
        `checkpoints/{model_id}/{name}/state`, and beside it the adapter as a PEFT folder (`adapter`), which any
        peft user can load, or a fully fine-tuned model as a Hugging Face folder (`model`, float32)."""
        model_id, seq, name = body.get("model_id", ""), body.get("seq_id"), body.get("path")
        if retried := self._retried(model_id, seq):
            return retried
        refuse_unless(isinstance(name, str) and name.replace("-", "").replace("_", "").isalnum(),
                      f"save_weights path must be a plain name (letters, digits, - and _), got {name!r}")
        refuse_unless(body.get("ttl_seconds") is None, "ttl_seconds is not supported: what is saved here stays")
        refuse_unless(body.get("overwrite", False) or not (self.checkpoints / model_id / name).exists(),
                      f"checkpoint {name!r} of {model_id} exists; pass overwrite=True to replace it")
        return self._accept(model_id, seq, "save_weights", body)

    def load_state(self, body: dict[str, Any]) -> str:
        """`load_weights` as the SDK's `create_training_client_from_state[_with_optimizer]` sends it: a new model
        (`session_id`, `model_seq_id`) made from a checkpoint `save_state` wrote, of its kind (LoRA with its
        adapter settings, or full fine-tuning), with its optimizer state when `optimizer` is true (else a fresh
        AdamW)."""
        refuse_unless(body.get("model_id") is None, "load_weights into an existing model is not supported; create "
                                                    "a training client from the state instead")
        refuse_unless(not body.get("weights_access_token"), "weights_access_token is not supported")
        if body.get("base_model") is not None:
            check_base(body["base_model"], self.model_path)
        _, lora = checkpoint_state(self.checkpoints, body.get("path", ""))
        model_id = self._model_id(body)
        self.lora[model_id] = lora
        self.order[model_id] = asyncio.Lock()
        return self._accept(model_id, 0, "load_weights", body)

    def create_sampling_session(self, body: dict[str, Any]) -> str:
        path = body.get("model_path")
        if path is None:
            check_base(body.get("base_model"), self.model_path)
            path = BASE
        refuse_unless(self.samplers.knows(path), f"model_path {path!r} names no sampler weights saved here")
        return self.sampling_session(path)

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
            samples = await self.samplers.sample(path, prompt, n, body["sampling_params"])
            self.ledger.sampled(request_id, path, self.samplers.when[path].version, len(prompt),
                                [len(tokens) for tokens, _, _ in samples])
            return wire.sample_response(samples, scored)

        request_id = self.futures.start(run())  # set before `run` gets to the ledger: it awaits the sample first
        return request_id, [f"{request_id}-{i}" for i in range(n)]

    async def close(self) -> None:
        await self.futures.close()
        await self.samplers.close()
        self.journal.close()
        self.ledger.close()
        if self.ranks is not None:
            await anyio.to_thread.run_sync(self.ranks.close)
