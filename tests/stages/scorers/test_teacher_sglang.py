"""Teachers and judges on a real SGLang server (one per module, the tiny causal model): the teacher's input
logprobs equal the model's own forward over the same ids, on every turn of multi-turn rows; the judge asks the
same server's OpenAI endpoint and reads (or fails to read, counted) a grade from a random model's answers.

Skipped, with the reason, only when no SGLang environment exists (tools/sglang-cpu/install.sh makes one).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stages.data.model import load_model, make_tiny_model
from stages.data.rewards import Sample
from stages.scorers import Distillation, JudgeReward, ServerSettings, SGLangTeacher
from tests.helpers.engines import SGLANG_SERVER_MODULE
from tests.helpers.scorers import multi_turn_row, reference_logprobs
from tests.stages.scorers.test_teacher import ROWS

pytestmark = SGLANG_SERVER_MODULE

# float32 on both sides, two implementations of the same forward (SGLang's torch_native attention over a flat
# token batch, transformers' over [1, T]): 4.8e-7 measured on these rows (2026-12-03)
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    return make_tiny_model(tmp_path_factory.mktemp("teacher") / "t", seed=5)


@pytest.fixture(scope="module")
async def teacher(folder, tmp_path_factory):
    scorer = SGLangTeacher(ServerSettings(folder, timeout_s=60))
    await scorer.start(tmp_path_factory.mktemp("teacher-logs"))
    yield scorer
    await scorer.stop()


async def test_input_logprobs_equal_the_models_forward_on_every_turn(teacher, folder) -> None:
    model = load_model(folder).eval()
    distillation = Distillation({"teacher": teacher})
    rows = [multi_turn_row(*row) for row in ROWS]
    values, failure = await distillation.score(None, rows)
    assert failure is None
    largest = 0.0
    for row, scored in zip(rows, values, strict=True):
        mask = row["loss_mask"].astype(bool)
        assert not scored[~mask].any()
        expected = np.concatenate([[0.0], reference_logprobs(model, row["tokens"].tolist())])
        largest = max(largest, float(np.abs(scored[mask] - expected[mask]).max()))
    assert largest < TOLERANCE
    print(f"largest difference from the model's forward: {largest:.2e}")  # shown with -rP


async def test_a_judge_on_the_servers_openai_endpoint(teacher, folder) -> None:
    """The tiny model answers with random characters: each sample is graded or fails as unparsed, and every
    unreadable answer is counted."""
    judge = JudgeReward(ServerSettings(url=teacher.server.base_url), model_name=str(folder), template="{completion}>",
                        max_score=9, max_tokens=3, temperature=1.0, parse_retries=1)
    await judge.start()
    try:
        scores = await judge.score([Sample(prompt="", completion=c, tokens=[], answer="") for c in ("12", "345")])
    finally:
        await judge.stop()
    assert judge.stats["calls"] == 2
    for value, failure in zip(scores.rewards, scores.failures, strict=True):
        assert (failure is None and 0 <= value <= 1) or (failure == "judge unparsed" and value == 0.0)
    unreadable = sum(f is not None for f in scores.failures)
    assert judge.stats["parse_failures"] >= 2 * unreadable  # each failed sample was asked twice
