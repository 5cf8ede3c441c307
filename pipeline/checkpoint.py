"""Checkpoint and resume: a run that crashes continues from its last checkpoint, losing nothing uncounted.

What a checkpoint holds (every `every` versions, and the run's last version whenever the run ends: at its
step count, on Ctrl-C / SIGTERM, when an actor fails; written by the consumer between two steps):

* `run_state.msgpack` (msgspec, no pickle): the version, the ledger's records in flight, counts, redo
  sources and redos in progress and its store's position, the admission gate's counts, and every
  ref the pipeline held at that moment, with where it was and how often the consumer had used it: refs
  a producer is sending, the `produced` and `ready` channels, the buffer's index (and the batch it is
  forwarding), the consumer's replay window; the redo requests waiting in the feedback channel; the
  prompts producers had admitted but not yet produced (`owed`); each producer's random stream;
* `consumer/`: what the consumer writes for itself (`write_state`; the GRPO learner: model as
  safetensors, optimizer via `torch.save` read back with `weights_only=True`, RNG states);
* `manifest.json`, written last: every file with its size.

Each checkpoint written adds a line to the run folder's `checkpoints.jsonl`: its version, seconds in
all and for the cut, ledger records in flight, and bytes (run state, consumer files).

The ledger's settled records are in its store, the run folder's `ledger.sqlite` (pipeline.ledger_store),
appended as they settle; a checkpoint records the store's position (its rows so far, committed and
fsynced at the cut), so it costs what is in flight, not the run's history. Resume rewinds the store to
that position (`Resume.ledger`): rows written after it, by the crashed attempt, are deleted. (Format 1
checkpoints, with the whole ledger inside `run_state.msgpack`, are still read: their settled records
are written into the store on resume.)

Atomicity: a checkpoint is written into `checkpoints/.tmp-*`, fsynced, renamed to
`checkpoints/v{version:08d}-{id}`, and only then named in `checkpoints/latest` (temp file + `os.replace`);
older checkpoints are removed after that (`keep` are kept). A crash at any moment leaves `latest`
naming a complete checkpoint (the old one or the new one); a half-written folder is never named, and
`latest_checkpoint` also verifies the manifest, falling back to the newest complete one.

The state is one consistent cut of the run (`RunCut`): on the local runtime it is captured without
yielding to the event loop (`LocalCut`: every actor lives in this loop), so a ref is either in one
holder, or in transit inside some actor's call and then the ledger still knows its group as in
flight. On the Ray runtime (`pipeline.runtime.ray_cut.RayCut`) the conductor's ledger is frozen while
the hosts and channel actors report what they hold; refs still move meanwhile, and the resume rules
below are written so that a ref seen twice or not at all is still neither lost nor trained twice.

Resume rule (`Resume`): **the resumed run is the checkpoint's run.** Its version clock restarts at the
checkpoint's version v, its ledger is the checkpoint's ledger, the model and optimizer are the
checkpoint's. Whatever the crashed attempt did after the checkpoint never happened for the resumed run:
versions above v, and the training of samples at those versions, were rolled back with the model
(they are reported in the summary's `resume.rolled_back_*`, and the crashed attempt's outputs are kept
in `attempts/{n}/`). So "no sample trained twice" keeps its meaning: in the resumed ledger every sample
is trained at most `max_uses` times, counting only trainings whose gradient the final model contains.

What happens to the work that was in flight at the checkpoint:
* each group the ledger has in flight whose ref was checkpointed and whose payload the store still holds
  is sent again, oldest first, into the `produced` channel (re-used: the buffer and the consumer judge it
  like any other, so a group that would now exceed the staleness bound is dropped or requeued by the
  normal policy);
* each other group in flight (its payload is gone: a memory store dies with its process; or its ref
  was in transit) is recorded `regenerated` (reason `resume: ...`), its slot freed and its prompt sent
  to the producer, exactly like a lost payload;
* redo requests that were waiting (in the feedback channel, or on their way to a producer: every
  group whose source the ledger holds untaken with nothing in flight, `redo_requests`), redos a
  producer had taken but not produced yet, and prompts a producer had admitted but not produced
  (`held_sources()`, and a `produced` record the ledger had not received yet: `owed_sources`) are
  sent to the producer again, so no admitted prompt is skipped;
* groups the consumer had trained and may still reuse are handed back to it (`resumed.reusable`);
  it keeps them (with their use counts) only while the staleness policy accepts them and their payload
  still exists;
* admission slots are restored as `version * units_per_version` consumed units plus one per group in
  flight; the work sent back to the producer takes new slots like any redo.
Engines get the checkpoint's weights from the consumer's `start()` (every actor's `start()` completes
before any `run()`), so nothing is generated with weights older than v after the resume and the
staleness bound holds across it. Random streams continue where they stood at the checkpoint: the
consumer's (torch, numpy, Python, its selection policy) and each producer's prompt sampler
(`rng_state()`), so a resume does not replay the run's first prompts.

Both runtimes checkpoint and resume; on Ray the consumer's process writes the checkpoint and the
driver re-sends the checkpoint's refs (`pipeline.runtime.ray`).

Vocabulary (the resume side lives in `pipeline.resume`): a `Resume` is a run continuing from its latest
checkpoint (opened by the driver); its `PortableResume` is the part other processes need; `reopen` returns
the `OwedWork` the resumed ledger owes the producers first; the `ResumeFeeder` actor re-sends or
regenerates what was in flight.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import anyio
import msgspec

from pipeline.admission import AdmissionGate
from pipeline.contracts import CheckpointedProducer, CheckpointingConsumer, RefHolder
from pipeline.events import report_event
from pipeline.ledger import Ledger, LedgerState
from pipeline.refs import HeldRef, Redo, Ref
from pipeline.telemetry import get_logger
from pipeline.versions import VersionClock

FORMAT = 3  # 1: the whole ledger in run_state.msgpack (read still); 2: a ledger journal (not read); 3: a store position
CHECKPOINTS = "checkpoints"
LOG_FILE = "checkpoints.jsonl"  # in the run folder: one line per checkpoint written (version, seconds, bytes)
LATEST = "latest"
STATE_FILE = "run_state.msgpack"
MANIFEST = "manifest.json"
CONSUMER_DIR = "consumer"
ATTEMPT_FILES = ("metrics.jsonl", "ledger.json", "summary.json", "report.png")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or belongs to another run."""


