"""The service's write-ahead journal: every call it accepted, in the order it accepted them, and how each ended.

`state/journal.jsonl` holds one msgspec-JSON record a line, appended and fsync'd before the call's answer leaves
(an accepted call is on disk before the client learns its request id) and before a finished call's result is
answered. Records: `SessionRecord` (a `create_session`), `SamplingRecord` (a sampling session and the checkpoint
it samples), `CallRecord` (a model's call `seq` of `kind` with its request body: `create_model` and
`load_weights` are the model's call 0, the SDK numbers the rest from 1), `DoneRecord` (the call's result) and
`SamplerRecord` (where a saved sampler's adapter was written). A line cut short by a kill is the journal's last
and is dropped on reading: its call was never answered.

`plan` is the restart's logic, kept pure so it is tested alone: given the records and each model's committed
step (`Commit`: the seq of the `optim_step` whose learner state is on disk), each model's calls split into the
finished ones whose result stands (up to the commit, and the saves after it that had finished: their files are
on disk) and the ones to run again on the reloaded state (every call after the commit that changed or read the
state: `forward_backward`, `optim_step`, and the unfinished saves; a call that failed stays failed, its result
stands), in order. Replaying them is deterministic on
CPU, so the model comes back exactly where it was, no step applied twice and none lost.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from stages.service.futures import Failure, Result
from stages.weights.disk import DiskNotice

JOURNAL_FILE = "journal.jsonl"


class StateError(ValueError):
    """The state folder cannot bring the service back: a damaged journal, another model's folder."""


MAKERS = ("create_model", "load_weights")  # a model's call 0: what made it
REPLAYED = ("forward_backward", "optim_step")  # after the commit, run again even when they had finished


class Outcome(msgspec.Struct, omit_defaults=True):
    """A `Result` as a record holds it: a JSON dict, protobuf bytes, or a failure's message and category."""

    json: dict | None = None
    proto: bytes | None = None
    error: str | None = None
    category: str = "server"

    @classmethod
    def of(cls, result: Result) -> Outcome:
        if isinstance(result, Failure):
            return cls(error=result.error, category=result.category)
        return cls(proto=result) if isinstance(result, bytes) else cls(json=result)

    def result(self) -> Result:
        if self.error is not None:
            return Failure(self.error, self.category)
        return self.proto if self.proto is not None else (self.json or {})


class SessionRecord(msgspec.Struct, tag="session"):
    id: str


class SamplingRecord(msgspec.Struct, tag="sampling"):
    id: str
    path: str


class CallRecord(msgspec.Struct, tag="call"):
    model: str
    seq: int
    kind: str
    body: bytes  # the request as it came: JSON, or the forward_backward protobuf


class DoneRecord(msgspec.Struct, tag="done"):
    model: str
    seq: int
    outcome: Outcome
    at: float = 0.0  # when it finished (time.time()): a result is kept `Futures.keep_s` after, across restarts


class SamplerRecord(msgspec.Struct, tag="sampler", omit_defaults=True):
    path: str  # the checkpoint's tinker:// path
    file: str | None = None  # a LoRA adapter's file, relative to the state folder
    notice: DiskNotice | None = None  # a fully fine-tuned model's weights file
    at: float = 0.0  # when it was saved (time.time()); 0: a journal written before saves carried their time
    version: int | None = None  # the model's step when it was saved


Record = SessionRecord | SamplingRecord | CallRecord | DoneRecord | SamplerRecord
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Record)


