"""The version fence of a joining engine (`stages.rollout.fence`): a real torch engine, the learner's weight
snapshot in a real memory store, the run's clock."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from buffers.memory import MemoryStore
from pipeline.context import LocalClock
from pipeline.versions import VersionClock
from stages.data.model import load_model, make_tiny_model
from stages.engines.torch import TorchEngine
from stages.rollout.fence import FenceError, pass_fence
from stages.weights.layout import state_checksum
from stages.weights.snapshot import save_snapshot

pytestmark = pytest.mark.anyio
torch.set_num_threads(1)
KEY = "run/weights/run-1"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("fence") / "tiny")


def trained(folder: Path) -> dict[str, torch.Tensor]:
    """What a learner would have published: the model's weights, moved away from the folder's."""
    model = load_model(folder, "float32")
    return {name: t.detach() + 0.01 for name, t in model.state_dict().items()}


def context(version: int) -> SimpleNamespace:
    clock = VersionClock()
    clock.advance(version)
    return SimpleNamespace(clock=LocalClock(clock))


class Tampering(TorchEngine):
    """An engine that alters what it is sent (what the fence must catch)."""

    async def receive_weights(self, version, tensors):
        tensors = {n: t + 1.0 if n.endswith("norm.weight") else t for n, t in tensors.items()}
        await super().receive_weights(version, tensors)


async def test_a_joiner_passes_on_the_snapshot_and_holds_the_learners_weights(folder: Path) -> None:
    store, weights = MemoryStore(), trained(folder)
    await save_snapshot(store, KEY, 3, weights)
    engine = TorchEngine(folder, name="torch-7")
    await engine.start()
    try:
        fenced = await pass_fence(engine, context(3), store, KEY, timeout_s=10)
        assert (fenced.version, fenced.source) == (3, "snapshot") and engine.version == 3
        assert fenced.checksum == state_checksum(weights) == engine.weights_checksums(weights)[0]
    finally:
        await engine.stop()


async def test_a_joiner_whose_weights_are_not_the_learners_fails_its_fence(folder: Path) -> None:
    store = MemoryStore()
    await save_snapshot(store, KEY, 2, trained(folder))
    engine = Tampering(folder, name="torch-8")
    await engine.start()
    try:
        with pytest.raises(FenceError, match="not the learner's"):
            await pass_fence(engine, context(2), store, KEY, timeout_s=10)
    finally:
        await engine.stop()


async def test_a_joiner_that_cannot_reach_the_clocks_version_fails_after_its_timeout(folder: Path) -> None:
    store = MemoryStore()
    await save_snapshot(store, KEY, 4, trained(folder))  # the clock is at 5 and nothing pushes version 5
    engine = TorchEngine(folder, name="torch-9")
    await engine.start()
    try:
        with pytest.raises(FenceError, match="not the run's 5"):
            await pass_fence(engine, context(5), store, KEY, timeout_s=0.3)
        assert engine.version == 4, "it took the snapshot, then waited for a push that never came"
    finally:
        await engine.stop()


async def test_at_version_0_the_model_folder_is_the_version(folder: Path) -> None:
    engine = TorchEngine(folder, name="torch-10")
    await engine.start()
    try:
        fenced = await pass_fence(engine, context(0), MemoryStore(), KEY, timeout_s=1)
        assert (fenced.version, fenced.source, fenced.checksum) == (0, "model", None)
    finally:
        await engine.stop()
