"""A checkpoint's model out (stages.learner.export): the folder transformers loads holds the checkpoint's
weights exactly (float32), its tokenizer with the chat template and its generation config, and generates
the torch engine's greedy completions at that version; a checkpoint of two ranks (DCP shards) and a pre-0.2
one (model.safetensors) export the same way; bf16 and sharding past a size load; bad input leaves the
output as it was; the run's exports (`export_every`) report a failed one as a run event. With the SGLang
environment, an SGLang CPU server serves the exported folder and its greedy completions are transformers'."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import anyio
import pytest
import safetensors.torch
import torch

from pipeline.context import RunContext
from pipeline.events import EVENTS_FILE
from pipeline.telemetry import RunFolder
from pipeline.versions import VersionClock
from stages.data.model import load_model, load_tokenizer, make_tiny_model
from stages.learner import GRPOLearner
from stages.learner.export import ExportError, ExportsAsRunGoes, export_checkpoint, size_in_bytes
from stages.learner.ranks import RankedTrainer, RankGroup
from stages.learner.state import LEGACY_MODEL_FILE, SHARDS_DIR, read_model_weights
from stages.learner.step import PolicyTrainer
from tests.helpers.exports import (
    NEW_TOKENS,
    engine_greedy,
    exported_weights,
    rollout_prompts,
    transformers_greedy,
)

torch.set_num_threads(1)
VERSION = 3


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("export") / "tiny")


@pytest.fixture(scope="module")
def spec(model_path: Path) -> GRPOLearner:
    return GRPOLearner(model_path, device="cpu")


def stepped(trainer: PolicyTrainer, seed: int) -> dict[str, torch.Tensor]:
    """Move every weight as an optimizer step would (in place); the new weights, copied."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return {name: t.detach().clone() for name, t in trainer.model.state_dict().items()}


def write_checkpoint(trainer: PolicyTrainer, folder: Path, version: int = VERSION) -> Path:
    (folder / "consumer").mkdir(parents=True)
    trainer.write_state(folder / "consumer", version)
    return folder


