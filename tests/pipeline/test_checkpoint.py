"""Checkpoint/resume over real parts (torch engine, memory store, GRPO learner, local runtime).

A run that checkpoints and then crashes (an exception in the run, or SIGKILL of the process) is resumed;
its final ledger must show: no sample trained more than once, the fates balance, nothing in flight at
the checkpoint left uncounted, every trained sample within the staleness bound; the version continues
from the checkpoint's and the run reaches its steps. A checkpoint write cut off midway (an exception,
or SIGKILL of the writing process) leaves the previous checkpoint the one that loads."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest
import torch

from buffers.memory import MemoryStore
from buffers.ref_buffer import RefBuffer
from pipeline.actor import ActorFailed
from pipeline.admission import AdmissionGate
from pipeline.checkpoint import CheckpointError, latest_checkpoint, read_state, redo_requests
from pipeline.dsl import Pipeline
from pipeline.ledger import Ledger
from pipeline.resume import Resume, in_flight_groups
from policies import MaxStaleness
from policies.selection import Fifo
from stages.data.model import make_tiny_model
from stages.data.tasks import ReverseDigits
from stages.engines.torch import TorchEngine
from stages.learner import GRPOLearner
from stages.rollout import Rollout
from tests.helpers.checkpoint_helpers import GROUPS, CrashAt, FileConsumer, K, make_checkpointer
from tests.helpers.ledger_checks import check_ledger

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------- helpers


# ------------------------------------------------------------------------------------------- unit


def test_ledger_state_round_trips_through_msgpack_with_pending_redos() -> None:
    import msgspec

    from pipeline.ledger import LedgerState

    ledger = Ledger(max_uses=2)
    ledger.produced(["g/0", "g/1"], "g", (0, 1), b"pg", {"reward": [0.0, 1.0]})
    ledger.produced(["h/0"], "h", (1, 1), b"ph")
    ledger.produced(["k/0"], "k", (1, 1), b"pk")
    ledger.trained(["g/0", "g/1"], at_version=1)
    ledger.lost(["h/0"], "KeyNotFound: gone")
    assert ledger.take_source("h") == b"ph"
    state = msgspec.msgpack.decode(msgspec.msgpack.encode(ledger.state()), type=LedgerState)
    assert [r.id for r in state.records] == ["k/0"], "in flight: in the state; settled: in the store"
    assert state.position.rows == 3
    again = Ledger.from_state(state, store=ledger.store)  # the settled records are the store's
    assert again.counts() == ledger.counts() and again.balanced()
    assert again["g/0"].trained_at == [1] and again["h/0"].fate == "lost"
    assert again.pending_redo() == [("h", b"ph")]  # taken for a redo that was not produced yet
    assert again.requeue_pending_redo() == ["h"] and again.take_source("h") == b"ph"
    again.produced(["h2/0"], "h2", (2, 2), b"ph")  # the redo made from those bytes: no longer pending
    assert again.pending_redo() == []
    ledger.dropped(["k/0"], "stale")  # the snapshot is a copy: later changes do not reach it
    assert [(r.fate, r.trained_at) for r in state.records if r.id == "k/0"] == [("in_flight", [])]


def test_checkpoint_holds_every_ref_and_redo_of_the_run(tmp_path: Path) -> None:
    ckpt, clock, ledger = make_checkpointer(tmp_path)
    clock.advance(1)
    path = anyio.run(ckpt.save, 1, FileConsumer(b"weights"))
    assert latest_checkpoint(tmp_path) == path
    state = read_state(path)
    assert state.version == 1 and state.run == "unit"
    assert {(h.ref.group, h.holder, h.uses) for h in state.held} == {
        ("window-0", "consumer", 1), ("a", "channel:produced", 0), ("b", "channel:ready", 0)
    }
    assert [r.group for r in state.redo] == ["x"]
    assert Ledger.from_state(state.ledger).counts() == ledger.counts()
    assert (path / "consumer" / "state.bin").read_bytes() == b"weights"


class Producer:
    """A producer holding no refs, generating two prompts: a fresh one and the redo of group c."""

    name = "rollout:p"

    def __init__(self) -> None:
        import random

        self.rng = random.Random(7)
        self.rng.random()

    def rng_state(self):
        from pipeline.checkpoint import random_state

        return random_state(self.rng.getstate())

    def held_refs(self) -> list:
        return []

    def held_sources(self) -> list[bytes]:
        return [b"prompt-x", b"prompt-c"]

    def recording(self) -> list[tuple[str, bytes]]:
        return []


def test_a_resume_owes_the_prompts_being_generated_and_the_redos_in_progress(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from pipeline.channel import Channel

    ckpt, clock, ledger = make_checkpointer(tmp_path)
    producer = ckpt.cut.holders = [Producer()]
    ledger.produced(["c/0"], "c", (0, 0), b"prompt-c")
    ledger.lost(["c/0"], "KeyNotFound: gone")
    assert ledger.take_source("c") == b"prompt-c"  # the producer is making c again: a pending redo
    clock.advance(1)
    anyio.run(ckpt.save, 1, FileConsumer(b"w"))

    resumed = Resume.open(tmp_path, "unit", steps=100)
    assert resumed.state.owed == [b"prompt-x"], "the redo of c is owed once, as a redo, not twice"
    import random

    from pipeline.checkpoint import python_random_state

    again_rng = random.Random(0)
    again_rng.setstate(python_random_state(resumed.rng_state("rollout:p")))
    assert [again_rng.random() for _ in range(3)] == [producer[0].rng.random() for _ in range(3)], \
        "the producer's prompt stream goes on from where it stood at the checkpoint"
    again = resumed.ledger(max_uses=1)
    ctx = SimpleNamespace(feedback=Channel("feedback", 64))
    resumed.feeder(ctx, Channel("produced", 8), again)
    assert [r.group for r in ctx.feedback.items()] == ["x", "c", "resume1-owed-0"]
    assert again.take_source("c") == b"prompt-c" and again.take_source("resume1-owed-0") == b"prompt-x"
    assert resumed.summary()["owed_prompts"] == 1 and resumed.summary()["redo_requests"] == 2
    assert set(resumed.in_flight_groups()) == {"a", "b"}
    again_clock = resumed.clock()
    gate = AdmissionGate(again_clock, MaxStaleness(k=2), 4)
    resumed.restore_gate(gate)
    assert again_clock.version == 1 and (gate.started, gate.discarded) == (1 * 4 + 2, 0)


def test_a_cut_owes_each_prompt_once_whatever_reached_the_ledger() -> None:
    """A producer's prompts are owed unless the ledger accounts for them: a `produced` record the ledger
    received already, or a redo it knows is being made; a redo polled but not taken is found by its source."""
    from pipeline.checkpoint import owed_sources, redo_requests

    ledger = Ledger()
    ledger.produced(["a/0"], "a", (0, 0), b"prompt-a")  # its produced call reached the ledger before the freeze
    ledger.produced(["c/0"], "c", (0, 0), b"prompt-c")
    ledger.lost(["c/0"], "KeyNotFound: gone")
    assert ledger.take_source("c") == b"prompt-c"  # being redone
    ledger.produced(["d/0"], "d", (0, 0), b"prompt-d")
    ledger.regenerated(["d/0"], "stale")  # its Redo was polled by a producer, the source not taken yet
    state = ledger.state()
    owed = owed_sources(
        [b"prompt-x", b"prompt-c"], [("a", b"prompt-a"), ("b", b"prompt-b")], state
    )
    assert owed == [b"prompt-x", b"prompt-b"], "a is in the ledger, c is its pending redo; x and b are owed"
    from pipeline.checkpoint import GateCounts, RunState

    run = RunState(run="u", version=1, steps=9, units_per_version=1, created_at=0.0, ledger=state,
                   gate=GateCounts(0, 0), held=[], redo=[], owed=owed)
    assert [r.group for r in redo_requests(run)] == ["d"], "the redo on its way to a producer is requeued"


def test_a_frozen_conductor_holds_ledger_changes_until_thawed_and_a_lapsed_lease_voids_the_cut() -> None:
    from pipeline.runtime.ray_cut import Freezer

    async def main() -> None:
        freezer = Freezer()
        changed: list[str] = []

        async def change(name: str) -> None:
            await freezer.open()
            changed.append(name)

        token = freezer.freeze(lease_s=5.0)
        with pytest.raises(CheckpointError, match="one at a time"):
            freezer.freeze(lease_s=5.0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(change, "produced")
            await anyio.sleep(0.05)
            assert changed == [], "a ledger change waits while the cut is taken"
            assert freezer.thaw(token) is True
        assert changed == ["produced"]
        token = freezer.freeze(lease_s=0.05)
        await anyio.sleep(0.2)
        await freezer.open()  # the lease ran out: the ledger is open again
        assert freezer.thaw(token) is False, "a cut that outlived its lease is not consistent"

    anyio.run(main, backend="asyncio")


def checkpoint_ledger(path: Path) -> dict[str, tuple]:
    """{id: (fate, trained_at)} of a checkpoint's whole ledger: the store's rows up to its position, then
    the records it holds in flight."""
    from pipeline.ledger_store import open_run, records

    state = read_state(path)
    conn = open_run(path.parents[1])
    try:
        settled = list(records(conn, upto=state.ledger.position.rows))
    finally:
        conn.close()
    return {r.id: (r.fate, r.trained_at) for r in [*settled, *state.ledger.records]}


@pytest.mark.parametrize("keep", [1, 2])
def test_only_the_newest_complete_checkpoints_are_kept(tmp_path: Path, keep: int) -> None:
    ckpt, clock, ledger = make_checkpointer(tmp_path)
    ckpt.keep = keep
    for version in range(1, 5):
        clock.advance(version)
        ledger.trained([f"{'ab'[version % 2]}/{version // 3}"], at_version=version)
        anyio.run(ckpt.save, version, FileConsumer(b"w"))
    left = sorted(p.name[:9] for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert left == [f"v{v:08d}" for v in range(5 - keep, 5)]
    positions = [read_state(p).ledger.position.rows for p in sorted((tmp_path / "checkpoints").glob("v*"))]
    assert positions == list(range(5 - keep, 5)), "each checkpoint records the store's rows at its cut"


def test_each_checkpoint_records_the_stores_position_and_reads_back_the_whole_ledger(tmp_path: Path) -> None:
    """Settled records go to the store as they settle; a checkpoint records where the store stood, so a
    failed write loses nothing; its position and its records in flight give the ledger exactly; a resumed
    run rewinds the store to the checkpoint (rows settled after it are gone) and its checkpoints go on."""
    ckpt, clock, ledger = make_checkpointer(tmp_path)
    clock.advance(1)
    first = anyio.run(ckpt.save, 1, FileConsumer(b"w"))
    assert read_state(first).ledger.position.rows == 0 and len(read_state(first).ledger.records) == 4
    ledger.produced(["c/0"], "c", (1, 1), b"prompt-c")
    ledger.trained(["a/0", "a/1"], at_version=1)
    clock.advance(2)
    with pytest.raises(OSError, match="disk full"):
        anyio.run(ckpt.save, 2, FileConsumer(b"w", fail_after=0))
    ledger.dropped(["b/0", "b/1"], "stale: 3 > 2")
    clock.advance(3)
    third = anyio.run(ckpt.save, 3, FileConsumer(b"w"))
    state, at_third = read_state(third), ledger.counts()
    assert state.ledger.position.rows == 4 and [r.id for r in state.ledger.records] == ["c/0"]
    assert checkpoint_ledger(third) == {r.id: (r.fate, r.trained_at) for r in ledger.records()}, \
        "the store up to the position, and the records in flight, are the ledger"
    ledger.trained(["c/0"], at_version=3)  # after the checkpoint: the resume rolls it back
    ledger.store.commit()
    ledger.store.close()  # the crashed process is gone

    resumed = Resume.open(tmp_path, "unit", steps=100)
    assert resumed.summary()["rolled_back_trainings"] == 1
    again = resumed.ledger(max_uses=1)
    assert again.counts() == at_third
    assert again["c/0"].fate == "in_flight" and again.in_memory() == 1 and again.store.rows == 4
    again.regenerated(["c/0"], "resume: its payload was gone after the crash")
    from pipeline.checkpoint import Checkpointer, LocalCut

    cut = LocalCut("unit", 100, resumed.clock(), again, AdmissionGate(resumed.clock(), MaxStaleness(k=K), GROUPS),
                   {}, __import__("pipeline.channel", fromlist=["Channel"]).Channel("feedback", 8))
    cut.clock.advance(4)
    fourth = anyio.run(Checkpointer(tmp_path, 1, run="unit", steps=100, cut=cut).save, 4, FileConsumer(b"w"))
    assert read_state(fourth).ledger.position.rows == 5
    assert checkpoint_ledger(fourth)["c/0"] == ("regenerated", [])
    assert again.violations() == []


def test_a_resume_refuses_a_store_that_does_not_hold_its_checkpoints_rows(tmp_path: Path) -> None:
    ckpt, clock, ledger = make_checkpointer(tmp_path)
    ledger.trained(["a/0", "a/1"], at_version=0)
    clock.advance(1)
    anyio.run(ckpt.save, 1, FileConsumer(b"w"))
    ledger.store.close()
    for suffix in ("", "-wal", "-shm"):
        (tmp_path / f"ledger.sqlite{suffix}").unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match="holds 0 settled rows"):
        Resume.open(tmp_path, "unit", steps=100).ledger(max_uses=1)


def test_a_cut_that_fails_skips_its_checkpoint_and_the_next_one_holds_its_ledger_changes(tmp_path: Path) -> None:
    from pipeline.checkpoint import CutFailed

    ckpt, clock, ledger = make_checkpointer(tmp_path)

    class VoidOnce:  # the Ray cut's failure (a host did not answer within the lease), once
        def __init__(self, cut) -> None:
            self.cut, self.voided = cut, False

        async def capture(self, version, consumer):
            state = await self.cut.capture(version, consumer)
            if not self.voided:
                self.voided = True
                raise CutFailed("producer-0 did not answer")
            return state

    ckpt.cut = VoidOnce(ckpt.cut)
    clock.advance(1)
    assert anyio.run(ckpt.save, 1, FileConsumer(b"w")) is None, "skipped, and the run goes on"
    assert latest_checkpoint(tmp_path) is None
    ledger.trained(["a/0", "a/1"], at_version=1)
    clock.advance(2)
    path = anyio.run(ckpt.save, 2, FileConsumer(b"w"))
    assert checkpoint_ledger(path) == {
        "a/0": ("trained", [1]), "a/1": ("trained", [1]), "b/0": ("in_flight", []), "b/1": ("in_flight", [])
    }, "the next checkpoint holds the whole ledger"


def read_state_raw(checkpoint: Path):
    import msgspec

    from pipeline.checkpoint import STATE_FILE, RunState

    return msgspec.msgpack.decode((checkpoint / STATE_FILE).read_bytes(), type=RunState)


def test_a_write_that_fails_midway_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    ckpt, clock, _ = make_checkpointer(tmp_path)
    clock.advance(1)
    first = anyio.run(ckpt.save, 1, FileConsumer(b"A" * 1000))
    clock.advance(2)
    with pytest.raises(OSError, match="disk full"):
        anyio.run(ckpt.save, 2, FileConsumer(b"B" * 1000, fail_after=500))
    assert latest_checkpoint(tmp_path) == first
    assert read_state(first).version == 1
    assert (first / "consumer" / "state.bin").read_bytes() == b"A" * 1000
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp")]


def test_sigkill_in_the_middle_of_a_checkpoint_write_leaves_the_previous_one_loadable(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import anyio, sys
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from tests.helpers.checkpoint_helpers import FileConsumer, make_checkpointer
        ckpt, clock, _ = make_checkpointer(Path({str(tmp_path)!r}))
        clock.advance(1)
        anyio.run(ckpt.save, 1, FileConsumer(b"A" * 100_000))
        clock.advance(2)
        anyio.run(ckpt.save, 2, FileConsumer(b"B" * 100_000, fail_after=50_000, kill=True))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    torn = [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp-v00000002")]
    assert torn and (torn[0] / "consumer" / "state.bin").stat().st_size == 50_000, "the kill came mid-write"
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and read_state(latest).version == 1
    assert (latest / "consumer" / "state.bin").read_bytes() == b"A" * 100_000


def test_a_pointer_to_an_incomplete_checkpoint_falls_back_to_the_newest_complete_one(tmp_path: Path) -> None:
    ckpt, clock, _ = make_checkpointer(tmp_path)
    clock.advance(1)
    first = anyio.run(ckpt.save, 1, FileConsumer(b"A"))
    clock.advance(2)
    second = anyio.run(ckpt.save, 2, FileConsumer(b"BB"))
    (second / "consumer" / "state.bin").write_bytes(b"B")  # damaged after the fact: the manifest disagrees
    assert latest_checkpoint(tmp_path) == first
    with pytest.raises(CheckpointError, match="incomplete"):
        read_state(second)


def test_resume_without_a_checkpoint_names_the_key_to_set(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="checkpoint.every"):
        Resume.open(tmp_path, "unit", steps=10)


# ------------------------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model"))


class SurvivingStore(MemoryStore):
    """A memory store whose payloads outlive one run's `close()`, as a Mooncake Store's do when its
    segment is held by another process: a resumed run can find the payloads the crashed one stored."""

    async def close(self) -> None:
        return None


def pipeline(
    model: Path, root: Path, store: MemoryStore, steps: int, crash_at: int | None = None, admission: str = "pace",
    max_reuse: int = 1, k: int = K,
) -> Pipeline:
    hooks = [lambda ctx: [CrashAt(ctx, crash_at)]] if crash_at is not None else []
    return Pipeline(
        name="resume",
        producer=Rollout(ReverseDigits(digits=2), [TorchEngine(model, seed=0)], tokenizer=model, group_size=4,
                         batch_groups=GROUPS),
        buffer=RefBuffer(store),
        consumer=GRPOLearner(model, lr=3e-3, groups_per_step=GROUPS, selection=Fifo(max_reuse=max_reuse)),
        staleness=MaxStaleness(k=k, admission=admission),
        steps=steps, run_root=root, progress=False, checkpoint_every=3, hooks=hooks,
    )


def crash_until(model: Path, root: Path, make_store, found, crash_at: int, tries: int = 5, **run):
    """Runs crashed at `crash_at`, made again (up to `tries` times) until `found(checkpoint)` of the last
    checkpoint before the crash is not empty: what a checkpoint holds at that moment depends on how fast the
    producer ran against the learner. Returns (its store, its folder, the checkpoint, what `found` found)."""
    for attempt in range(tries):
        store = make_store()
        with pytest.raises(ActorFailed, match=f"injected crash at version {crash_at}"):
            pipeline(model, root / f"try{attempt}", store, steps=12, crash_at=crash_at, **run).run()
        run_dir = next((root / f"try{attempt}").glob("resume-*"))
        checkpoint = read_state(latest_checkpoint(run_dir))
        if what := found(checkpoint):
            return store, run_dir, checkpoint, what
    raise AssertionError(f"no checkpoint held what the test needs in {tries} runs")


def crash_with_groups_held(model: Path, root: Path, store_kind: str, admission: str):
    """A run crashed at version 7 whose version-6 checkpoint has groups produced and held by the buffer,
    not yet trained (none, once in a fresh run of the suite, 2026-12-06): (its store, its folder, the
    checkpoint, how many such groups)."""
    def held_groups(checkpoint) -> int:
        in_flight = in_flight_groups(checkpoint)
        return len({h.ref.group for h in checkpoint.held if h.uses == 0 and h.ref.group in in_flight})

    make_store = MemoryStore if store_kind == "memory" else SurvivingStore
    return crash_until(model, root, make_store, held_groups, crash_at=7, admission=admission)


@pytest.mark.parametrize(("store_kind", "admission"), [("memory", "eager"), ("surviving", "pace")])
def test_a_crashed_run_resumes_from_its_checkpoint_and_finishes(
    model: Path, tmp_path: Path, store_kind: str, admission: str
) -> None:
    """memory + eager: payloads die with the run, producers are busy at the checkpoint (owed prompts);
    surviving + pace: payloads outlive the crash and are trained from the store."""
    store, run_dir, checkpoint, held = crash_with_groups_held(model, tmp_path, store_kind, admission)
    crashed = json.loads((run_dir / "ledger.json").read_text())
    trained_after = sum(1 for r in crashed for v in r["trained_at"] if v >= 6)
    assert trained_after > 0, "the crash came after steps the checkpoint does not hold"
    store = MemoryStore() if store_kind == "memory" else store  # a memory store dies with its run
    resumed = pipeline(model, tmp_path, store, steps=12, admission=admission)
    summary = resumed.resume(run_dir)

    resume = summary["resume"]
    assert resume["from_version"] == 6 and resume["rolled_back_versions"] >= 1
    assert resume["owed_prompts"] == len(checkpoint.owed), "prompts admitted but not produced are not skipped"
    assert resume["redo_requests"] == len(checkpoint.redo) + len(checkpoint.ledger.pending_redo)
    final = read_state(latest_checkpoint(run_dir))  # the run's end is kept: what it still owed is in it
    assert final.version == 12
    still_owed = len(redo_requests(final)) + len(final.ledger.pending_redo)
    assert resumed.producer.stats.get("redone", 0) + still_owed >= (
        resume["regenerated_groups"] + resume["owed_prompts"] + resume["redo_requests"]
    ), "every regenerated group, owed prompt and redo request was produced again, or is owed at the end"
    assert resume["rolled_back_trainings"] == trained_after
    assert summary["version"] == 12 and summary["ledger_balanced"]
    assert summary["samples"]["trained"] == 12 * GROUPS * 4  # every version trained once, none twice
    assert summary["max_staleness_trained"] <= K
    if store_kind == "surviving":  # payloads that outlived the crash are trained, not regenerated
        assert (resume["reinjected_groups"], resume["regenerated_groups"]) == (held, 0)
    else:
        assert (resume["reinjected_groups"], resume["regenerated_groups"]) == (0, held)
    records = check_ledger(run_dir, bound=K)
    by_id = {r["id"]: r for r in records}
    for r in crashed:  # the checkpoint's past is kept: whatever was settled before version 6 still is
        if r["fate"] == "trained" and r["trained_at"][0] < 6:
            assert by_id[r["id"]]["trained_at"] == r["trained_at"]
    trained_at = sorted({r["trained_at"][0] for r in records if r["fate"] == "trained"})
    assert trained_at == list(range(12)), "each version trained exactly once across the resume"
    crashed_ids = {r["id"] for r in crashed}
    made_after_resume = [r for r in records if r["id"] not in crashed_ids]
    assert made_after_resume and min(r["versions"][0] for r in made_after_resume) >= 6, \
        "engines generated with the checkpoint's weights (or newer) from the resume on"
    regenerated = [r for r in records if r["fate"] == "regenerated" and r["reason"].startswith("resume:")]
    assert len(regenerated) == resume["regenerated_groups"] * 4
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == list(range(1, 13))
    assert (run_dir / "attempts" / "1" / "ledger.json").exists()


REUSE_K = 6


def test_groups_the_learner_may_reuse_come_back_into_its_window_after_a_crash(model: Path, tmp_path: Path) -> None:
    """max_reuse = 2: the window's trained groups with a use left are checkpointed with their use count and,
    their payloads surviving, trained once more after the resume; none more than twice, all within k."""
    import structlog

    def reusable_groups(checkpoint) -> list:
        """Groups the window held with a use left, still trainable at the checkpoint's version (a learner
        that outran the producer may have used them all up by then: once in a fresh run, 2026-12-06)."""
        reused = [h for h in checkpoint.held if h.uses > 0]
        assert all(h.uses == 1 and h.holder == "learner" for h in reused)
        return [h for h in reused if checkpoint.version - h.ref.version <= REUSE_K]

    # crashed right after the version-6 checkpoint
    store, run_dir, checkpoint, reusable = crash_until(
        model, tmp_path, SurvivingStore, reusable_groups, crash_at=6, max_reuse=2, k=REUSE_K)
    assert checkpoint.version == 6
    with structlog.testing.capture_logs() as logs:
        summary = pipeline(model, tmp_path, store, steps=12, max_reuse=2, k=REUSE_K).resume(run_dir)
    restored = [e for e in logs if e.get("event") == "learner restored"]
    assert restored and restored[0]["reusable_groups"] == len(reusable)
    assert summary["version"] == 12 and summary["ledger_balanced"] and summary["samples"]["reused"] > 0
    records = json.loads((run_dir / "ledger.json").read_text())
    per_version: dict[int, set[str]] = {}
    for r in records:
        assert len(r["trained_at"]) <= 2 and len(set(r["trained_at"])) == len(r["trained_at"]), r
        for v in r["trained_at"]:
            assert v - r["versions"][0] <= REUSE_K, r
            per_version.setdefault(v, set()).add(r["group"])
    assert {v: len(groups) for v, groups in per_version.items()} == {v: GROUPS for v in range(12)}
    reused_ids = {f"{h.ref.group}/{i}" for h in reusable for i in range(h.ref.rows)}
    by_id = {r["id"]: r for r in records}
    assert any(len(by_id[i]["trained_at"]) == 2 and by_id[i]["trained_at"][1] >= 6 for i in reused_ids), \
        "a restored group was trained again after the resume"


@pytest.mark.slow
def test_baton_run_killed_with_sigkill_resumes_with_baton_run_resume(tmp_path: Path) -> None:
    sets = ["steps=16", "checkpoint.every=4", "telemetry.progress=false", "name=killed",
            f"run_root='{tmp_path}'", f"model.path='{tmp_path / 'model'}'"]
    args = [x for s in sets for x in ("--set", s)]
    cmd = [sys.executable, "-m", "baton.cli", "run"]
    proc = subprocess.Popen([*cmd, str(ROOT / "configs" / "quickstart.toml"), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("killed-*/checkpoints/v00000008-*/manifest.json")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.02)
        time.sleep(0.2)  # a few more versions, which the resume rolls back
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    run_dir = next(tmp_path.glob("killed-*"))
    assert not (run_dir / "summary.json").exists(), "the run finished before it was killed"
    state = read_state(latest_checkpoint(run_dir))
    assert state.version >= 8
    known = set(checkpoint_ledger(latest_checkpoint(run_dir)))  # the checkpoint's whole ledger

    done = subprocess.run([*cmd, "--resume", str(run_dir), "--set", "telemetry.progress=false"], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["resume"]["from_version"] == state.version
    assert summary["version"] == 16 and summary["ledger_balanced"]
    assert summary["samples"]["trained"] == 16 * 16 * 8
    assert summary["samples"]["lost"] == 0
    assert summary["max_staleness_trained"] <= 2
    records = check_ledger(run_dir, bound=2)
    assert min(r["versions"][0] for r in records if r["id"] not in known) >= state.version, \
        "engines generated with the checkpoint's weights (or newer) from the resume on"
    in_flight_at_checkpoint = {r.id for r in state.ledger.records if r.fate == "in_flight"}
    fates = {r["id"]: r["fate"] for r in records}
    # a memory store dies with its process: everything in flight at the checkpoint is counted and regenerated
    assert {i: fates[i] for i in in_flight_at_checkpoint} == {i: "regenerated" for i in in_flight_at_checkpoint}


def test_resume_run_continues_a_config_built_run_from_its_checkpoint(tmp_path: Path) -> None:
    """`resume_run` (the Python API behind `baton run --resume`) continues a finished run from its end (its
    last version is checkpointed) and trains on to new `steps` from the run folder's own config.toml."""
    from baton.builder import build_pipeline
    from baton.config import load_toml, validate
    from baton.resume import resume_run
    from baton.schema import RunConfig

    overrides = [f"run_root='{tmp_path}'", f"model.path='{tmp_path / 'model'}'", "steps=6", "checkpoint.every=3",
                 "learner.groups_per_step=4", "engine.batch_groups=4", "rollout.group_size=4",
                 "telemetry.progress=false", "watchdog.fail_after_s=60", "watchdog.warn_after_s=20"]
    cfg = validate(RunConfig, load_toml(ROOT / "configs" / "quickstart.toml", overrides), source="test")
    first = build_pipeline(cfg).run()
    run_dir = Path(first["run_dir"])
    assert first["checkpoint"]["version"] == 6

    summary = resume_run(run_dir, overrides=["steps=9"])
    assert summary["resume"]["from_version"] == 6 and summary["resume"]["rolled_back_versions"] == 0
    assert summary["resume"]["rolled_back_trainings"] == 0
    assert summary["version"] == 9 and summary["ledger_balanced"]
    assert summary["samples"]["trained"] == 9 * 4 * 4
    check_ledger(run_dir, bound=2)
    assert (run_dir / "attempts" / "1" / "summary.json").exists()


