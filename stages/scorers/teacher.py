"""On-policy distillation, producer side: a teacher scores the student's own sampled tokens.

A teacher returns, for a token sequence, the logprob of every token given the ones before it, at
temperature 1 (`stages.scorers.base.Teacher`):
- `TorchTeacher`: a model folder run in this process with torch (the cheap path on a CPU or a laptop);
- `SGLangTeacher`: SGLang's `/generate` with the sequence as `input_ids`, `max_new_tokens = 0`,
  `return_logprob` and `logprob_start_len = 0` (input-token logprobs), on a server baton launches from a
  folder or one given by url.

`Distillation` scores a finished group in the producer, beside its reward and off the learner's path:
every episode's whole token row (prompt, model turns, environment replies: multi-turn included) goes to
the sample's teacher, and the row's `teacher_logprobs` (a codec token field, `TEACHER_FIELD`) holds the
teacher's logprob at each model token and 0 at every other token, as `logprobs` does. With several
teachers, the sample's metadata field `key` names its teacher. A teacher that fails (a timeout, its server
gone past its restarts, no teacher for the sample) fails the group, counted: with `on_error = "zero"` its
rows get the student's own behaviour logprobs (a log-ratio of 0: no teacher term) and train on their
reward; with "drop" the group is dropped with the reason "teacher failed".
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch

from stages.data.model import load_model
from stages.data.rewards import ON_ERROR
from stages.scorers.base import ScorerError, Teacher, record
from stages.scorers.server import ScoringServer, Served, ServerSettings

TEACHER_FIELD = "teacher_logprobs"
TEACHER_TIMEOUT_S = 60.0  # a teacher request scores whole rows: the default of [distill] timeout_s


@dataclass(eq=False)
class _Request:
    """One caller's sequences, waiting to join a forward; `done` is set once `result` or `error` is."""

    sequences: Sequence[Sequence[int]]
    done: anyio.Event = field(default_factory=anyio.Event)
    result: list[np.ndarray] | None = None
    error: BaseException | None = None


@dataclass
class TorchTeacher:
    """A teacher model folder scored in this process (rows padded on the right).

    Forwards run one at a time; the groups that ask while one runs wait and then go together in the next
    forward, up to `max_batch_rows` rows (always at least one group): on a small model a forward's fixed
    cost, not its rows, is what a group pays. Each caller gets exactly its own rows back, in its order."""

    model: str | Path
    dtype: str = "float32"
    name: str = "teacher"
    max_batch_rows: int = 256
    stats: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._model: torch.nn.Module | None = None
        self._lock: anyio.Lock | None = None
        self._pending: list[_Request] = []

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    async def start(self, log_dir: Path | None = None) -> None:
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:  # workers start together: the model is loaded once
            if self._model is None:
                self._model = await anyio.to_thread.run_sync(lambda: load_model(self.model, self.dtype).eval())

    async def stop(self) -> None:
        return None

    async def logprobs(self, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
        if self._model is None or self._lock is None:
            raise ScorerError("not started", f"teacher {self.name} is not started")
        request = _Request(sequences)
        self._pending.append(request)
        try:
            async with self._lock:  # one forward at a time: torch uses this process's thread for it
                if not request.done.is_set():  # else an earlier forward took it along
                    await self._forward_pending()
        finally:  # a caller cancelled while it waited leaves nothing for a later forward
            if request in self._pending:
                self._pending.remove(request)
        if request.error is not None:
            raise request.error
        return request.result

    async def _forward_pending(self) -> None:
        """One forward over the oldest waiting requests, up to `max_batch_rows` rows."""
        batch, rows = [], 0
        while self._pending and (not batch or rows + len(self._pending[0].sequences) <= self.max_batch_rows):
            batch.append(self._pending.pop(0))
            rows += len(batch[-1].sequences)
        joined = [s for request in batch for s in request.sequences]
        try:
            values = await anyio.to_thread.run_sync(forward_logprobs, self._model, joined)
        except Exception as exc:  # every caller in the batch sees the failure
            values, error = None, exc
        self.stats["forwards"] = self.stats.get("forwards", 0) + 1
        self.stats["forward_rows"] = self.stats.get("forward_rows", 0) + rows
        start = 0
        for request in batch:
            if values is None:
                request.error = error
            else:
                request.result = values[start: start + len(request.sequences)]
            start += len(request.sequences)
            request.done.set()


@torch.no_grad()
def forward_logprobs(model: torch.nn.Module, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Per sequence, the logprob of each token after the first under `model` (temperature 1)."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        attention[i, : len(s)] = 1
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None]).squeeze(-1).numpy()
    return [logp[i, : len(s) - 1].astype(np.float32) for i, s in enumerate(sequences)]


