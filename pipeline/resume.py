"""Continuing a run from its latest checkpoint: what `pipeline.checkpoint` wrote is read back, the
ledger rewound, the admission gate restored, and the work in flight re-sent or regenerated (the rule and
its guarantees: `pipeline.checkpoint`'s module docstring).
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from pipeline.actor import BaseActor
from pipeline.admission import AdmissionGate
from pipeline.checkpoint import (
    ATTEMPT_FILES,
    CONSUMER_DIR,
    CheckpointError,
    RandomState,
    RunState,
    latest_checkpoint,
    read_state,
    redo_requests,
)
from pipeline.context import redo
from pipeline.ledger import Ledger
from pipeline.ledger_store import LedgerStore
from pipeline.refs import HeldRef, Redo, Ref
from pipeline.telemetry import METRICS_FILE, RunFolder, get_logger, metric_parts
from pipeline.versions import VersionClock

__all__ = [
    "OwedWork", "PortableResume", "Resume", "ResumeFeeder", "in_flight_groups", "reopen", "restore_gate",
    "resumed_ledger",
]


class OwedWork(msgspec.Struct, frozen=True):
    """What `reopen` did to a resumed ledger: the Redo requests to queue first, how many of them redo
    lost or refused work (`redone`) and how many produce prompts admitted but not produced (`owed`)."""

    requests: list[Redo]
    redone: int
    owed: int


def reopen(state: RunState, attempt: int, ledger: Ledger) -> OwedWork:
    """Make `ledger` (the checkpoint's, rebuilt) owe the checkpoint's unfinished work again: the redo
    requests the run owed (`redo_requests`), the redos producers were making (their sources become
    takeable again), and the prompts producers had admitted but not produced (owed under new group names
    `resume{attempt}-owed-{i}`). Returns the Redo requests for all of it, in that order."""
    requests = redo_requests(state)
    redone = len(requests)
    for group in ledger.requeue_pending_redo():
        requests.append(Redo(group, "resume: its redo was being produced at the checkpoint"))
        redone += 1
    for i, source in enumerate(state.owed):
        group = f"resume{attempt}-owed-{i}"
        ledger.owe(group, source)
        requests.append(Redo(group, "resume: admitted but not produced at the checkpoint"))
    return OwedWork(requests=requests, redone=redone, owed=len(state.owed))


def resumed_ledger(state: RunState, run_dir: str | Path, max_uses: int) -> Ledger:
    """The ledger of checkpoint `state` over `run_dir`'s store, rewound to the checkpoint's position (see
    the module docstring); raises CheckpointError when the store does not hold the checkpoint's rows."""
    from pipeline.ledger import LedgerError

    try:
        return Ledger.from_state(state.ledger, max_uses=max_uses, store=LedgerStore.in_folder(run_dir, max_uses))
    except LedgerError as exc:
        raise CheckpointError(f"the run's ledger cannot be resumed: {exc}") from None


def _nothing_to_do(run_dir: Path, state: RunState, steps: int) -> str:
    """Why a resume to `steps` has nothing to train: the run already holds that version (a finished run's
    last checkpoint is its step count), or a later one. Names the key (`steps`) and the checkpoint's version."""
    where = f"--resume {str(run_dir)!r}: the latest checkpoint is version {state.version}"
    more = f"to train on, resume with more steps (baton run --resume {run_dir} --set steps=N, N > {state.version})"
    if steps == state.version:
        return f"{where}, and steps = {steps}: the run is finished, there is nothing to resume; {more}"
    return (f"{where}, above steps = {steps}: a resume never trains backwards, and a run stops at steps "
            f"(resuming would train nothing); {more}")


CONFIG_FILE = "config.toml"


def _checkpoint_to_resume(run_dir: Path, run: str, steps: int) -> tuple[Path, RunState]:
    """`run_dir`'s latest checkpoint and its state, when a run named `run` can resume from it to `steps`;
    else CheckpointError saying why and what to change."""
    if not run_dir.is_dir():
        raise CheckpointError(f"--resume {str(run_dir)!r}: no such run folder")
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        raise CheckpointError(
            f"--resume {str(run_dir)!r}: the run folder holds no complete checkpoint; runs checkpoint only "
            "with checkpoint.every > 0 (and after that many versions)"
        )
    state = read_state(checkpoint)
    if state.run != run:
        raise CheckpointError(f"checkpoint {checkpoint} belongs to run {state.run!r}, not {run!r}")
    if steps <= state.version:
        raise CheckpointError(_nothing_to_do(run_dir, state, steps))
    return checkpoint, state


def _archive_attempt(run_dir: Path) -> tuple[int, list[dict]]:
    """Move the last attempt's outputs (`ATTEMPT_FILES`, rotated metrics) to `attempts/{n}/`, n counting
    from 1; returns n and that attempt's metric records."""
    attempts = run_dir / "attempts"
    attempt = 1 + sum(1 for p in attempts.iterdir() if p.is_dir()) if attempts.is_dir() else 1
    archive = attempts / str(attempt)
    archive.mkdir(parents=True)
    for name in ATTEMPT_FILES:
        if (run_dir / name).exists():
            os.replace(run_dir / name, archive / name)
    for part in metric_parts(run_dir):  # a long run's rotated metrics (pipeline.telemetry)
        os.replace(part, archive / part.name)
    return attempt, RunFolder(archive).read_metrics()


def _write_config(run_dir: Path, attempt: int, config_text: str | None) -> dict[str, list[Any]]:
    """Make `config_text` the run folder's config.toml, keeping the one it replaces as
    `attempts/{attempt}/config.toml` (what that attempt ran with); returns the keys that changed
    (`config_changes`). None: the folder's config.toml stays (a DSL pipeline built without one)."""
    current = run_dir / CONFIG_FILE
    if config_text is None:
        return {}
    was = current.read_text(encoding="utf-8") if current.is_file() else None
    folder = RunFolder(run_dir)
    if was is not None:
        folder.write_text(Path("attempts") / str(attempt) / CONFIG_FILE, was)
    folder.write_text(CONFIG_FILE, config_text)
    return config_changes(was, config_text) if was is not None else {}


def config_changes(was: str, now: str) -> dict[str, list[Any]]:
    """{dotted key: [was, now]} for every key whose value differs between two TOML texts (a key only in
    one of them: None on the other side), in sorted key order."""
    before, after = _flat(tomllib.loads(was)), _flat(tomllib.loads(now))
    return {k: [before.get(k), after.get(k)] for k in sorted(before.keys() | after.keys())
            if before.get(k) != after.get(k)}


def _flat(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _trainings_after(run_dir: Path, state: RunState) -> int | None:
    """Trainings the crashed attempt recorded after the checkpoint (its store's rows past the checkpoint's
    position); None when the checkpoint has no position (format 1) or the run folder no store."""
    from pipeline.ledger_store import STORE_FILE, open_run

    if state.ledger.position is None or not (run_dir / STORE_FILE).is_file():
        return None
    conn = open_run(run_dir)
    try:
        return conn.execute("SELECT count(*) FROM settled WHERE seq > ? AND fate = 'trained'",
                            (state.ledger.position.rows,)).fetchone()[0]
    finally:
        conn.close()


def in_flight_groups(state: RunState) -> dict[str, list[str]]:
    """{group: item ids} of the groups `state`'s ledger has in flight, in production order."""
    groups: dict[str, list[str]] = {}
    for rec in state.ledger.records:
        if rec.fate == "in_flight":
            groups.setdefault(rec.group, []).append(rec.id)
    return groups


def restore_gate(state: RunState, gate: AdmissionGate) -> None:
    """Set `gate` (at the checkpoint's version) to the checkpoint's consumed units (`version *
    units_per_version`) plus one slot per group in flight; work admitted but never produced is
    forgotten (producers start new work in its place, or make it as owed redos)."""
    if gate.units_per_version != state.units_per_version:
        raise CheckpointError(
            f"the checkpoint was taken with {state.units_per_version} units per version (groups per "
            f"step), the resumed run has {gate.units_per_version}; resume with the checkpoint's value"
        )
    gate.started = state.version * gate.units_per_version + len(in_flight_groups(state))
    gate.discarded = 0


class PortableResume(msgspec.Struct, frozen=True, kw_only=True):
    """The consumer's view of a resume: its checkpoint folder, version, and the trained groups it may
    still reuse (the parts of `Resume` a consumer in another process needs)."""

    checkpoint: str
    version: int
    reusable: list[HeldRef]
    rngs: dict[str, RandomState] = {}

    @property
    def consumer_dir(self) -> Path:
        return Path(self.checkpoint) / CONSUMER_DIR

    def rng_state(self, actor: str) -> RandomState | None:
        """Where `actor`'s random stream stood at the checkpoint (None: it had none there)."""
        return self.rngs.get(actor)


@dataclass
class Resume:
    """A run continuing from its latest checkpoint (see the module docstring for the rule)."""

    folder: RunFolder
    checkpoint: Path
    state: RunState
    attempt: int
    rolled_back_versions: int = 0
    rolled_back_trainings: int | None = None  # None: the checkpoint has no store position (format 1)
    reinjected: int = 0
    regenerated: int = 0
    redone: int = 0  # redo requests sent again (waiting ones, and redos being produced)
    owed: int = 0  # prompts admitted but not produced at the checkpoint, sent to the producer
    changed: dict[str, list[Any]] = field(default_factory=dict)  # {config key: [was, now]} (`config_changes`)
    log: Any = field(default=None, repr=False)

    @classmethod
    def open(cls, run_dir: str | Path, run: str, steps: int, config_text: str | None = None) -> Resume:
        """Load `run_dir`'s latest checkpoint, move the crashed attempt's outputs to `attempts/{n}/`
        and keep the metric records up to the checkpoint's version in `metrics.jsonl`. `config_text`
        (the resolved config the resumed run runs with) becomes the folder's `config.toml`, the one it
        replaces kept as `attempts/{n}/config.toml`, so a later plain resume runs with what this one did."""
        run_dir = Path(run_dir)
        checkpoint, state = _checkpoint_to_resume(run_dir, run, steps)
        attempt, old = _archive_attempt(run_dir)
        folder = RunFolder(run_dir)
        kept = [r for r in old if r.get("version", 0) <= state.version]
        folder.write_text(METRICS_FILE, "".join(json.dumps(r) + "\n" for r in kept))
        resumed = cls(folder=folder, checkpoint=checkpoint, state=state, attempt=attempt)
        resumed.changed = _write_config(run_dir, attempt, config_text)
        resumed.rolled_back_versions = max((r.get("version", 0) for r in old), default=state.version) - state.version
        resumed.rolled_back_trainings = _trainings_after(run_dir, state)
        resumed.log = get_logger("checkpoint").bind(run=run)
        return resumed

    def log_start(self) -> None:
        """Log what this resume continues from and what changed (once the run's log is open)."""
        self.log.info(
            "resuming", checkpoint=str(self.checkpoint), version=self.version, attempt=self.attempt,
            rolled_back_versions=self.rolled_back_versions, **({"changed": self.changed} if self.changed else {}),
        )

    @property
    def version(self) -> int:
        return self.state.version

    @property
    def consumer_dir(self) -> Path:
        return self.checkpoint / CONSUMER_DIR

    def clock(self) -> VersionClock:
        return VersionClock(self.state.version)

    def ledger(self, max_uses: int) -> Ledger:
        """The checkpoint's ledger over the run folder's store, rewound to the checkpoint's position."""
        return resumed_ledger(self.state, self.folder.path, max_uses)

    def in_flight_groups(self) -> dict[str, list[str]]:
        """{group: item ids} of the groups the checkpoint's ledger has in flight, in production order."""
        return in_flight_groups(self.state)

    def restore_gate(self, gate: AdmissionGate) -> None:
        restore_gate(self.state, gate)

    @property
    def reusable(self) -> list[HeldRef]:
        """Groups the consumer had trained and could still reuse (its to restore if their payload exists)."""
        return [h for h in self.state.held if h.uses > 0]

    def reopen(self, ledger: Ledger) -> list[Redo]:
        """Prepare the resumed `ledger` (see `reopen`) and count what it owes; returns the Redo requests
        to queue before any actor runs."""
        reopened = reopen(self.state, self.attempt, ledger)
        self.count(reopened)
        return reopened.requests

    def count(self, reopened: OwedWork) -> None:
        self.redone, self.owed = reopened.redone, reopened.owed

    def feeder(self, ctx: Any, produced: Any, ledger: Ledger) -> ResumeFeeder:
        """The actor that puts the checkpoint's work in flight again. Redos are queued at once."""
        for request in self.reopen(ledger):
            ctx.feedback.send_nowait(request)
        return ResumeFeeder(self, ctx, produced)

    def portable(self) -> PortableResume:
        """What the consumer needs to continue (sent to its process on the Ray runtime)."""
        return PortableResume(
            checkpoint=str(self.checkpoint), version=self.version, reusable=self.reusable, rngs=self.state.rngs,
        )

    def rng_state(self, actor: str) -> RandomState | None:
        """Where `actor`'s random stream stood at the checkpoint (None: it had none there)."""
        return self.state.rngs.get(actor)

    def summary(self) -> dict[str, Any]:
        return {
            "from_version": self.state.version, "attempt": self.attempt, "checkpoint": self.checkpoint.name,
            "rolled_back_versions": self.rolled_back_versions, "rolled_back_trainings": self.rolled_back_trainings,
            "reinjected_groups": self.reinjected, "regenerated_groups": self.regenerated, "redo_requests": self.redone,
            "owed_prompts": self.owed, **({"changed": self.changed} if self.changed else {}),
        }


class ResumeFeeder(BaseActor):
    """Re-uses or regenerates every group the checkpoint had in flight (see the module docstring)."""

    name = "resume"

    def __init__(self, resumed: Resume, ctx: Any, produced: Any) -> None:
        self.resumed, self.ctx, self.produced = resumed, ctx, produced

    async def run(self) -> None:
        ctx, resumed = self.ctx, self.resumed
        store = ctx.services.store
        pending = resumed.in_flight_groups()
        for held in _oldest_first(h for h in resumed.state.held if h.uses == 0):
            ref = held.ref
            if ref.group not in pending:
                continue  # settled already (a ref seen twice, or one the ledger finished)
            del pending[ref.group]
            if ref.store == store.name and await _payload_exists(store, ref):
                await self.produced.send(ref)
                resumed.reinjected += 1
                ctx.note(self.name, f"re-sent {ref.group} (held by {held.holder})")
            else:
                await redo(ctx, ref, "regenerated", "resume: its payload was gone after the crash", store)
                resumed.regenerated += 1
        for group, ids in pending.items():  # in transit at the checkpoint: no ref to re-use
            reason = "resume: its ref was in transit at the checkpoint"
            await ctx.ledger.finished("regenerated", ids, reason)
            await ctx.gate.discard(1)
            await ctx.feedback.send(Redo(group, reason))
            resumed.regenerated += 1
        resumed.log.info(
            "in-flight work restored", reinjected=resumed.reinjected, regenerated=resumed.regenerated,
            redo_requests=resumed.redone, owed_prompts=resumed.owed,
        )
        ctx.note(self.name, f"done: {resumed.reinjected} re-sent, {resumed.regenerated} regenerated")


def _oldest_first(held: Iterable[HeldRef]) -> Sequence[HeldRef]:
    return sorted(held, key=lambda h: h.ref.version)  # stable: holders' own order among equals


async def _payload_exists(store: Any, ref: Ref) -> bool:
    """Does the store still hold `ref`'s payload, whole? (The consumer verifies its checksum when it loads it.)"""
    try:
        data = await store.get(ref.key, size_hint=ref.nbytes)
    except Exception:  # any store failure: the payload cannot be re-used, so the group is regenerated
        return False
    return memoryview(data).nbytes == ref.nbytes
