"""Model scoring inside the producer: a group is scored after its episodes gave their engine room back (scoring
never holds an engine slot), rule and model rewards compose, and the teacher's logprobs travel in the batch."""

from __future__ import annotations

from pathlib import Path
from random import Random

import anyio
import numpy as np
import pytest
import torch

from buffers import MemoryStore
from buffers.codec import decode
from stages.data.model import decode_many, make_tiny_model
from stages.data.rewards import RewardFunction, Scores
from stages.data.tasks import ReverseDigits
from stages.engines.torch import TorchEngine
from stages.rollout import Rollout
from stages.scorers import ComposedReward, Distillation, TorchTeacher
from tests.helpers.workers import Recorder, worker_for

pytestmark = pytest.mark.anyio
torch.set_num_threads(1)


class HeldScorer:
    """A model reward whose answers wait until the test releases them (a unit fake: the logic of when
    scoring happens, not what it computes); scores each sample by its completion's length."""

    name = "held"

    def __init__(self, fail: str | None = None) -> None:
        self.stats: dict = {}
        self.waiting = 0
        self.release = anyio.Event()
        self.fail = fail

    async def start(self, log_dir: Path | None = None) -> None: ...

    async def stop(self) -> None: ...

    async def score(self, samples) -> Scores:
        self.waiting += 1
        await self.release.wait()
        return Scores([float(len(s.completion)) for s in samples], [self.fail] * len(samples))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


async def test_scoring_holds_no_engine_room_and_composes_with_rule_rewards(tiny: Path, tmp_path: Path) -> None:
    task, engine, held = ReverseDigits(digits=2), TorchEngine(tiny, seed=1), HeldScorer()
    await engine.start()
    reward = ComposedReward(RewardFunction(lambda completion: 0.25), [(held, 2.0)])
    rollout = Rollout(task, [engine], tokenizer=tiny, group_size=4, batch_groups=2, reward=reward)
    store, recorder = MemoryStore(), Recorder()
    worker = worker_for(rollout, engine, store, recorder, tmp_path)
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.produce, [task.sample(Random(s)) for s in range(2)])
        with anyio.fail_after(30):
            while held.waiting < 2:
                await anyio.sleep(0.01)
        assert worker.room.free == 2 * 4, "both groups are being scored and hold no episode room"
        assert not recorder.sent
        held.release.set()
    assert len(recorder.sent) == 2
    for ref in recorder.sent:
        batch = decode(await store.get(ref.key))
        completions = decode_many(rollout.tokenizer, [batch.row(i)["tokens"][int(batch.row_fields["prompt_lens"][i]):]
                                                      .tolist() for i in range(batch.rows)])
        np.testing.assert_allclose(batch.row_fields["rewards"], [0.25 + 2.0 * len(c) for c in completions], rtol=1e-6)
        assert (batch.row_fields["scoring_s"] > 0).all(), "each row carries its group's scoring seconds"
    await engine.stop()


async def test_a_failing_model_reward_is_counted_like_a_reward_function(tiny: Path, tmp_path: Path) -> None:
    task, engine = ReverseDigits(digits=2), TorchEngine(tiny, seed=1)
    await engine.start()
    held = HeldScorer(fail="held timeout")
    held.release.set()
    rollout = Rollout(task, [engine], tokenizer=tiny, group_size=4, batch_groups=2,
                      reward=ComposedReward(None, [(held, 1.0)], on_error="drop"))
    store, recorder = MemoryStore(), Recorder()
    await worker_for(rollout, engine, store, recorder, tmp_path).produce([task.sample(Random(0))])
    assert rollout.stats["reward_failed"] == {"held timeout": 4}
    assert recorder.events == [("reward.failed", 4)]
    assert [(fate, reason) for fate, _, reason in recorder.finished] == [("dropped", "reward failed")]
    await engine.stop()


@pytest.mark.parametrize("on_error", ["zero", "drop"])
async def test_teacher_logprobs_travel_in_the_batch(tiny: Path, tmp_path: Path, on_error: str) -> None:
    """The teacher is the student's own starting weights: its logprobs equal the behaviour ones. A teacher
    that cannot score a sample (no teacher named by its field) fails its group, counted."""
    task, engine = ReverseDigits(digits=2), TorchEngine(tiny, seed=1)
    await engine.start()
    teachers = {"reverse": TorchTeacher(tiny)}
    rollout = Rollout(task, [engine], tokenizer=tiny, group_size=4, batch_groups=2,
                      teacher=Distillation(teachers, key="kind" if on_error == "drop" else None, on_error=on_error))
    await rollout.teacher.start()
    store, recorder = MemoryStore(), Recorder()
    prompts = [task.sample(Random(s)) for s in range(2)]
    await worker_for(rollout, engine, store, recorder, tmp_path).produce(prompts)
    if on_error == "drop":  # reverse-digits samples carry no "kind" field: no teacher for them
        assert rollout.stats["teacher_failed"] == {"teacher no teacher": 2}
        assert [reason for _, _, reason in recorder.finished] == ["teacher failed"] * 2
        assert ("teacher.failed", 4) in recorder.events and not recorder.sent
        return
    assert len(recorder.sent) == 2 and "teacher_failed" not in rollout.stats
    for ref in recorder.sent:
        batch = decode(await store.get(ref.key))
        mask = batch.token_fields["loss_mask"].astype(bool)
        teacher = batch.token_fields["teacher_logprobs"]
        assert not teacher[~mask].any()
        np.testing.assert_allclose(teacher[mask], batch.token_fields["logprobs"][mask], atol=1e-4)
    await engine.stop()