@pytest.mark.slow
def test_payloads_held_by_another_mooncake_process_are_reused_after_a_crash(
    model: Path, tmp_path: Path, mooncake_master
) -> None:
    """Mooncake Store, its segment held by a second process: the crashed run's payloads outlive it, so
    the resumed run trains the checkpointed in-flight groups from the store instead of regenerating them."""
    from buffers.mooncake import MooncakeSettings, MooncakeStore

    holder = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "helpers" / "mooncake_peer.py"), mooncake_master.address, str(256 << 20),
         "hold", "300"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ready"

        def client() -> MooncakeStore:  # no segment of its own: every payload lands in the holder's
            return MooncakeStore(MooncakeSettings(master_server_address=mooncake_master.address, full_wait_s=30))

        with pytest.raises(ActorFailed, match="injected crash at version 7"):
            pipeline(model, tmp_path, client(), steps=12, crash_at=7).run()
        run_dir = next(tmp_path.glob("resume-*"))
        summary = pipeline(model, tmp_path, client(), steps=12).resume(run_dir)
    finally:
        holder.kill()
        holder.wait()
    resume = summary["resume"]
    assert resume["from_version"] == 6
    assert resume["reinjected_groups"] > 0, "payloads in the holder's segment were trained, not regenerated"
    assert summary["version"] == 12 and summary["ledger_balanced"]
    assert summary["samples"]["trained"] == 12 * GROUPS * 4 and summary["samples"]["lost"] == 0
    records = check_ledger(run_dir, bound=K)
    assert sorted({r["trained_at"][0] for r in records if r["fate"] == "trained"}) == list(range(12))


