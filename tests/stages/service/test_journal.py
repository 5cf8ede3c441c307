"""The service's journal and store alone: records come back as written (a line torn by a kill is dropped, a
damaged one named); a restart's plan keeps the results up to the commit and runs again, in order, what was
accepted after it; a commit is whole or absent."""

from __future__ import annotations

import pytest

from stages.service.futures import Failure
from stages.service.journal import (
    JOURNAL_FILE,
    CallRecord,
    Commit,
    DoneRecord,
    Journal,
    Outcome,
    SamplerRecord,
    SessionRecord,
    compacted,
    plan,
    read_journal,
)
from stages.service.service import Sessions
from stages.service.store import COMMIT_FILE, Store

M = "session-1:train:0"


def call(seq: int, kind: str, model: str = M) -> CallRecord:
    return CallRecord(model, seq, kind, b"\x00\xffbody" if kind == "forward_backward" else b"{}")


def done(seq: int, value: object, model: str = M, at: float = 100.0) -> DoneRecord:
    return DoneRecord(model, seq, Outcome.of(value), at)


def results(model_plan) -> dict:
    return {seq: d.outcome.result() for seq, d in model_plan.finished.items()}


def test_records_come_back_as_written_and_a_torn_last_line_is_dropped(tmp_path) -> None:
    journal = Journal(tmp_path)
    written = [SessionRecord("session-1"), call(0, "create_model"), call(1, "forward_backward"),
               done(1, b"\x01proto"), done(2, {"metrics": {"a:mean": 1.5}}), done(3, Failure("boom", "user")),
               SamplerRecord("tinker://m/sampler_weights/x", "samplers/0.safetensors")]
    for record in written:
        journal.append(record)
    journal.close()
    assert read_journal(tmp_path) == written
    assert [r.outcome.result() for r in read_journal(tmp_path) if isinstance(r, DoneRecord)] == [
        b"\x01proto", {"metrics": {"a:mean": 1.5}}, Failure("boom", "user")]
    path = tmp_path / JOURNAL_FILE
    path.write_bytes(path.read_bytes() + b'{"type":"call","model":"x","se')  # a kill in the middle of a write
    assert read_journal(tmp_path) == written
    again = Journal(tmp_path)  # a restart: the torn line is cut off, the next record is a line of its own
    again.append(SessionRecord("session-2"))
    again.close()
    written.append(SessionRecord("session-2"))
    assert read_journal(tmp_path) == written
    lines = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join([lines[0], b"{not json", *lines[1:]]))
    with pytest.raises(ValueError, match="line 2 does not decode"):
        read_journal(tmp_path)
    assert read_journal(tmp_path / "nothing") == []


def test_a_restart_keeps_what_was_committed_and_runs_again_what_came_after() -> None:
    records = [call(0, "create_model"), call(1, "forward_backward"), done(1, b"fb1"), call(2, "optim_step"),
               done(2, {"metrics": {}}, at=10.0), call(3, "optim_step"), call(4, "save_weights_for_sampler"),
               done(4, {"path": "p4"}, at=10.0), call(5, "forward_backward"), done(5, b"fb5"), call(6, "optim_step"),
               call(7, "save_weights_for_sampler")]
    committed = Commit(step=2, seq=3, outcome=Outcome.of({"metrics": {"from": 1.0}}))
    model = plan(records, {M: committed}, horizon=50.0)[M]
    assert model.maker.kind == "create_model" and model.last_seq == 7
    # up to the commit: the recorded results (the optim_step's from its commit) unless forgotten (2 finished
    # before the horizon); after it: a finished save stands, however old
    assert results(model) == {1: b"fb1", 3: {"metrics": {"from": 1.0}}, 4: {"path": "p4"}}
    # the gradient after the commit was lost with the process: its forward_backward runs again, finished or not
    assert [(c.seq, c.kind) for c in model.rerun] == [(5, "forward_backward"), (6, "optim_step"),
                                                      (7, "save_weights_for_sampler")]
    # the journal a restart rewrites: no committed call's body, and the next restart plans the same
    kept = compacted(records, {M: model})
    assert not any(isinstance(r, CallRecord) and 0 < r.seq <= 4 for r in kept)
    again = plan(kept, {M: committed}, horizon=50.0)[M]
    assert results(again) == results(model) and again.rerun == model.rerun and again.last_seq == 7
    never = plan(records, {})[M]  # nothing committed: everything after the model was made runs again
    assert [c.seq for c in never.rerun] == [1, 2, 3, 5, 6, 7] and results(never) == {4: {"path": "p4"}}


