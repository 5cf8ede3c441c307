"""The Qwen2-shaped chat checkpoint of the math example on a real SGLang server (CPU): chat prompts
through the rollout, recorded tokens that decode to the ChatML prompt and the completion, generation
that never runs past a stop token. Skipped, with the reason, when no SGLang environment exists."""

from __future__ import annotations

import pytest
import torch

from buffers.memory import MemoryStore
from stages.data.datasets import DatasetTask
from stages.data.model import load_tokenizer
from stages.engines.sglang import SGLangEngine
from stages.engines.sglang_server import SGLangUnavailable, sglang_python
from stages.rollout import Rollout
from tests.helpers.workers import Recorder, batches_with_their_prompts, worker_for
from tools.make_math_example import make_math_data, make_qwen_like_model

try:
    sglang_python()
    _MISSING = ""
except SGLangUnavailable as exc:
    _MISSING = str(exc)

pytestmark = [pytest.mark.anyio, pytest.mark.sglang, pytest.mark.slow, pytest.mark.nightly,
              pytest.mark.skipif(bool(_MISSING), reason=_MISSING)]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


async def test_chat_prompts_end_to_end_on_sglang(tmp_path) -> None:
    torch.set_num_threads(1)
    model = make_qwen_like_model(tmp_path / "model", hidden_size=32, layers=1)
    train, _ = make_math_data(tmp_path / "data", train=16, eval=4)
    task = DatasetTask(train, prompt_field="question", system_prompt="Be brief.", max_new_tokens=24)
    engine = SGLangEngine(model, name="sglang-own", log_dir=tmp_path)
    await engine.start()
    try:
        rollout = Rollout(task, [engine], tokenizer=model, group_size=4, batch_groups=2, reward="math_verify")
        store, recorder = MemoryStore(), Recorder()
        prompts = [task.sample(None), task.sample(None)]
        await worker_for(rollout, engine, store, recorder, tmp_path).produce(prompts)
    finally:
        await engine.stop()
    tok = load_tokenizer(model)
    stops = set(rollout.stop_token_ids)
    assert len(recorder.sent) == 2
    for expected, batch in await batches_with_their_prompts(store, recorder.sent, tok, prompts):
        for i in range(batch.rows):
            row = batch.row(i)
            plen, tokens = int(row["prompt_lens"]), row["tokens"].tolist()
            completion = tokens[plen:]
            assert tok.decode(tokens[:plen]) == expected
            assert not stops & set(completion[:-1]), "generation ends at the first stop token"
            assert len(completion) == 24 or completion[-1] in stops