def test_baton_run_resume_of_a_folder_without_checkpoints_exits_2_and_says_why(tmp_path: Path, capsys) -> None:
    from baton.cli import main

    assert main(["run"]) == 2
    assert "needs a CONFIG, or --resume RUN_DIR" in capsys.readouterr().err
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(
        f"name = 'x'\nrun_root = '{tmp_path}'\n[model]\npath = '{tmp_path / 'model'}'\n[telemetry]\nprogress = false\n"
    )
    assert main(["run", "--resume", str(run_dir)]) == 2
    assert "holds no complete checkpoint; runs checkpoint only with checkpoint.every > 0" in capsys.readouterr().err


def test_a_failed_baton_run_with_a_checkpoint_says_how_to_resume_it(tmp_path: Path, capsys) -> None:
    from baton.cli import main

    sets = [f"run_root='{tmp_path}'", f"model.path='{tmp_path / 'model'}'", "steps=6", "checkpoint.every=3",
            "learner.groups_per_step=4", "engine.batch_groups=4", "rollout.group_size=4", "telemetry.progress=false",
            "name='hint'", 'faults=[{kind="learner.crash", at=[5]}]']
    args = [x for s in sets for x in ("--set", s)]
    assert main(["run", str(ROOT / "configs" / "quickstart.toml"), *args]) == 1
    run_dir = next(tmp_path.glob("hint-*"))
    err = capsys.readouterr().err
    assert f"{run_dir} holds a checkpoint of version 3; continue the run with: baton run --resume {run_dir}" in err
    assert main(["run", "--resume", str(run_dir)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["version"] == 6 and summary["resume"]["from_version"] == 3 and summary["ledger_balanced"]