class CutFailed(CheckpointError):
    """A cut could not be taken consistently this time (a host did not answer within the lease); the
    checkpoint is skipped, the run goes on (the ledger's store keeps every record; nothing is owed to the
    next checkpoint)."""


RandomState = tuple[int, list[int], float | None]  # random.Random.getstate(), as msgspec carries it


def random_state(state: tuple) -> RandomState:
    """`random.getstate()` / `Random.getstate()` in the form a checkpoint stores."""
    version, internal, gauss = state
    return version, list(internal), gauss


def python_random_state(state: RandomState) -> tuple:
    """What `random.setstate()` / `Random.setstate()` takes, from a stored `RandomState`."""
    version, internal, gauss = state
    return version, tuple(internal), gauss


class GateCounts(msgspec.Struct, frozen=True):
    started: int
    discarded: int


class RunState(msgspec.Struct, kw_only=True):
    format: int = FORMAT
    run: str
    version: int
    steps: int
    units_per_version: int
    created_at: float
    ledger: LedgerState
    gate: GateCounts
    held: list[HeldRef]
    redo: list[Redo]
    owed: list[bytes] = []  # sources admitted by producers and not yet produced (beyond the ledger's pending redos)
    rngs: dict[str, RandomState] = {}  # each producer's random stream (by actor name), where it stood at the cut


class Manifest(msgspec.Struct, kw_only=True):
    format: int
    version: int
    files: dict[str, int]  # path relative to the checkpoint folder -> size in bytes


_STATE_ENCODER = msgspec.msgpack.Encoder()
_STATE_DECODER = msgspec.msgpack.Decoder(RunState)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class RunCut(Protocol):
    """Takes one consistent cut of a run's state for a checkpoint: `LocalCut` (every actor in this event
    loop) or the Ray runtime's `pipeline.runtime.ray_cut.RayCut` (the conductor pauses the ledger while
    the hosts report what they hold). Called by the consumer between two steps, with its own state still."""

    async def capture(self, version: int, consumer: CheckpointingConsumer) -> RunState: ...


def owed_sources(
    generating: Iterable[bytes], recording: Iterable[tuple[str, bytes]], ledger: LedgerState
) -> list[bytes]:
    """The prompts producers hold that a resumed run must produce: those being generated (`generating`),
    and those whose `produced` record was on its way to the ledger (`recording`: (group, source)) unless
    the ledger already has the group. A redo being produced is owed once, as the ledger's pending redo.
    (`ledger.records` are the items in flight: a group whose `produced` call is still under way cannot have
    settled, its ref is not sent before the call returns.)"""
    known = {rec.group for rec in ledger.records}
    owed = [*generating, *(source for group, source in recording if group not in known)]
    for _, source in ledger.pending_redo:  # requeued as redos on resume
        if source in owed:
            owed.remove(source)
    return owed


