"""A user's own HF model folder: a Qwen2-shaped chat checkpoint with a byte-level BPE tokenizer (no BOS,
ChatML template) loads, tokenizes chat prompts through its template, stops at `<|im_end|>`, and the
rollout records tokens that decode to the chat-formatted prompt and the completion. Bad folders fail
before anything starts, naming what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from random import Random

import msgspec
import pytest
import torch

from buffers.codec import decode
from buffers.memory import MemoryStore
from stages.data.datasets import DatasetTask
from stages.data.model import (
    ModelFolderError,
    check_model_folder,
    load_model,
    load_tokenizer,
    make_tiny_model,
    prompt_token_ids,
    stop_token_ids,
)
from stages.data.tasks import ReverseDigits
from stages.engines.torch import TorchEngine
from stages.rollout import Rollout
from tests.helpers.workers import Recorder, batches_with_their_prompts, chatml_prompt, worker_for
from tools.make_math_example import make_math_data, make_qwen_like_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return make_qwen_like_model(tmp_path_factory.mktemp("qwen-like"), hidden_size=32, layers=1)


@pytest.fixture(scope="module")
def math_data(tmp_path_factory) -> Path:
    train, _ = make_math_data(tmp_path_factory.mktemp("data"), train=64, eval=16)
    return train


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_chat_model_tokenizer_has_no_bos_and_stops_at_every_eos(chat_model: Path) -> None:
    tok = load_tokenizer(chat_model)
    assert tok.bos_token_id is None
    im_end, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert stop_token_ids(tok) == (im_end, pad)  # the tokenizer's EOS, then generation_config.json's list
    assert tok.pad_token == "<|endoftext|>"
    ids = prompt_token_ids(tok, "Ann has 3 pens.")
    assert None not in ids and tok.decode(ids) == "Ann has 3 pens."
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 and 3?"}]
    chat = prompt_token_ids(tok, messages=messages)
    assert tok.decode(chat) == chatml_prompt("2 and 3?")
    check_model_folder(chat_model, needs_chat_template=True)


def test_tiny_model_keeps_its_bos_and_eos(tiny: Path) -> None:
    tok = load_tokenizer(tiny)
    assert prompt_token_ids(tok, "12>") == [tok.bos_token_id, *tok.encode("12>", add_special_tokens=False)]
    assert stop_token_ids(tok) == (tok.eos_token_id,)


def test_generation_config_with_one_eos_int(chat_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(chat_model, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    tok = load_tokenizer(folder)
    assert stop_token_ids(tok) == (tok.eos_token_id, 7)


def test_load_model_dtype(chat_model: Path) -> None:
    assert load_model(chat_model, "bfloat16").dtype == torch.bfloat16
    assert load_model(chat_model).dtype == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        load_model(chat_model, "float16")


def test_a_folder_that_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        check_model_folder(tmp_path / "nowhere")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("{}\n")
    with pytest.raises(ModelFolderError, match="not a Hugging Face model folder"):
        check_model_folder(tmp_path / "data")


def test_an_architecture_that_cannot_load(chat_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "t5"
    shutil.copytree(chat_model, folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 32}))
    with pytest.raises(ModelFolderError, match="'t5' model, which is not a causal LM"):
        check_model_folder(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "no-such-arch"}))
    with pytest.raises(ModelFolderError, match="config.json cannot be read"):
        check_model_folder(folder)


def test_no_chat_template_where_chat_prompts_need_one(chat_model: Path, math_data: Path, tmp_path: Path) -> None:
    folder = tmp_path / "base"
    shutil.copytree(chat_model, folder)
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    check_model_folder(folder, needs_chat_template=False)
    with pytest.raises(ModelFolderError, match="no chat template"):
        check_model_folder(folder, needs_chat_template=True)
    task = DatasetTask(math_data, prompt_field="question")
    with pytest.raises(ModelFolderError, match="no chat template"):
        Rollout(task, [TorchEngine(folder)], tokenizer=folder)
    plain = DatasetTask(math_data, prompt_field="question", chat=False)
    assert Rollout(plain, [TorchEngine(folder)], tokenizer=folder).stop_token_ids


@pytest.mark.anyio
async def test_chat_prompts_end_to_end_on_the_torch_engine(chat_model: Path, math_data: Path, tmp_path) -> None:
    tok = load_tokenizer(chat_model)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    task = DatasetTask(math_data, prompt_field="question", system_prompt="Be brief.",
                       max_new_tokens=24)
    engine = TorchEngine(chat_model, seed=3)
    await engine.start()

    def favour_im_end(module, inputs, logits):  # random weights rarely say <|im_end|>: make most samples stop
        logits = logits.clone()
        logits[..., im_end] += 4.0
        return logits

    engine._model.lm_head.register_forward_hook(favour_im_end)
    rollout = Rollout(task, [engine], tokenizer=chat_model, group_size=4, batch_groups=2, temperature=1.0,
                      reward="exact_match")
    store, recorder = MemoryStore(), Recorder()
    worker = worker_for(rollout, engine, store, recorder, tmp_path)
    prompts = [task.sample(None), task.sample(None)]
    await worker.produce(prompts)
    stopped = 0
    assert len(recorder.sent) == 2 and not recorder.finished
    for expected_prompt, batch in await batches_with_their_prompts(store, recorder.sent, tok, prompts):
        for i in range(batch.rows):
            row = batch.row(i)
            plen = int(row["prompt_lens"])
            tokens = row["tokens"].tolist()
            assert tok.decode(tokens[:plen]) == expected_prompt
            completion = tokens[plen:]
            assert im_end not in completion[:-1], "generation stops at the first <|im_end|>"
            assert len(completion) == 24 or completion[-1] in rollout.stop_token_ids
            stopped += completion[-1] == im_end
            assert tok.decode(tokens) == expected_prompt + tok.decode(completion)
    assert stopped > 0, "some completions ended at <|im_end|>"
    assert sorted(r.source for r in recorder.produced) == sorted(msgspec.json.encode(p) for p in prompts)
    await engine.stop()


@pytest.mark.anyio
async def test_builtin_task_prompts_keep_bos_on_the_tiny_model(tiny: Path, tmp_path) -> None:
    engine = TorchEngine(tiny)
    await engine.start()
    rollout = Rollout(ReverseDigits(digits=2), [engine], tokenizer=tiny, group_size=2, batch_groups=1)
    store, recorder = MemoryStore(), Recorder()
    await worker_for(rollout, engine, store, recorder, tmp_path).produce([ReverseDigits(digits=2).sample(Random(0))])
    row = decode(await store.get(recorder.sent[0].key)).row(0)
    tok = load_tokenizer(tiny)
    assert row["tokens"][0] == tok.bos_token_id and int(row["prompt_lens"]) == 4
    await engine.stop()
