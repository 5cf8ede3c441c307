"""The Qwen2-shaped chat checkpoint of the math example on a real server engine (CPU), SGLang's and vLLM's: chat
prompts through the rollout, recorded tokens that decode to the ChatML prompt and the completion, generation
that never runs past a stop token. Each engine's case is skipped, with the reason, when its environment is
missing. vLLM's CPU attention takes head sizes 32, 64, ... only, so its model has 2 heads at hidden size 64."""

from __future__ import annotations

import pytest
import torch

from buffers.memory import MemoryStore
from stages.data.datasets import DatasetTask
from stages.data.model import load_tokenizer
from stages.engines.sglang import SGLangEngine
from stages.engines.vllm import VLLMEngine
from stages.rollout import Rollout
from tests.helpers.engines import SGLANG_MISSING, VLLM_MISSING
from tests.helpers.workers import Recorder, batches_with_their_prompts, worker_for
from tools.make_math_example import make_math_data, make_qwen_like_model

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
ENGINES = {  # kind: (engine class, model shape)
    "sglang": (SGLangEngine, {"hidden_size": 32, "layers": 1}),
    "vllm": (VLLMEngine, {"hidden_size": 64, "layers": 1, "heads": 2, "kv_heads": 1}),
}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize("kind", [
    pytest.param("sglang", marks=[pytest.mark.sglang, pytest.mark.nightly,
                                  pytest.mark.skipif(bool(SGLANG_MISSING), reason=SGLANG_MISSING)]),
    pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.long,
                                pytest.mark.skipif(bool(VLLM_MISSING), reason=VLLM_MISSING)]),
])
async def test_chat_prompts_end_to_end_on_a_server_engine(kind: str, tmp_path) -> None:
    torch.set_num_threads(1)
    engine_class, shape = ENGINES[kind]
    model = make_qwen_like_model(tmp_path / "model", **shape)
    train, _ = make_math_data(tmp_path / "data", train=16, eval=4)
    task = DatasetTask(train, prompt_field="question", system_prompt="Be brief.", max_new_tokens=24)
    engine = engine_class(model, name=f"{kind}-own", log_dir=tmp_path)
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
