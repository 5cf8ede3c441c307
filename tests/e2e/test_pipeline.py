"""The Python DSL over real parts (torch engine, memory store, GRPO learner), on short runs:
stale work is dropped or requeued and counted, corrupt payloads are counted as lost, a channel
closed mid-run stops the run with a clear error, and the ledger balances in every case."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from baton.watch_command import watch
from buffers.memory import MemoryStore
from buffers.ref_buffer import RefBuffer
from pipeline.actor import ActorFailed, BaseActor
from pipeline.dsl import Pipeline
from pipeline.reasons import by_kind, more_of
from policies import MaxStaleness
from stages.data.model import make_tiny_model
from stages.data.tasks import ReverseDigits
from stages.engines.torch import TorchEngine
from stages.learner import GRPOLearner
from stages.rollout import Rollout

torch.set_num_threads(1)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model"))


@dataclass(frozen=True)
class LooseAdmission(MaxStaleness):
    """Admits as if k were `admit_k`, accepts with the real k: forces stale work to exist."""

    admit_k: int = 4

    def admission_limit(self, version: int, groups_per_step: int) -> int:
        return (version + self.admit_k + 1) * groups_per_step


class CorruptingStore(MemoryStore):
    """Returns a copy with one flipped body byte for every `every`-th get (a bad NIC, a bad disk)."""

    def __init__(self, every: int) -> None:
        super().__init__()
        self.every, self.gets, self.corrupted = every, 0, 0

    async def get(self, key: str, size_hint: int | None = None) -> memoryview:
        view = await super().get(key, size_hint)
        self.gets += 1
        if self.gets % self.every:
            return view
        bad = bytearray(view)
        bad[-1] ^= 0xFF
        self.corrupted += 1
        return memoryview(bad)


def pipeline(model: Path, tmp_path: Path, *, store=None, staleness=None, steps=6, **kw) -> Pipeline:
    """A short run; `pipe.producer.stats` counts groups made and redone."""
    store = MemoryStore() if store is None else store
    return Pipeline(
        name="t",
        steps=steps,
        run_root=tmp_path,
        progress=False,
        producer=Rollout(ReverseDigits(digits=2), [TorchEngine(model)], tokenizer=model,
                         group_size=4, batch_groups=4),
        buffer=RefBuffer(store),
        consumer=GRPOLearner(model, groups_per_step=4),
        staleness=staleness or MaxStaleness(k=1),
        **kw,
    )


def ledger_of(summary: dict) -> list[dict]:
    return json.loads((Path(summary["run_dir"]) / "ledger.json").read_text())


def test_stale_groups_are_dropped_and_counted(model: Path, tmp_path: Path) -> None:
    s = pipeline(model, tmp_path, staleness=LooseAdmission(k=0, on_stale="drop"), steps=8).run()
    assert s["samples"]["dropped"] > 0
    assert s["max_staleness_trained"] == 0
    assert s["ledger_balanced"]
    dropped = [r for r in ledger_of(s) if r["fate"] == "dropped"]
    assert dropped and all(r["reason"].startswith("stale: ") for r in dropped)
    assert all(r["trained_at"][0] == r["versions"][0] for r in ledger_of(s) if r["fate"] == "trained")
    # the summary, and `baton watch` from it, say why: every dropped sample by its reason
    assert list(s["reasons"]) == ["dropped"] and by_kind(s["reasons"]["dropped"]) == {"stale": len(dropped)}
    assert set(s["reasons"]["dropped"]) <= {r["reason"] for r in dropped} | {more_of("stale")}
    out = io.StringIO()
    assert watch(Path(s["run_dir"]), out=out, sleep=lambda _: None) == 0
    assert f"dropped {len(dropped)} by reason: " in out.getvalue()


def test_stale_groups_are_requeued_and_regenerated(model: Path, tmp_path: Path) -> None:
    s = pipeline(model, tmp_path, staleness=LooseAdmission(k=0, on_stale="requeue"), steps=8).run()
    assert s["samples"]["regenerated"] > 0
    assert s["samples"]["dropped"] == 0
    assert s["max_staleness_trained"] == 0
    assert s["ledger_balanced"]


def test_corrupt_payloads_are_lost_counted_and_replaced(model: Path, tmp_path: Path) -> None:
    store = CorruptingStore(every=5)
    seen: dict = {}
    pipe = pipeline(model, tmp_path, store=store, steps=6, hooks=[lambda ctx: seen.update(ctx=ctx)])
    s = pipe.run()
    assert store.corrupted > 0
    # each lost group's own prompt went back to the producer: redone, or still queued when the run ended
    assert pipe.producer.stats.get("redone", 0) + seen["ctx"].feedback.depth == store.corrupted
    assert s["samples"]["lost"] == store.corrupted * 4  # every sample of each corrupt group
    assert s["version"] == 6, "lost groups were replaced and the run finished"
    assert s["samples"]["trained"] == 6 * 4 * 4
    lost = [r for r in ledger_of(s) if r["fate"] == "lost"]
    assert all("CorruptPayload" in r["reason"] for r in lost)
    assert sum(s["reasons"]["lost"].values()) == len(lost) and all("CorruptPayload" in r for r in s["reasons"]["lost"])
    assert s["ledger_balanced"]


def test_channel_closed_mid_run_is_a_clear_error(model: Path, tmp_path: Path) -> None:
    class CloseReadyAtVersion2(BaseActor):
        name = "closer"

        def __init__(self, ctx) -> None:
            self.ctx = ctx

        async def run(self) -> None:
            await self.ctx.clock.wait_until(2)
            self.ctx.channels["ready"].close()

    pipe = pipeline(model, tmp_path, steps=50, hooks=[lambda ctx: [CloseReadyAtVersion2(ctx)]])
    with pytest.raises(ActorFailed) as err:
        pipe.run()
    assert "channel 'ready'" in str(err.value) and "closed" in str(err.value)
    assert err.value.actor in ("buffer", "learner")
    runs = list(Path(tmp_path).glob("t-*"))
    records = json.loads((runs[0] / "ledger.json").read_text())
    fates = {r["fate"] for r in records}
    assert fates <= {"trained", "in_flight", "dropped"}
    assert any(r["fate"] == "trained" for r in records)
