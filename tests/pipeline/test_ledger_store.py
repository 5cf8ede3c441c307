"""The ledger's store (pipeline.ledger_store): settled records written as they settle, read back by id,
positions for checkpoints, a SIGKILL mid-write, export, the invariant checks of `baton ledger`, and a
long run whose ledger holds only what is in flight."""

from __future__ import annotations

import argparse
import json
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest

from baton.ledger_command import run as ledger_command
from pipeline.ledger import Ledger, LedgerError
from pipeline.ledger_store import STORE_FILE, check, history, open_run, records, totals

ROOT = Path(__file__).resolve().parents[2]


def ids(group: str, n: int = 2) -> list[str]:
    return [f"{group}/{i}" for i in range(n)]


def small_run(folder: Path, max_uses: int = 1) -> Ledger:
    """A ledger with every fate (and a reuse when max_uses > 1), committed."""
    ledger = Ledger.create(folder, max_uses=max_uses)
    for g, version in (("a", 0), ("b", 0), ("c", 1), ("d", 1), ("e", 2)):
        ledger.produced(ids(g), g, (version, version), f"prompt-{g}".encode())
    ledger.trained(ids("a"), at_version=1)
    ledger.dropped(ids("b"), "stale: 3 > 2")
    ledger.lost(["c/0"], "KeyNotFound: gone")
    ledger.regenerated(["c/1"], "requeue")
    ledger.dropped(ids("d"), "filtered: rewards all equal (0)")
    if max_uses > 1:
        ledger.trained(["a/0"], at_version=2)
    ledger.store.commit()
    return ledger


def damage(folder: Path, *sql: str) -> None:
    conn = sqlite3.connect(folder / STORE_FILE)
    for statement in sql:
        conn.execute(statement)
    conn.commit()
    conn.close()


def baton_ledger(folder: Path, item_id: str | None = None, bound: int | None = 2) -> int:
    """`baton ledger FOLDER [--id ID] [--bound K]`'s exit code."""
    return ledger_command(argparse.Namespace(run_dir=str(folder), export=None, item_id=item_id, bound=bound))


def test_settled_records_leave_memory_for_the_store_and_still_answer_by_id(tmp_path: Path) -> None:
    ledger = small_run(tmp_path)
    assert ledger.in_memory() == 2 == ledger.counts()["in_flight"], "only e/0 and e/1 are held"
    assert ledger["a/0"].trained_at == [1] and ledger["b/1"].reason == "stale: 3 > 2"
    assert ledger["e/0"].fate == "in_flight"
    with pytest.raises(LedgerError, match="produced twice"):
        ledger.produced(["a/1"], "a2", (3, 3))  # settled: found in the store
    with pytest.raises(LedgerError, match="already trained"):
        ledger.dropped(["a/0"], "stale")
    with pytest.raises(LedgerError, match="max_uses=1"):
        ledger.trained(["a/0"], at_version=2)
    conn = open_run(tmp_path)  # another connection sees what was committed
    assert totals(conn) == ledger.counts()
    assert [r.id for r in records(conn)] == ["a/0", "a/1", "b/0", "b/1", "c/0", "c/1", "d/0", "d/1", "e/0", "e/1"]
    assert check(conn, bound=2) == []
    assert history(conn, "c/0").fate == "lost" and history(conn, "nope") is None


def test_a_reused_item_appends_a_row_and_reads_back_whole(tmp_path: Path) -> None:
    ledger = small_run(tmp_path, max_uses=2)
    assert ledger["a/0"].trained_at == [1, 2] and ledger.counts()["reused"] == 1
    conn = open_run(tmp_path)
    assert conn.execute("SELECT count(*) FROM settled WHERE id = 'a/0'").fetchone()[0] == 2
    assert {r.id: r.trained_at for r in records(conn)}["a/0"] == [1, 2]
    assert check(conn, bound=2) == []
    assert ledger.violations() == []


def test_a_checkpoint_position_rewinds_the_store_on_resume(tmp_path: Path) -> None:
    ledger = small_run(tmp_path)
    state, before = ledger.state(), ledger.counts()  # committed and fsynced: rows 1..8
    assert state.position.rows == 8 and [r.id for r in state.records] == ["e/0", "e/1"]
    ledger.trained(ids("e"), at_version=3)  # after the checkpoint
    ledger.store.commit()
    ledger.store.close()
    again = Ledger.from_state(state, store=Ledger.create(tmp_path).store)
    assert again.store.rows == 8 and again["e/0"].fate == "in_flight" and again.in_memory() == 2
    assert again.counts() == before
    again.dropped(ids("e"), "stale")
    again.store.commit()
    assert check(open_run(tmp_path), bound=2) == []
    assert [r.fate for r in records(open_run(tmp_path))][-2:] == ["dropped", "dropped"]


