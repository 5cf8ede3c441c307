"""Evaluation during training: the first rollout worker generates the eval split when its engine reaches
a due version, scores it with the rollout's reward, and records the metrics tagged with the weight
version of the tokens; an engine failure skips one evaluation and the run goes on."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline.telemetry import RunFolder
from stages.data.datasets import DatasetTask
from stages.data.model import make_tiny_model
from stages.data.tasks import ReverseDigits
from stages.engines.base import EngineError
from stages.engines.torch import TorchEngine
from stages.rollout import Rollout
from stages.rollout.evaluation import EVAL_FILE, Evaluation
from tests.helpers.workers import Recorder, worker_for

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_settings_and_record() -> None:
    with pytest.raises(ValueError, match="every"):
        Evaluation(ReverseDigits(), every=0)
    with pytest.raises(ValueError, match="samples"):
        Evaluation(ReverseDigits(), samples=0)
    evaluation = Evaluation(ReverseDigits(), every=5, sample_prompts=7)
    assert evaluation.prompt_list() == evaluation.prompt_list() and len(evaluation.prompt_list()) == 7
    assert [evaluation.next_due(v) for v in (0, 4, 5, 12)] == [5, 5, 10, 15]
    record = evaluation.record([np.array([3, 4]), np.array([], np.int32)], [1.0, 0.5], 0.25, fallback_version=9)
    assert record == {"version": 3, "version_max": 4, "eval/n": 2, "eval/reward_mean": 0.75, "eval/pass_rate": 0.5,
                      "eval/length_mean": 1.0, "eval/s": 0.25}


@pytest.mark.anyio
async def test_the_eval_split_is_generated_at_due_versions(tiny: Path, tmp_path: Path) -> None:
    rows = [{"q": f"{i}{i}>", "a": f"{i}{i}"} for i in range(6)]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = DatasetTask(tmp_path / "train.jsonl", prompt_field="q", answer_field="a", chat=False, max_new_tokens=2,
                       eval_path=tmp_path / "eval.jsonl")
    engine = TorchEngine(tiny)
    await engine.start()
    rollout = Rollout(task, [engine], tokenizer=tiny, group_size=2, evaluation=Evaluation(task.eval_task(), every=3,
                                                                                         samples=2))
    recorder = Recorder()
    worker = worker_for(rollout, engine, None, recorder, tmp_path)
    (tmp_path / "run").mkdir()
    worker.ctx.folder, worker.ctx.started_at = RunFolder(tmp_path / "run"), 0.0
    await worker.evaluator.run_if_due()  # version 0: the baseline
    await worker.evaluator.run_if_due()  # not due again before version 3
    engine._version = 4  # as if weights of version 4 had arrived
    await worker.evaluator.run_if_due()
    lines = [json.loads(line) for line in (tmp_path / "run" / EVAL_FILE).read_text().splitlines()]
    assert [(r["version"], r["version_max"]) for r in lines] == [(0, 0), (4, 4)]
    assert all(r["eval/n"] == 12 for r in lines), "every eval row, `samples` times"
    assert rollout.stats["eval"] == {k: v for k, v in lines[-1].items() if k != "t"}
    assert recorder.sent == [], "evaluations are not training data"

    async def broken(*args, **kwargs):
        raise EngineError("engine down")

    engine.generate = broken
    engine._version = 6
    await worker.evaluator.run_if_due()  # skipped, not raised
    assert len((tmp_path / "run" / EVAL_FILE).read_text().splitlines()) == 2
    assert worker.evaluator._next == 9
    await engine.stop()


@pytest.mark.anyio
async def test_only_the_first_worker_evaluates(tiny: Path, tmp_path: Path) -> None:
    engines = [TorchEngine(tiny, name="a"), TorchEngine(tiny, name="b")]
    rollout = Rollout(ReverseDigits(), engines, tokenizer=tiny, evaluation=Evaluation(ReverseDigits(), every=1))
    ctx = SimpleNamespace(services=SimpleNamespace(weight_receivers=[], producers=(), mailboxes={}, faults=None,
                                                   store=None),
                          folder=SimpleNamespace(path=tmp_path), rng=lambda name: None, log=lambda name: None,
                          policy=None)
    workers = rollout.actors(ctx, None, object())
    assert [w.index for w in workers] == [0, 1]
    assert workers[0].evaluator is not None and workers[1].evaluator is None
