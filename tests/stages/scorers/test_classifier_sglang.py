"""ClassifierReward on a real SGLang server (one per module, `--is-embedding`): its scores equal the transformers
forward of the same folder, and a server killed mid-run is restarted with nothing lost or trained twice.

Skipped, with the reason, only when no SGLang environment exists (tools/sglang-cpu/install.sh makes one).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import anyio
import numpy as np
import pytest
import torch

from buffers import MemoryStore, RefBuffer
from pipeline import Pipeline
from pipeline.events import EVENTS_FILE
from pipeline.watchdog import WatchdogSettings
from policies import MaxStaleness
from stages import GRPOLearner, Rollout, TorchEngine
from stages.data.model import make_tiny_model
from stages.data.rewards import Sample
from stages.data.tasks import ReverseDigits
from stages.scorers import ClassifierReward, ComposedReward, ServerSettings
from tests.helpers.engines import SGLANG_SERVER_MODULE
from tests.helpers.ledger_checks import check_ledger
from tests.helpers.scorers import make_tiny_classifier

pytestmark = SGLANG_SERVER_MODULE

# float32 on both sides; what is left is the order of float sums in two attention and matmul implementations
# (SGLang's torch_native backend over a flat token batch, transformers' sdpa over [1, T]): 3e-8 measured on
# these samples (2026-12-03). The two differences this test found were 0.038 (the head's random bias) and 0.07
# (the pooled position), five orders of magnitude above the tolerance.
TOLERANCE = 1e-6

SAMPLES = [
    Sample(prompt="12>", completion="21", tokens=[], answer="21"),
    Sample(prompt="1234>", completion="4321", tokens=[], answer="4321"),
    Sample(prompt="", completion="7", tokens=[], answer="7", messages=[{"role": "user", "content": "3+4="}]),
    Sample(prompt="56>", completion="65<|endoftext|>", tokens=[], answer="65"),  # ends in the pad token
    Sample(prompt="9876543210>", completion="0123456789", tokens=[], answer="0123456789"),
]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    return make_tiny_classifier(tmp_path_factory.mktemp("classifier") / "rm")


@pytest.fixture(scope="module")
async def classifier(folder, tmp_path_factory):
    scorer = ClassifierReward(ServerSettings(folder, timeout_s=60))
    await scorer.start(tmp_path_factory.mktemp("classifier-logs"))
    yield scorer
    pid = scorer.server.server.pid
    await scorer.stop()
    with pytest.raises(ProcessLookupError):  # the whole process group baton launched is gone
        os.killpg(pid, 0)


def transformers_scores(folder: Path, scorer: ClassifierReward, samples: list[Sample]) -> list[float]:
    """AutoModelForSequenceClassification on the rendered ids, pad tokens and all (it pools past them)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    scores = []
    for sample in samples:
        messages = sample.messages or [{"role": "user", "content": sample.prompt}]
        text = scorer.tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": sample.completion}],
                                                    tokenize=False)
        ids = scorer.tokenizer.encode(text, add_special_tokens=False)
        with torch.no_grad():
            scores.append(float(model(torch.tensor([ids])).logits[0, 0]))
    return scores


async def check_parity(scorer: ClassifierReward, folder: Path) -> float:
    scores = await scorer.score(SAMPLES)
    assert scores.failures == [None] * len(SAMPLES)
    reference = transformers_scores(folder, scorer, SAMPLES)
    assert len(set(np.round(reference, 3))) == len(SAMPLES), "distinct inputs should score apart"
    diff = float(np.abs(np.asarray(scores.rewards) - np.asarray(reference)).max())
    assert diff < TOLERANCE, (scores.rewards, reference)
    return diff


async def test_scores_equal_the_transformers_forward(classifier, folder) -> None:
    assert scorer_pads(classifier)
    diff = await check_parity(classifier, folder)
    print(f"largest difference from transformers: {diff:.2e}")  # shown with -rP


def scorer_pads(scorer: ClassifierReward) -> bool:
    """The pad sample renders to ids ending in the pad token, which the request leaves out."""
    text = scorer.tokenizer.apply_chat_template([{"role": "user", "content": "56>"},
                                                 {"role": "assistant", "content": "65<|endoftext|>"}], tokenize=False)
    ids = scorer.tokenizer.encode(text, add_special_tokens=False)
    return ids[-1] == scorer.pad_id and scorer.render(SAMPLES[3]) == ids[:-1]


async def test_a_killed_server_is_restarted_mid_run_and_nothing_is_lost(classifier, folder, tmp_path) -> None:
    student = make_tiny_model(tmp_path / "student")
    reward = ComposedReward(None, [(classifier, 1.0)])
    pipe = Pipeline(
        name="classifier-kill", steps=6, run_root=tmp_path, progress=False,
        producer=Rollout(ReverseDigits(digits=2), [TorchEngine(student)], tokenizer=student, group_size=4,
                         batch_groups=2, reward=reward),
        buffer=RefBuffer(MemoryStore()), consumer=GRPOLearner(student, groups_per_step=2),
        staleness=MaxStaleness(k=2), watchdog=WatchdogSettings(warn_after_s=60, fail_after_s=600),
    )
    killed = anyio.Event()

    async def kill_after_some_groups() -> None:
        while classifier.stats.get("calls", 0) < 4:
            await anyio.sleep(0.05)
        await anyio.to_thread.run_sync(classifier.server.server.kill)
        killed.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(kill_after_some_groups)
        summary = await pipe.arun()
        tg.cancel_scope.cancel()
    assert killed.is_set(), "the run ended before the server was killed"
    assert summary["version"] == 6 and summary["ledger_balanced"], summary
    check_ledger(Path(summary["run_dir"]), bound=2)
    assert classifier.stats["restarts"] == 1
    assert "reward_failed" not in pipe.producer.stats, pipe.producer.stats  # the requests in flight were sent again
    events = [json.loads(line) for line in (classifier.server.log_dir / EVENTS_FILE).read_text().splitlines()]
    assert [e["kind"] for e in events] == ["scorer.restarted"]
    metrics = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert all(m["scoring_s"] > 0 for m in metrics)


async def test_scores_still_equal_transformers_after_the_restart(classifier, folder) -> None:
    """The restarted server loads the serving folder again: no new random bias (SGLang draws a new one per start)."""
    assert classifier.stats["restarts"] == 1
    await check_parity(classifier, folder)