def test_a_call_that_failed_after_the_commit_is_not_run_again() -> None:
    """A forward_backward whose answer was a failure (a follower rank died in it, say) changed nothing the client
    relies on, and the client was told so: a restart keeps its failure and runs again only what succeeded."""
    failed = DoneRecord(M, 2, Outcome.of(Failure("learner rank 1 exited", "server")), 100.0)
    records = [call(0, "create_model"), call(1, "forward_backward"), done(1, b"fb1"), call(2, "forward_backward"),
               failed, call(3, "optim_step"), done(3, {"metrics": {}})]
    model = plan(records, {})[M]
    assert [c.seq for c in model.rerun] == [1, 3]
    assert results(model) == {2: Failure("learner rank 1 exited", "server")}


def test_a_committed_call_without_its_result_fails_by_name_and_a_model_without_its_maker_is_an_error() -> None:
    records = [call(0, "create_model"), call(1, "forward_backward"), call(2, "optim_step")]
    model = plan(records, {M: Commit(1, 2, Outcome.of({"metrics": {}}))})[M]
    lost = results(model)[1]
    assert isinstance(lost, Failure) and "lost in a restart" in lost.error
    assert results(model)[2] == {"metrics": {}} and model.rerun == []
    with pytest.raises(ValueError, match="without the call that made it"):
        plan([call(1, "forward_backward")], {})


def test_a_commit_is_whole_and_replaces_the_one_before(tmp_path) -> None:
    store = Store(tmp_path, tmp_path / "model")
    with pytest.raises(ValueError, match="holds the state of .*model, not of .*other"):
        Store(tmp_path, tmp_path / "other")
    for step in (1, 4, 5):  # periodic commits: the one before is several steps back
        store.step_folder(M, step).mkdir(parents=True)
        store.commit(M, step, seq=2 * step, outcome=Outcome.of({"metrics": {"step": step}}))
    assert store.commits() == {M: Commit(5, 10, Outcome.of({"metrics": {"step": 5}}))}
    assert [p.name for p in sorted((tmp_path / "models" / M).glob("step-*"))] == ["step-5"]
    (tmp_path / "models" / M / f"{COMMIT_FILE}.part").write_bytes(b'{"step": 3')  # a kill before the rename
    assert store.commits()[M].step == 5


def test_a_restored_session_number_is_never_given_out_again() -> None:
    sessions = Sessions()
    sessions.restore("session-1")
    sessions.restore("session-4")
    assert sessions.create() == "session-5" and set(sessions.seen) == {"session-1", "session-4", "session-5"}


def test_a_ledger_line_a_kill_cut_short_loses_nothing_after_it(tmp_path) -> None:
    """A torn last line of the ledger (a kill mid-write) stays one bad line: the records before it and those a
    restarted service appends after it are all read."""
    from stages.service.ledger import Ledger, read_ledger

    ledger = Ledger(tmp_path)
    ledger.trained(M, 1, "cross_entropy", 2, 10, 1)
    ledger.close()
    with open(tmp_path / "ledger.jsonl", "ab") as f:
        f.write(b'{"type":"trained","model":"m","se')
    again = Ledger(tmp_path)
    again.sampled("req-1", "tinker://m/sampler_weights/s", 1, 3, [4, 4])
    again.close()
    assert [(type(r).__name__, getattr(r, "seq", None)) for r in read_ledger(tmp_path)] == [
        ("TrainedRecord", 1), ("SampledRecord", None)]