@pytest.fixture(scope="module")
def trained(spec: GRPOLearner, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A checkpoint of one rank (DCP shards) whose weights moved from the model folder's; and those weights."""
    trainer = PolicyTrainer(spec, 100)
    weights = stepped(trainer, seed=1)
    checkpoint = write_checkpoint(trainer, tmp_path_factory.mktemp("ckpt") / "v00000003-test")
    assert (checkpoint / "consumer" / SHARDS_DIR).is_dir()
    return checkpoint, weights


@pytest.fixture(scope="module")
def exported(trained, model_path: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("out") / "model"
    result = export_checkpoint(trained[0], model_path, out)
    assert result.version == VERSION and result.dtype == "float32" and result.out == str(out)
    assert result.files == sorted(p.name for p in out.iterdir())
    assert result.bytes == sum(p.stat().st_size for p in out.iterdir())
    return out


def assert_equal_weights(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    different = [name for name in left if not torch.equal(left[name], right[name])]
    assert not different, different


def test_the_export_holds_the_checkpoints_weights_exactly(trained, exported: Path, model_path: Path) -> None:
    checkpoint, weights = trained
    assert_equal_weights(exported_weights(exported), weights)
    initial = exported_weights(model_path)
    assert not torch.equal(initial["model.norm.weight"], weights["model.norm.weight"]), "the checkpoint moved"
    # the tied head is written once, as transformers writes it, and comes back tied
    stored = safetensors.torch.load_file(str(exported / "model.safetensors"))
    assert "model.embed_tokens.weight" in stored and "lm_head.weight" not in stored
    assert json.loads((exported / "config.json").read_text())["tie_word_embeddings"] is True


def test_the_export_has_the_tokenizer_chat_template_and_generation_config(exported: Path, model_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer, run_tokenizer = AutoTokenizer.from_pretrained(exported), load_tokenizer(model_path)
    assert tokenizer.chat_template and tokenizer.chat_template == run_tokenizer.chat_template
    messages = [{"role": "user", "content": "12>"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        run_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert [tokenizer(text).input_ids for text in ("12>", "907>")] == \
        [run_tokenizer(text).input_ids for text in ("12>", "907>")], "the demo model's BOS came along"
    assert (exported / "generation_config.json").read_bytes() == (model_path / "generation_config.json").read_bytes()
    assert json.loads((exported / "config.json").read_text())["dtype"] == "float32"
    assert [p.name for p in exported.parent.iterdir()] == ["model"], "no temporary folder left beside it"


def test_greedy_completions_equal_the_engines_at_that_version(trained, exported: Path, model_path: Path) -> None:
    _, weights = trained
    prompts, completions = transformers_greedy(exported)
    assert prompts == rollout_prompts(model_path), "the exported tokenizer tokenizes as the rollout did"
    assert completions == engine_greedy(model_path, weights, VERSION)
    assert completions != engine_greedy(model_path, exported_weights(model_path), 1), "the version's own"


def test_a_pre_02_checkpoint_exports_the_same_weights(spec: GRPOLearner, model_path: Path, tmp_path: Path) -> None:
    trainer = PolicyTrainer(spec, 100)
    weights = stepped(trainer, seed=2)
    checkpoint = write_checkpoint(trainer, tmp_path / "v00000003-old")
    consumer = checkpoint / "consumer"
    shutil.rmtree(consumer / SHARDS_DIR)  # what 0.1 wrote instead: every tensor by name, in safetensors
    safetensors.torch.save_file({n: t.clone().contiguous() for n, t in weights.items()},
                                str(consumer / LEGACY_MODEL_FILE))
    export_checkpoint(checkpoint, model_path, tmp_path / "out")
    assert_equal_weights(exported_weights(tmp_path / "out"), weights)


@pytest.mark.long  # CI time: in the long suite
def test_a_checkpoint_of_two_ranks_exports_the_same_weights(spec: GRPOLearner, model_path: Path,
                                                             tmp_path: Path) -> None:
    from tests.stages.learner.test_ranks import groups

    ranked = replace(spec, world_size=2, lr=1e-2)
    group = RankGroup(ranked, steps=100)
    group.spawn()
    try:
        group.join()
        trainer = RankedTrainer(PolicyTrainer(ranked, 100, world_size=2), group)
        trainer.schedule(0)
        trainer.train(groups(0), 0.0)
        weights = {name: t.detach().clone() for name, t in trainer.weights().items()}  # gathered whole
        (tmp_path / "v00000001-two" / "consumer").mkdir(parents=True)
        trainer.write_state(tmp_path / "v00000001-two" / "consumer", 1)
    finally:
        group.close()
    state = json.loads((tmp_path / "v00000001-two" / "consumer" / "learner.json").read_text())
    assert state["world_size"] == 2
    export_checkpoint(tmp_path / "v00000001-two", model_path, tmp_path / "out")
    assert_equal_weights(exported_weights(tmp_path / "out"), weights)
    assert not torch.equal(exported_weights(model_path)["model.norm.weight"], weights["model.norm.weight"])


def test_bf16_sharded_past_a_size_loads(trained, model_path: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    checkpoint, weights = trained
    out = tmp_path / "bf16"
    result = export_checkpoint(checkpoint, model_path, out, dtype="bfloat16", max_shard_size="100KB")
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors", shards
    assert not (out / "model.safetensors").exists() and result.dtype == "bfloat16"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert all((out / shard).stat().st_size <= size_in_bytes("100KB") for shard in shards)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16 and json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert_equal_weights({n: t.detach() for n, t in model.state_dict().items()},
                         {n: t.to(torch.bfloat16) for n, t in weights.items()})


def test_bad_input_leaves_the_output_as_it_was(trained, model_path: Path, tmp_path: Path) -> None:
    checkpoint, weights = trained
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(ExportError, match="exists and is not empty.*--force"):
        export_checkpoint(checkpoint, model_path, out)
    other = make_tiny_model(tmp_path / "other", hidden_size=32)
    with pytest.raises(ExportError, match="does not fit the model"):
        export_checkpoint(checkpoint, other, out, force=True)
    with pytest.raises(ExportError, match="not a size"):
        export_checkpoint(checkpoint, model_path, out, max_shard_size="lots", force=True)
    with pytest.raises(ExportError, match="float16"):
        export_checkpoint(checkpoint, model_path, out, dtype="float64", force=True)
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "out"], "no temporary folder left"
    export_checkpoint(checkpoint, model_path, out, force=True)
    assert not (out / "mine.txt").exists()
    assert_equal_weights(exported_weights(out), weights)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "out"]


def test_a_checkpoint_into_another_model_says_which_folder_to_give(trained, tmp_path: Path) -> None:
    """Both readers of DCP shards (an export's and a resume's) name the fix, not DCP's own exception."""
    other = GRPOLearner(make_tiny_model(tmp_path / "other", hidden_size=32), device="cpu")
    with pytest.raises(ValueError, match=r"does not fit the model \(ValueError: Size mismatch.*model.path"):
        read_model_weights(trained[0] / "consumer", load_model(other.model_path))
    with pytest.raises(ValueError, match=r"does not fit the model \(ValueError: Size mismatch.*model.path"):
        PolicyTrainer(other, 100).read_state(trained[0] / "consumer")


def test_the_runs_exports_go_on_and_report_a_failed_one(trained, model_path: Path, tmp_path: Path) -> None:
    """`export_every = 2`: version 1 is not exported, 2 is; a failed export (4: a file is where its folder
    goes) is a `learner.export_failed` run event, and the next one is still written."""
    checkpoint, weights = trained
    ctx = RunContext(run="unit", seed=0, steps=10, clock=VersionClock(), ledger=None, gate=None, policy=None,
                     feedback=None, folder=RunFolder(tmp_path))
    exports = ExportsAsRunGoes(2, model_path, tmp_path, ctx)
    (tmp_path / "exports").mkdir()
    (tmp_path / "exports" / "v00000004").write_text("not a folder")

    async def run() -> None:
        async with anyio.create_task_group() as tasks:
            for version in (1, 2, 4, 6):
                await exports.wait()
                exports.after_checkpoint(tasks, checkpoint, version)

    anyio.run(run)
    assert sorted(p.name for p in (tmp_path / "exports").iterdir()) == ["v00000002", "v00000004", "v00000006"]
    assert (tmp_path / "exports" / "v00000004").is_file()
    assert_equal_weights(exported_weights(tmp_path / "exports" / "v00000006"), weights)
    events = [json.loads(line) for line in (tmp_path / EVENTS_FILE).read_text().splitlines()]
    assert [(e["kind"], e["version"]) for e in events] == [("learner.export_failed", 4)]
    assert "not a folder" in events[0]["error"]


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.long  # CI time: in the long suite
def test_an_sglang_cpu_server_serves_the_export(exported: Path, tmp_path: Path) -> None:
    from stages.engines.sglang_server import SGLangServer, SGLangUnavailable, sglang_python

    try:
        sglang_python()
    except SGLangUnavailable as exc:
        pytest.skip(str(exc))
    prompts, completions = transformers_greedy(exported)
    server = SGLangServer(exported, log_path=tmp_path / "sglang.log")

    async def serve() -> list[list[int]]:
        import aiohttp

        await server.start()
        body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}}
        async with aiohttp.ClientSession() as http, http.post(server.url + "/generate", json=body) as response:
            answer = await response.json()
        return [item["output_ids"] for item in answer]

    try:
        served = anyio.run(serve)
    finally:
        server.stop()
    assert served == completions