@dataclass
class SGLangTeacher(Served):
    """A teacher on an SGLang server: launched from the settings' `model` (a folder), or attached by `url`."""

    settings: ServerSettings
    name: str = "teacher"
    stats: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.server = ScoringServer(self.name, self.settings, self.stats)

    async def logprobs(self, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
        body = {"input_ids": [list(map(int, s)) for s in sequences], "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}}
        answer = await self.server.post("/generate", body)
        items = answer if isinstance(answer, list) else [answer]
        if len(items) != len(sequences):
            raise ScorerError("bad answer", f"{len(items)} results for {len(sequences)} sequences")
        return [self._read(item, s) for item, s in zip(items, sequences, strict=True)]

    def _read(self, item: Any, sequence: Sequence[int]) -> np.ndarray:
        """The input logprobs of one answer: `[logprob, id, text]` per input token, None for the first."""
        try:
            pairs = item["meta_info"]["input_token_logprobs"]
            ids = [int(p[1]) for p in pairs]
            values = np.asarray([p[0] for p in pairs[1:]], dtype=np.float32)
        except (KeyError, TypeError, IndexError, ValueError):
            raise ScorerError("bad answer", str(item)[:200]) from None
        if ids != [int(t) for t in sequence]:
            raise ScorerError("bad answer", f"the server scored {len(ids)} other tokens than the {len(sequence)} sent")
        return values


@dataclass
class Distillation:
    """The run's teachers and which teacher scores which sample (see the module docstring)."""

    teachers: dict[str, Teacher]
    key: str | None = None  # with several teachers: the sample's metadata field naming its teacher
    on_error: str = "zero"
    stats: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.teachers:
            raise ValueError("distill: no teacher")
        if len(self.teachers) > 1 and self.key is None:
            raise ValueError(f"distill: {len(self.teachers)} teachers ({', '.join(self.teachers)}) need "
                             "distill.teacher_key, the sample field that names each sample's teacher")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"distill.on_error must be one of {ON_ERROR}, got {self.on_error!r}")

    async def start(self, log_dir: Path | None = None) -> None:
        for teacher in self.teachers.values():
            await teacher.start(log_dir)

    async def stop(self) -> None:
        for teacher in self.teachers.values():
            await teacher.stop()

    def teacher_of(self, metadata: dict | None) -> Teacher:
        """The sample's teacher: the only one, or the one its `key` field names."""
        if self.key is None:
            return next(iter(self.teachers.values()))
        name = (metadata or {}).get(self.key)
        if str(name) not in self.teachers:
            raise ScorerError("no teacher", f"sample field {self.key!r} = {name!r} names none of "
                              f"{', '.join(self.teachers)}")
        return self.teachers[str(name)]

    async def score(self, metadata: dict | None,
                    rows: list[dict[str, np.ndarray]]) -> tuple[list[np.ndarray], str | None]:
        """Per codec row (`tokens`, `logprobs`, `loss_mask`), its `teacher_logprobs`; and the failure's reason
        (None: none), in which case the rows' own behaviour logprobs stand in (see the module docstring)."""
        t0 = time.perf_counter()
        try:
            teacher = self.teacher_of(metadata)
            scored = await teacher.logprobs([row["tokens"].tolist() for row in rows])
            out = [aligned(row, values) for row, values in zip(rows, scored, strict=True)]
            failure = None
        except ScorerError as exc:
            out, failure = [row["logprobs"].astype(np.float32) for row in rows], f"teacher {exc.reason}"
        record(self.stats, time.perf_counter() - t0, failure)
        return out, failure


def aligned(row: dict[str, np.ndarray], values: np.ndarray) -> np.ndarray:
    """A row's token field from a teacher's `len(tokens) - 1` logprobs: each model token's value, 0 elsewhere."""
    tokens, mask = row["tokens"], row["loss_mask"]
    if len(values) != len(tokens) - 1:
        raise ScorerError("bad answer", f"{len(values)} logprobs for a row of {len(tokens)} tokens")
    out = np.zeros(len(tokens), dtype=np.float32)
    out[1:] = values
    out[mask == 0] = 0.0
    return out