def test_sigkill_while_writing_leaves_a_consistent_store(tmp_path: Path) -> None:
    """A process killed in the middle of writing (its last transaction open): the store reopens at its last
    commit, and its counts and rows agree."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from pipeline import ledger_store
        from pipeline.ledger import Ledger
        ledger_store.COMMIT_ROWS = 100
        ledger = Ledger.create({str(tmp_path)!r})
        for g in range(2000):
            ledger.produced([f"g{{g}}/0", f"g{{g}}/1"], f"g{{g}}", (g, g))
            if g >= 2:
                ledger.trained([f"g{{g - 2}}/0"], at_version=g)
                ledger.dropped([f"g{{g - 2}}/1"], "stale")
            if g == 1234:
                os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    conn = open_run(tmp_path)
    rows = conn.execute("SELECT count(*) FROM settled").fetchone()[0]
    assert 0 < rows < 2 * 1233, "some rows were committed, the last ones were not"
    assert check(conn, bound=2) == [], "the counts committed with the rows agree with them"
    assert totals(conn)["produced"] == json.loads(
        conn.execute("SELECT value FROM meta WHERE key = 'counts'").fetchone()[0])["produced"]


def test_export_is_what_ledger_json_holds_on_the_same_run(tmp_path: Path) -> None:
    from baton.builder import build_pipeline
    from baton.config import load_toml, validate
    from baton.schema import RunConfig

    overrides = [f"run_root='{tmp_path}'", f"model.path='{tmp_path / 'model'}'", "steps=4",
                 "learner.groups_per_step=2", "engine.batch_groups=2", "rollout.group_size=2",
                 "telemetry.progress=false"]
    summary = build_pipeline(validate(RunConfig, load_toml(ROOT / "configs" / "quickstart.toml", overrides),
                                      source="test")).run()
    run_dir = Path(summary["run_dir"])
    out = tmp_path / "ledger.jsonl"
    args = argparse.Namespace(run_dir=str(run_dir), export=str(out), item_id=None, bound=None)
    assert ledger_command(args) == 0
    exported = [json.loads(line) for line in out.read_text().splitlines()]
    assert exported == json.loads((run_dir / "ledger.json").read_text())
    assert len(exported) == summary["samples"]["produced"] and summary["ledger_balanced"]


@pytest.mark.parametrize(("kind", "sql"), [
    ("trained twice", ["INSERT INTO settled VALUES (100, 'a/0', 'a', 0, 0, 'trained', '', 1, 1)"]),
    ("over max_uses", ["INSERT INTO settled VALUES (100, 'a/0', 'a', 0, 0, 'trained', '', 2, 1)"]),
    ("settled twice", ["INSERT INTO settled VALUES (100, 'b/0', 'b', 0, 0, 'trained', '', 2, 1)"]),
    ("over the bound", ["UPDATE settled SET at = 5 WHERE id = 'a/1'"]),
    ("lost uncounted", ["DELETE FROM settled WHERE id = 'c/0'"]),
    ("lost uncounted", ["DELETE FROM live WHERE id = 'e/1'"]),
    ("bad record", ["UPDATE settled SET lo = 3 WHERE id = 'b/1'"]),
])
def test_baton_ledger_exits_1_on_each_broken_invariant(tmp_path: Path, capsys, kind: str, sql: list[str]) -> None:
    small_run(tmp_path).store.close()
    assert baton_ledger(tmp_path) == 0
    capsys.readouterr()
    damage(tmp_path, *sql)
    assert baton_ledger(tmp_path) == 1
    out = capsys.readouterr().out
    assert f"BROKEN {kind}:" in out
    assert kind in {v["kind"] for v in json.loads(out.strip().splitlines()[-1])["violations"]}


def test_baton_ledger_shows_one_samples_history_and_says_what_is_missing(tmp_path: Path, capsys) -> None:
    small_run(tmp_path, max_uses=2).store.close()
    assert baton_ledger(tmp_path, "a/0") == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == "row 1: trained at version 1" and out[1].endswith("trained at version 2 (reuse 1)")
    assert msgspec.json.decode(out[-1]) == {
        "id": "a/0", "group": "a", "versions": [0, 0], "trained_at": [1, 2], "fate": "trained", "reason": ""}
    assert baton_ledger(tmp_path, "zz/9") == 2
    assert baton_ledger(tmp_path / "nowhere") == 2
    (tmp_path / "summary.json").write_text(json.dumps({"staleness_bound": 0}))
    assert baton_ledger(tmp_path, bound=None) == 1, "the run's own bound (0) is checked: a/0 was 1 stale"


def test_a_long_run_holds_only_live_records_in_memory(tmp_path: Path) -> None:
    """Thousands of versions with the smallest shapes (groups of 2, 2 groups per version, a window of 3
    versions in flight): the ledger's memory never holds more than what is in flight."""
    ledger = Ledger.create(tmp_path, max_uses=1)
    held = []
    for version in range(5000):
        for g in range(2):
            name = f"v{version}.{g}"
            ledger.produced(ids(name), name, (version, version), name.encode(), {"reward": [0.0, 1.0]})
        if version >= 3:
            old = f"v{version - 3}"
            ledger.trained(ids(f"{old}.0"), at_version=version)
            ledger.dropped(ids(f"{old}.1"), "stale: 3 > 2")
            ledger.take_settled()
        held.append((ledger.in_memory(), len(ledger._values), len(ledger._sources)))
    assert ledger.counts()["produced"] == 20_000 and ledger.counts()["in_flight"] == 12
    assert max(h[0] for h in held) == 12 and held[-1] == (12, 12, 6), "only the 3 versions in flight are held"
    assert ledger.violations() == []


def test_a_format_1_state_with_every_record_is_written_into_the_store_once(tmp_path: Path) -> None:
    from pipeline.ledger import LedgerState

    (tmp_path / "old").mkdir()
    ledger = small_run(tmp_path / "old", max_uses=2)
    whole = [msgspec.structs.replace(r) for r in ledger.records()]  # what a format-1 checkpoint held
    state = LedgerState(max_uses=2, records=whole, counts=dict(ledger._counts), sources={}, pending_redo=[],
                        values={})
    for _ in range(2):  # resumed twice from the same checkpoint: the store is rebuilt, not appended to
        again = Ledger.from_state(state, store=Ledger.create(tmp_path, max_uses=2).store)
        again.store.commit()
        assert [(r.id, r.fate, r.trained_at) for r in records(open_run(tmp_path))] == [
            (r.id, r.fate, r.trained_at) for r in whole]
        assert again.violations() == []
        again.store.close()