def redo_requests(state: RunState) -> list[Redo]:
    """Every redo the run owed at the checkpoint: the requests waiting in the feedback channel, in their
    order, then every other group whose source the ledger holds untaken with none of its items in flight
    (its Redo was on its way to a producer: polled, its source not yet taken)."""
    requests = list(state.redo)
    asked = {r.group for r in requests}
    in_flight = {rec.group for rec in state.ledger.records if rec.fate == "in_flight"}
    for group in state.ledger.sources:
        if group not in asked and group not in in_flight:
            requests.append(Redo(group, "resume: its redo request was on its way to a producer"))
    return requests


@dataclass
class LocalCut:
    """The cut of a run whose actors all live in this event loop: nothing in `capture` awaits, so it is
    one instant of the run (a ref is in one holder, or inside some actor's call and then the ledger
    still knows its group as in flight). `holders` are the actors whose `held_refs()` (and producers'
    `held_sources()`) are captured; `channels` the channels of refs, `feedback` the channel of Redos."""

    run: str
    steps: int
    clock: VersionClock
    ledger: Ledger
    gate: AdmissionGate
    channels: dict[str, Any]
    feedback: Any
    holders: list[RefHolder] = field(default_factory=list)

    async def capture(self, version: int, consumer: CheckpointingConsumer) -> RunState:
        if self.clock.version != version:
            raise CheckpointError(f"a checkpoint of version {version} was asked at version {self.clock.version}")
        held: list[HeldRef] = list(consumer.held_refs())  # downstream first: roughly oldest first
        for holder in self.holders:
            held.extend(holder.held_refs())
        for name, channel in reversed(self.channels.items()):
            held.extend(HeldRef(ref=r, holder=f"channel:{name}") for r in channel.items() if isinstance(r, Ref))
        ledger = self.ledger.state()  # in flight, and the store's position (committed, fsynced)
        producers = [h for h in self.holders if isinstance(h, CheckpointedProducer)]
        owed = owed_sources(
            [src for holder in producers for src in holder.held_sources()],
            [item for holder in producers for item in holder.recording()], ledger,
        )
        return RunState(
            run=self.run, version=version, steps=self.steps, units_per_version=self.gate.units_per_version,
            created_at=time.time(), ledger=ledger, gate=GateCounts(self.gate.started, self.gate.discarded),
            held=held, redo=[r for r in self.feedback.items() if isinstance(r, Redo)], owed=owed,
            rngs={h.name: h.rng_state() for h in self.holders if isinstance(h, CheckpointedProducer)},
        )


class Checkpointer:
    """Writes a checkpoint of one run every `every` versions (see the module docstring); `cut` captures
    the run's state, the consumer writes its own."""

    def __init__(
        self, folder: Path, every: int, *, run: str, steps: int, cut: RunCut, keep: int = 2
    ) -> None:
        if every < 1:
            raise ValueError(f"checkpoint.every must be >= 1 (0 turns checkpoints off), got {every}")
        if keep < 1:
            raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
        self.root = Path(folder) / CHECKPOINTS
        self.every, self.keep = every, keep
        self.run, self.steps, self.cut = run, steps, cut
        self.written: list[Path] = []
        self.log = get_logger("checkpoint").bind(run=run)

    def due(self, version: int) -> bool:
        """Is a checkpoint due now that `version` was reached (never at 0; the run's end is the consumer's
        to checkpoint, once, however the run ends)?"""
        return 0 < version < self.steps and version % self.every == 0

    async def save(self, version: int, consumer: CheckpointingConsumer) -> Path | None:
        """Capture the run's state and write it, with the consumer's, as the latest checkpoint. The consumer
        waits for the write (its state must not change meanwhile); once begun, a write is finished even if the
        run is being stopped. A write that fails raises (the run fails: it would otherwise go on unprotected);
        a cut that cannot be taken this time (`CutFailed`) skips this checkpoint and returns None."""
        t0 = time.perf_counter()
        try:
            run_state = await self.cut.capture(version, consumer)
        except CutFailed as failed:  # the previous checkpoint stays the latest
            report_event(self.root.parent, "checkpoint.skipped", run=self.run, version=version, reason=str(failed))
            return None
        name = f"v{version:08d}-{uuid.uuid4().hex[:8]}"
        state = _STATE_ENCODER.encode(run_state)
        t_written = time.perf_counter()
        with anyio.CancelScope(shield=True):  # a run stopping meanwhile (another actor failed) still gets it
            path = await anyio.to_thread.run_sync(self._write, name, version, state, consumer.write_state)
        self.written.append(path)
        entry = {
            "version": version, "t": time.time(), "seconds": round(time.perf_counter() - t0, 4),
            "capture_s": round(t_written - t0, 4), "ledger_records": len(run_state.ledger.records),
            "run_bytes": len(state),
            "consumer_bytes": sum(f.stat().st_size for f in (path / CONSUMER_DIR).rglob("*") if f.is_file()),
        }
        with open(self.root.parent / LOG_FILE, "a", encoding="utf-8") as f:  # one write: a line is never torn
            f.write(json.dumps(entry) + "\n")
        self.log.info("checkpoint written", path=str(path), **entry)
        return path

    def _write(self, name: str, version: int, state: bytes, write_consumer: Callable[[Path], None]) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{name}"
        tmp.mkdir()
        try:
            _write_file(tmp / STATE_FILE, state)
            (tmp / CONSUMER_DIR).mkdir()
            write_consumer(tmp / CONSUMER_DIR)
            files = {}
            for path in sorted(tmp.rglob("*")):
                if path.is_file():
                    if path.parent != tmp:  # the consumer's files: make them durable too
                        with open(path, "rb+") as f:
                            os.fsync(f.fileno())
                    files[str(path.relative_to(tmp))] = path.stat().st_size
            manifest = Manifest(format=FORMAT, version=version, files=files)
            _write_file(tmp / MANIFEST, msgspec.json.encode(manifest))
            _fsync_dir(tmp / CONSUMER_DIR)
            _fsync_dir(tmp)
            final = self.root / name
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_dir(self.root)
        pointer = self.root / f".{LATEST}.{uuid.uuid4().hex}.tmp"
        _write_file(pointer, name.encode())
        os.replace(pointer, self.root / LATEST)  # the commit point
        _fsync_dir(self.root)
        self._prune(keep={final.name})
        return final

    def _prune(self, keep: set[str]) -> None:
        """Remove checkpoints beyond the newest `keep` complete ones, and leftovers of interrupted writes."""
        complete = sorted(_complete_checkpoints(self.root), key=lambda p: (_version_of(p), p.stat().st_mtime))
        survivors = {p.name for p in complete[-self.keep:]} | keep
        for path in self.root.iterdir():
            if path.is_dir() and path.name not in survivors:
                shutil.rmtree(path, ignore_errors=True)


