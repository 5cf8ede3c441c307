"""A rollout worker over its real parts (engine, store, run folder) with the run's ledger, gate and outbox
recorded: what tests of the producer's groups and episodes call."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from buffers.codec import decode
from pipeline.contracts import Services
from pipeline.telemetry import RunFolder, get_logger
from stages.rollout import Rollout, RolloutWorker


class Recorder:
    """The parts of a run a rollout worker calls while producing: ledger, gate, outbox."""

    def __init__(self) -> None:
        self.produced, self.finished, self.sent, self.discarded = [], [], [], 0
        self.events: list[tuple[str, int]] = []

    def event(self, kind: str, count: int = 1, **fields) -> None:
        self.events.append((kind, count))

    async def produced_(self, records) -> None:
        self.produced += records

    async def finished_(self, fate, ids, reason) -> None:
        self.finished.append((fate, ids, reason))

    async def discard(self, units: int) -> None:
        self.discarded += units

    async def send_many(self, refs) -> None:
        self.sent += refs


def worker_for(rollout: Rollout, engine, store, recorder: Recorder, tmp_path: Path) -> RolloutWorker:
    ctx = SimpleNamespace(
        run="own", folder=RunFolder(tmp_path), started_at=0.0, rng=lambda name: np.random.default_rng(0),
        log=get_logger, services=Services(), resume=None, policy=None, note=lambda *a: None, event=recorder.event,
        ledger=SimpleNamespace(produced=recorder.produced_, finished=recorder.finished_),
        gate=SimpleNamespace(discard=recorder.discard),
    )
    return rollout.worker(engine, store, ctx, recorder)


def chatml_prompt(text: str) -> str:
    """The prompt both chat tests expect: system "Be brief.", the question as the user's turn, then the assistant's."""
    return f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


async def batches_with_their_prompts(store, refs, tok, prompts) -> list[tuple[str, object]]:
    """Pairs each sent batch with the ChatML prompt its first row decodes to. Groups finish in any order,
    so the pairing is by content; every prompt must own exactly one batch."""
    expected = [chatml_prompt(p.text) for p in prompts]
    pairs = []
    for ref in refs:
        batch = decode(await store.get(ref.key))
        first = batch.row(0)
        pairs.append((tok.decode(first["tokens"].tolist()[: int(first["prompt_lens"])]), batch))
    assert sorted(text for text, _ in pairs) == sorted(expected), "one batch per prompt, each prompt exactly"
    return pairs


