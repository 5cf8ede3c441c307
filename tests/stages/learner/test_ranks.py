"""A learner of two ranks is the learner of one: real processes on one gloo group (FSDP2 on CPU).

One group of two ranks serves the module (spawning a rank costs ~10 s of imports): this test process is
rank 0, a spawned process rank 1. On it: five steps on the same groups equal five steps of one rank;
its checkpoint (DCP shards) loads into one rank and one rank's into it; a rank SIGKILLed mid-run fails
the learner naming the rank. (The split of groups over ranks: tests/policies/test_balance.py.)"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from buffers.codec import RolloutBatch
from stages.data.model import make_tiny_model
from stages.learner import GRPOLearner
from stages.learner.ranks import LearnerRankFailed, RankedTrainer
from stages.learner.step import PolicyTrainer, plan_step
from tests.helpers.learner_ranks import ranked_trainer

torch.set_num_threads(1)
STEPS = 5


def groups(seed: int, n: int = 6, group_size: int = 4, vocab: int = 40) -> list[RolloutBatch]:
    """`n` groups of rows of different lengths (prompt then completion), random rewards and logprobs."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        rows = []
        for _ in range(group_size):
            prompt, completion = int(rng.integers(2, 6)), int(rng.integers(1, 9))
            rows.append({"tokens": rng.integers(0, vocab, prompt + completion).astype(np.int32),
                         "logprobs": np.r_[np.zeros(prompt), -rng.random(completion) * 3].astype(np.float32),
                         "loss_mask": np.r_[np.zeros(prompt), np.ones(completion)].astype(np.uint8),
                         "token_versions": np.r_[np.full(prompt, -1), np.zeros(completion)].astype(np.int32)})
        fields = {"rewards": rng.random(group_size).astype(np.float32),
                  "prompt_lens": np.zeros(group_size, np.int32), "versions": np.zeros((group_size, 2), np.int32),
                  "turns": np.ones(group_size, np.int32)}
        out.append(RolloutBatch.from_rows(rows, row_fields=fields, meta={}))
    return out


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> GRPOLearner:
    model = make_tiny_model(tmp_path_factory.mktemp("model"))
    # a large lr and micro-batches: differences between the layouts would show within five steps
    return GRPOLearner(model, lr=1e-2, device="cpu", micro_batch_tokens=24)


@pytest.fixture(scope="module")
def two_ranks(spec: GRPOLearner):
    with ranked_trainer(spec) as trainer:
        yield trainer


def full(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.weights().items()}


def test_two_ranks_step_as_one(spec: GRPOLearner, two_ranks: RankedTrainer) -> None:
    one = PolicyTrainer(spec, 100)
    one.schedule(0)
    for step in range(STEPS):
        batches = groups(step)
        a, b = one.train(batches, 1.0), two_ranks.train(batches, 1.0)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    single, sharded = full(one), full(two_ranks)
    assert single.keys() == sharded.keys()
    diff = max(float((single[k] - sharded[k]).abs().max()) for k in single)
    assert diff <= 1e-5, diff
    assert any(float((single[k] - full(PolicyTrainer(spec, 1))[k]).abs().max()) > 1e-3 for k in single), "it trained"


def assert_same(a, b, tolerance: float = 1e-5) -> None:
    left, right = full(a), full(b)
    assert left.keys() == right.keys()
    assert max(float((left[k] - right[k]).abs().max()) for k in left) <= tolerance


def test_checkpoints_load_at_another_world_size(spec: GRPOLearner, two_ranks: RankedTrainer, tmp_path: Path) -> None:
    """2 -> 1 and 1 -> 2: the weights load exactly, and the next step on the same groups agrees, which it
    does only if the optimizer's moments and step count came along."""
    two_ranks.train(groups(10), 0.0)
    (tmp_path / "two").mkdir()
    two_ranks.write_state(tmp_path / "two", version=7)
    one = PolicyTrainer(spec, 100)
    assert one.read_state(tmp_path / "two") == 7
    assert_same(one, two_ranks, tolerance=0.0)
    one.schedule(7)
    two_ranks.schedule(7)
    one.train(groups(11), 0.0)
    two_ranks.train(groups(11), 0.0)
    assert_same(one, two_ranks)

    fresh = PolicyTrainer(spec, 100)
    fresh.schedule(0)
    fresh.train(groups(12), 0.0)
    (tmp_path / "one").mkdir()
    fresh.write_state(tmp_path / "one", version=8)
    assert two_ranks.read_state(tmp_path / "one") == 8
    assert_same(fresh, two_ranks, tolerance=0.0)
    fresh.schedule(8)
    two_ranks.schedule(8)
    fresh.train(groups(13), 0.0)
    two_ranks.train(groups(13), 0.0)
    assert_same(fresh, two_ranks)


def test_the_plan_counts_over_every_rank() -> None:
    batches = groups(0)
    whole = plan_step([batches], 2.0, None)
    split = plan_step([batches[:2], batches[2:]], 2.0, 24)
    assert (split.tokens, split.rows, split.width) == (whole.tokens, whole.rows, whole.width)
    assert whole.tokens == sum(int(b.token_fields["loss_mask"].sum()) for b in batches)
    assert whole.micro_batches == 1 and split.micro_batches > 1


def test_every_rank_pushes_its_own_rows_into_the_engine(spec: GRPOLearner, two_ranks: RankedTrainer) -> None:
    """mooncake_p2p from the shards: the engine ends up with exactly the learner's weights, no rank having
    gathered them; bytes of rank 1's rows damaged in flight refuse the version, and the engine keeps its own."""
    import anyio

    from stages.engines.torch import TorchEngine
    from stages.weights.base import WeightPushError
    from stages.weights.mooncake_p2p import MooncakeP2PTransport

    async def scenario() -> None:
        engine = TorchEngine(spec.model_path)
        await engine.start()
        transport = MooncakeP2PTransport(bucket_bytes=1 << 16)
        transport.subscribe(engine)
        two_ranks.train(groups(20), 0.0)
        await transport.publish_shards(1, two_ranks)
        assert engine.version == 1
        learner = full(two_ranks)
        live = {n: p.detach() for n, p in engine._model.named_parameters()}
        assert all(torch.equal(live[n], learner[n]) for n in live), "the engine holds the learner's weights"
        assert transport.stats["copied"] == 0, "written from the ranks' own shards"

        def damage(layout, attempt):  # the last bytes of the first tensor: rows that rank 1 holds
            entry = next(e for e in layout.tensors if e.shape[0] >= 2)
            return entry.offset + entry.nbytes - 8, b"\xff" * 8

        transport.damage = damage
        two_ranks.train(groups(21), 0.0)
        with pytest.raises(WeightPushError, match="learner ranks \\[1\\] fail their checksum"):
            await transport.publish_shards(2, two_ranks)
        assert engine.version == 1
        assert all(torch.equal(p.detach(), live[n]) for n, p in engine._model.named_parameters())
        await transport.close()
        await engine.stop()

    anyio.run(scenario)


def test_a_killed_rank_fails_the_learner(spec: GRPOLearner, two_ranks: RankedTrainer) -> None:
    """Last in this module: it ends the shared group's rank 1, named by its rank wherever it is named."""
    follower = two_ranks.group.helpers[0]
    assert two_ranks.group.names == ["learner-rank-0", "learner-rank-1"] and follower.name == "learner-rank-1"
    os.kill(follower.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while follower.exitcode() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    killed = r"learner rank 1 \(learner-rank-1\) exited with code -9 \(killed by SIGKILL\)"
    with pytest.raises(LearnerRankFailed, match=killed):
        two_ranks.group.check()