def _version_of(path: Path) -> int:
    return int(path.name[1:9])


def _is_complete(path: Path) -> bool:
    try:
        manifest = msgspec.json.decode((path / MANIFEST).read_bytes(), type=Manifest)
    except (OSError, msgspec.DecodeError):
        return False
    return all((path / rel).is_file() and (path / rel).stat().st_size == size for rel, size in manifest.files.items())


def _complete_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and p.name.startswith("v") and _is_complete(p)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint `checkpoints/latest` names if it is complete, else the newest complete one, else None."""
    root = Path(run_dir) / CHECKPOINTS
    try:
        named = root / (root / LATEST).read_text().strip()
        if named.name and _is_complete(named):
            return named
    except OSError:
        pass
    complete = _complete_checkpoints(root)
    return max(complete, key=lambda p: (_version_of(p), p.stat().st_mtime)) if complete else None


def complete_checkpoints(run_dir: str | Path) -> dict[int, Path]:
    """{version: folder} of every complete checkpoint in `run_dir`, oldest first (the newest folder of a
    version written twice, by a resumed run)."""
    ordered = sorted(_complete_checkpoints(Path(run_dir) / CHECKPOINTS),
                     key=lambda p: (_version_of(p), p.stat().st_mtime))
    return {_version_of(p): p for p in ordered}


def checkpoint_summary(run_dir: str | Path) -> dict[str, Any] | None:
    """{"version", "path"} of the run folder's latest complete checkpoint (what `baton export` and `--resume`
    take by default), or None."""
    path = latest_checkpoint(run_dir)
    return None if path is None else {"version": _version_of(path), "path": str(path)}


def read_state(checkpoint: Path) -> RunState:
    """The run state of a complete checkpoint folder."""
    if not _is_complete(checkpoint):
        raise CheckpointError(f"checkpoint {checkpoint} is incomplete (its manifest is missing or does not match)")
    try:
        state = _STATE_DECODER.decode((checkpoint / STATE_FILE).read_bytes())
    except msgspec.DecodeError as exc:
        raise CheckpointError(f"checkpoint {checkpoint}: {STATE_FILE} cannot be read: {exc}") from None
    if state.format not in (1, FORMAT):
        raise CheckpointError(f"checkpoint {checkpoint} has format {state.format}; this baton reads 1 and {FORMAT}")
    return state


__all__ = [
    "CheckpointError", "Checkpointer", "CheckpointingConsumer", "CutFailed", "GateCounts", "HeldRef", "LocalCut",
    "RefHolder", "RunCut", "RunState", "checkpoint_summary", "complete_checkpoints", "latest_checkpoint",
    "owed_sources", "python_random_state", "random_state", "read_state", "redo_requests",
]