class Journal:
    """Appends records to `folder/journal.jsonl`, each on disk (fsync) when `append` returns. Opening it cuts
    off a torn last line (a kill's, never answered), so what is appended next starts a line of its own."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / JOURNAL_FILE
        if self.path.exists():
            data = self.path.read_bytes()
            if data and not data.endswith(b"\n"):
                os.truncate(self.path, data.rfind(b"\n") + 1)
        self._file = open(self.path, "ab")  # noqa: SIM115  held open for the service's life, closed by close()

    def reopen(self) -> None:
        """Append to the file at the journal's path now (after `rewrite` replaced it)."""
        self._file.close()
        self._file = open(self.path, "ab")  # noqa: SIM115

    def size(self) -> int:
        return self._file.tell()

    def append(self, record: Record) -> None:
        self._file.write(_encoder.encode(record) + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def read_journal(folder: Path) -> list[Record]:
    """The records of `folder`'s journal in order ([] when there is none); a torn last line is dropped, a torn
    line before the last is an error naming it (the file was damaged, not cut short by a kill)."""
    path = folder / JOURNAL_FILE
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            records.append(_decoder.decode(line))
        except msgspec.DecodeError as exc:
            if any(lines[number:]):
                raise StateError(f"{path} line {number} does not decode ({exc}); the journal is damaged") from None
    return records


class Commit(msgspec.Struct, frozen=True):
    """A model's last committed step: its learner state is on disk after the `optim_step` `seq` (what a model's
    `commit.json` holds)."""

    step: int
    seq: int
    outcome: Outcome


@dataclass
class ModelPlan:
    """One model's restart: the call that made it, the results that stand (seq -> its record) and the calls to
    run again, in seq order; `last_seq` is the last seq_id it accepted."""

    maker: CallRecord
    finished: dict[int, DoneRecord] = field(default_factory=dict)
    rerun: list[CallRecord] = field(default_factory=list)
    last_seq: int = 0


def _lost(model: str, seq: int) -> DoneRecord:
    return DoneRecord(model, seq, Outcome(error="the result of this call was lost in a restart"), time.time())


def plan(records: list[Record], commits: dict[str, Commit], horizon: float = 0.0) -> dict[str, ModelPlan]:
    """Each model's restart (see the module docstring) from the journal's records and its committed steps. A
    result up to the commit that finished before `horizon` (a time.time()) is forgotten, as a running service
    forgets it."""
    calls: dict[str, dict[int, CallRecord]] = {}
    done: dict[str, dict[int, DoneRecord]] = {}
    for record in records:
        if isinstance(record, CallRecord):
            calls.setdefault(record.model, {})[record.seq] = record
        elif isinstance(record, DoneRecord):
            done.setdefault(record.model, {})[record.seq] = record
    plans = {}
    for model, by_seq in calls.items():
        if 0 not in by_seq or by_seq[0].kind not in MAKERS:
            raise StateError(f"the journal names model {model!r} without the call that made it")
        commit = commits.get(model)
        finished = done.get(model, {})
        if commit is not None:
            finished[commit.seq] = DoneRecord(model, commit.seq, commit.outcome, time.time())
        committed = commit.seq if commit is not None else 0
        model_plan = plans[model] = ModelPlan(by_seq[0], last_seq=max([*by_seq, *finished]))
        for seq in sorted((set(by_seq) | set(finished)) - {0}):
            call = by_seq.get(seq)
            if seq <= committed and seq in finished:
                if finished[seq].at >= horizon:
                    model_plan.finished[seq] = finished[seq]
            elif seq <= committed:
                model_plan.finished[seq] = _lost(model, seq)
            elif call is not None and (seq not in finished or call.kind in REPLAYED
                                       and finished[seq].outcome.error is None):
                model_plan.rerun.append(call)  # a failed call stays failed: the client was told so
            else:
                model_plan.finished[seq] = finished[seq]
    return plans


def compacted(records: list[Record], plans: dict[str, ModelPlan]) -> list[Record]:
    """The records a restart needs from now on: the sessions, sampling sessions and samplers, and per model the
    call that made it, the results that stand and the calls it runs again. Forgotten results and the bodies of
    committed calls (the bulk: every forward_backward's data) are left out."""
    kept: list[Record] = [r for r in records if isinstance(r, SessionRecord | SamplingRecord | SamplerRecord)]
    for model_plan in plans.values():
        kept += [model_plan.maker, *model_plan.finished.values(), *model_plan.rerun]
    return kept


def rewrite(folder: Path, records: list[Record]) -> None:
    """Replace `folder`'s journal by `records`, whole or not at all (`write_atomically`)."""
    write_atomically(folder / JOURNAL_FILE, b"".join(_encoder.encode(r) + b"\n" for r in records))


def write_atomically(path: Path, data: bytes) -> None:
    """`data` at `path`, whole or not at all: written beside it, fsync'd, then renamed over it."""
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself on disk
    finally:
        os.close(fd)
