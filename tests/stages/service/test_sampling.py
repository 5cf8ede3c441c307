"""`Samplers` with a fully fine-tuned model's saves (`TrainingModel.sampler_weights`: a safetensors file each): an
engine serves exactly the saved weights (its prompt logprobs are the trained model's teacher-forced ones), no more
than `keep` engines, so `keep` full copies, are loaded at once, and a save under a path saved before replaces it
(its engine stopped, its file removed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stages.data.model import make_tiny_model
from stages.service.sampling import Samplers, SamplerSettings
from stages.service.training import AdamSettings, TrainingModel, logprobs_of
from stages.service.wire import Datum

pytestmark = pytest.mark.anyio
PROMPT = [1, 5, 6, 7, 8, 9]


def teacher_forced(model: TrainingModel) -> np.ndarray:
    ids = torch.tensor([PROMPT[:-1]])
    with torch.no_grad():
        return logprobs_of(model.trainer.model, ids, torch.ones_like(ids, dtype=torch.float32),
                           torch.tensor([PROMPT[1:]]))[0].numpy()


async def test_full_saves_are_served_from_their_files_with_at_most_keep_engines(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "tiny")
    model = TrainingModel(folder, None)
    samplers = Samplers(folder, settings=SamplerSettings(keep=1))
    first = model.sampler_weights(tmp_path / "saves" / "0")
    before = teacher_forced(model)
    datum = Datum(np.array(PROMPT[:-1]), {"target_tokens": np.array(PROMPT[1:]), "weights": np.ones(5, np.float32)})
    model.forward_backward([datum], "cross_entropy", {}, backward=True)
    model.optim_step(AdamSettings(learning_rate=1e-2))
    after = teacher_forced(model)
    assert np.abs(after - before).max() > 1e-2  # the two saves differ: serving the wrong one would fail below
    try:
        await samplers.save("a", first)
        await samplers.save("b", model.sampler_weights(tmp_path / "saves" / "1"))
        for path, expected in (("a", before), ("b", after), ("a", before)):
            served = await samplers.prompt_logprobs(path, PROMPT)
            assert np.allclose(served[1:], expected, atol=1e-5), path
            assert list(samplers.engine.engines) == [path]  # the other one was stopped before this one was loaded
        await samplers.save("a", model.sampler_weights(tmp_path / "saves" / "2"))
        assert not Path(first.path).exists() and "a" not in samplers.engine.engines
        assert np.allclose((await samplers.prompt_logprobs("a", PROMPT))[1:], after, atol=1e-5)
    finally:
        await samplers.close()


async def test_an_engine_serving_a_sample_is_not_stopped_under_it(tmp_path: Path) -> None:
    """One engine at most: samples of the base and of a save asked at once. The second waits for the first's
    engine to be free instead of stopping it under its request: both come back whole, and one engine is loaded."""
    import anyio

    folder = make_tiny_model(tmp_path / "tiny")
    model = TrainingModel(folder, None)
    samplers = Samplers(folder, settings=SamplerSettings(keep=1))
    params = {"max_tokens": 48, "temperature": 1.0, "stop": []}
    got: dict[str, list] = {}

    async def draw(path: str) -> None:
        got[path] = await samplers.sample(path, PROMPT, 4, params)

    try:
        await samplers.save("a", model.sampler_weights(tmp_path / "saves" / "0"))
        async with anyio.create_task_group() as tg:
            tg.start_soon(draw, "base")
            await anyio.sleep(0.05)  # the base's engine is serving when the save's is asked for
            tg.start_soon(draw, "a")
        assert {path: [len(tokens) for tokens, _, _ in out] for path, out in got.items()} == {
            "base": [48] * 4, "a": [48] * 4}
        assert list(samplers.engine.engines) == ["a"]
    finally:
        await samplers.close()


def test_the_cut_at_stop_strings_keeps_the_tokens_up_to_the_first_stop() -> None:
    """Tokens decoding to one character each ("a".."z"): the cut keeps up to the token completing the earliest stop
    of several, a stop split across tokens included; no stop in the text: no cut."""
    from stages.service.sampling import cut_at_stop_strings

    def decode(ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)

    tokens = np.array([0, 1, 2, 3, 4, 5])  # "abcdef"
    assert cut_at_stop_strings(tokens, ["cd"], decode) == 4
    assert cut_at_stop_strings(tokens, ["ef", "b"], decode) == 2
    assert cut_at_stop_strings(tokens, ["a"], decode) == 1
    assert cut_at_stop_strings(tokens, ["zz"], decode) is None
