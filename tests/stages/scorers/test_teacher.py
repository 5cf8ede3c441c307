"""Teachers: their per-token logprobs equal the teacher model's own forward over the same ids, aligned to the
codec row (the model tokens of every turn; 0 at prompt and environment tokens), and several teachers picked
by a sample field."""

from __future__ import annotations

from pathlib import Path

import anyio
import numpy as np
import pytest
import torch

from stages.data.model import load_model, make_tiny_model
from stages.scorers import Distillation, TorchTeacher
from stages.scorers.teacher import aligned, forward_logprobs
from tests.helpers.scorers import multi_turn_row, reference_logprobs

torch.set_num_threads(1)

ROWS = [  # prompt ids, model turns, environment replies (the tiny vocabulary: ids 3..)
    ([1, 6, 7, 20], [[8, 9, 2]], []),
    ([1, 5, 21], [[10, 11], [12, 13, 14, 2]], [[1, 15, 16]]),
    ([1, 5, 6, 7, 8, 9, 21], [[4, 4], [30, 2], [31]], [[1, 17], [1, 18, 19, 3]]),
]


@pytest.fixture(scope="module")
def teacher_folder(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("teacher") / "t", seed=3)


def test_forward_logprobs_equal_the_models_own_forward_of_each_sequence(teacher_folder: Path) -> None:
    model = load_model(teacher_folder).eval()
    sequences = [multi_turn_row(*row)["tokens"].tolist() for row in ROWS]
    batched = forward_logprobs(model, sequences)  # one forward, rows padded on the right
    for ids, values in zip(sequences, batched, strict=True):
        assert values.shape == (len(ids) - 1,)
        np.testing.assert_allclose(values, reference_logprobs(model, ids), atol=1e-5)


@pytest.mark.anyio
async def test_teacher_logprobs_sit_on_the_model_tokens_of_every_turn(teacher_folder: Path) -> None:
    model = load_model(teacher_folder).eval()
    distillation = Distillation({"teacher": TorchTeacher(teacher_folder)})
    await distillation.start()
    rows = [multi_turn_row(*row) for row in ROWS]
    values, failure = await distillation.score(None, rows)
    assert failure is None
    for row, teacher in zip(rows, values, strict=True):
        mask = row["loss_mask"].astype(bool)
        assert teacher.dtype == np.float32 and teacher.shape == row["tokens"].shape
        assert not teacher[~mask].any(), "0 at prompt and environment tokens, as logprobs"
        expected = np.concatenate([[0.0], reference_logprobs(model, row["tokens"].tolist())])
        np.testing.assert_allclose(teacher[mask], expected[mask], atol=1e-5)
        assert (teacher[mask] < 0).all()
    assert distillation.stats["calls"] == 1 and "failures" not in distillation.stats


@pytest.mark.anyio
async def test_the_sample_field_picks_its_teacher(teacher_folder: Path, tmp_path: Path) -> None:
    other = make_tiny_model(tmp_path / "other", seed=4)
    distillation = Distillation({"math": TorchTeacher(teacher_folder), "code": TorchTeacher(other)}, key="domain")
    await distillation.start()
    row = multi_turn_row(*ROWS[1])
    math, _ = await distillation.score({"domain": "math"}, [row])
    code, _ = await distillation.score({"domain": "code"}, [row])
    mask = row["loss_mask"].astype(bool)
    expected = np.concatenate([[0.0], reference_logprobs(load_model(other).eval(), row["tokens"].tolist())])
    np.testing.assert_allclose(code[0][mask], expected[mask], atol=1e-5)
    assert np.abs(math[0][mask] - code[0][mask]).max() > 1e-3, "two teachers, two answers"
    stand_in, failure = await distillation.score({"domain": "poetry"}, [row])
    assert failure == "teacher no teacher"
    np.testing.assert_array_equal(stand_in[0], row["logprobs"])  # the student's own: a log-ratio of 0
    assert distillation.stats["failures"] == {"teacher no teacher": 1}


def test_several_teachers_need_a_key_and_rows_must_fit(teacher_folder: Path) -> None:
    with pytest.raises(ValueError, match="teacher_key"):
        Distillation({"a": TorchTeacher(teacher_folder), "b": TorchTeacher(teacher_folder)})
    with pytest.raises(ValueError, match="on_error"):
        Distillation({"a": TorchTeacher(teacher_folder)}, on_error="retry")
    row = multi_turn_row(*ROWS[0])
    with pytest.raises(Exception, match="logprobs for a row of"):
        aligned(row, np.zeros(3, np.float32))


@pytest.mark.anyio
async def test_groups_that_ask_together_share_forwards_and_each_gets_its_own_rows(teacher_folder: Path) -> None:
    model = load_model(teacher_folder).eval()
    teacher = TorchTeacher(teacher_folder, max_batch_rows=6)
    await teacher.start()
    groups = [[multi_turn_row(*row)["tokens"].tolist() for row in ROWS][: 1 + g % 3] for g in range(8)]
    answers: dict[int, list[np.ndarray]] = {}

    async def ask(g: int) -> None:
        answers[g] = await teacher.logprobs(groups[g])

    async with anyio.create_task_group() as tg:
        for g in range(len(groups)):
            tg.start_soon(ask, g)
    for g, sequences in enumerate(groups):
        assert len(answers[g]) == len(sequences)
        for ids, values in zip(sequences, answers[g], strict=True):
            np.testing.assert_allclose(values, reference_logprobs(model, ids), atol=1e-5)
    rows = sum(len(s) for s in groups)
    assert teacher.stats["forward_rows"] == rows
    assert teacher.stats["forwards"] < len(groups), "groups waiting on a forward go together in the next"
    assert teacher.stats["forwards"] >= rows / 6, "no forward takes more than max_batch_rows"


@pytest.mark.anyio
async def test_a_failed_forward_fails_every_group_that_shared_it(teacher_folder: Path, monkeypatch) -> None:
    teacher = TorchTeacher(teacher_folder)
    await teacher.start()
    monkeypatch.setattr("stages.scorers.teacher.forward_logprobs", lambda *a: (_ for _ in ()).throw(
        RuntimeError("out of memory")))
    failures = []

    async def ask() -> None:
        try:
            await teacher.logprobs([[1, 5, 6, 7]])
        except RuntimeError as exc:
            failures.append(str(exc))

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(ask)
    assert failures == ["out of memory"] * 3


@pytest.mark.anyio
async def test_a_caller_cancelled_while_it_waits_leaves_nothing_behind(teacher_folder: Path) -> None:
    teacher = TorchTeacher(teacher_folder)
    await teacher.start()
    held, release = anyio.Event(), anyio.Event()

    async def forward_in_progress() -> None:
        async with teacher._lock:
            held.set()
            await release.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(forward_in_progress)
        await held.wait()
        with anyio.move_on_after(0.05):
            await teacher.logprobs([[1, 5, 6, 7]])
        assert teacher._pending == []
        release.set()
    assert len(await teacher.logprobs([[1, 5, 6, 7]])) == 1
    assert teacher.stats["forwards"] == 1, "the cancelled caller's rows were never computed"
