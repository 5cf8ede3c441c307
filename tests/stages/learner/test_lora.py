"""The LoRA learner (stages.learner.lora): peft adapters on a frozen base, the optimizer holding only them,
each version publishing the adapter alone with its descriptor, checkpoints of the adapter that resume,
and two ranks (FSDP2 over gloo, real processes) stepping as one."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from stages.data.model import load_model, make_tiny_model
from stages.learner import GRPOLearner
from stages.learner.lora import LoraSpec, probe_tokens
from stages.learner.lora_export import merged_checkpoint, write_adapter_folder
from stages.learner.ranks import RankedTrainer
from stages.learner.state import SHARDS_DIR, read_adapter
from stages.learner.step import PolicyTrainer
from stages.weights.adapter import (
    adapter_pairs,
    base_fingerprint,
    unpack_adapter,
    weight_shapes,
)
from stages.weights.base import state_bytes
from tests.helpers.learner_ranks import ranked_trainer
from tests.stages.learner.test_ranks import groups

torch.set_num_threads(1)
LORA = LoraSpec(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("lora") / "tiny")


@pytest.fixture(scope="module")
def spec(folder) -> GRPOLearner:
    # a large lr and micro-batches: differences between layouts would show within a few steps
    return GRPOLearner(folder, lr=1e-2, device="cpu", micro_batch_tokens=24, lora=LORA)


def trained(spec: GRPOLearner, steps: int = 3, first: int = 0) -> PolicyTrainer:
    trainer = PolicyTrainer(spec, 100)
    trainer.schedule(0)
    for step in range(first, first + steps):
        trainer.train(groups(step), 1.0)
    return trainer


def logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def adapter(trainer) -> dict[str, torch.Tensor]:
    return unpack_adapter(trainer.weights(1))[1]


def test_only_the_adapter_trains(spec: GRPOLearner, folder: Path) -> None:
    trainer = trained(spec)
    lora = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert lora and all(".lora_A." in n or ".lora_B." in n for n in lora)
    held = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in held} == {id(p) for p in lora.values()}  # the optimizer holds the adapter only
    base = load_model(folder).state_dict()
    frozen = {n.replace(".base_layer", ""): t for n, t in trainer.model.get_base_model().state_dict().items()
              if "lora_" not in n}
    assert frozen.keys() == base.keys()
    assert all(torch.equal(frozen[n], base[n]) for n in base), "the base is the model folder's, bit for bit"
    assert any(float(p.detach().abs().max()) > 0 for n, p in lora.items() if ".lora_B." in n), "B moved off zero"


def test_a_version_publishes_the_adapter_alone(spec: GRPOLearner, folder: Path) -> None:
    trainer = trained(spec)
    version = trainer.weights(3)
    descriptor, tensors = unpack_adapter(version)
    assert (descriptor.rank, descriptor.alpha, descriptor.target_modules) == (4, 8.0, LORA.target_modules)
    assert descriptor.base == base_fingerprint(folder)
    adapted = adapter_pairs(descriptor, tensors, weight_shapes(folder))  # peft's names, each fitting the base
    assert len(adapted) == 2 * len(LORA.target_modules)  # two layers
    full = state_bytes(load_model(folder).state_dict())
    assert state_bytes(version) < 0.25 * full, (state_bytes(version), full)
    # the probe: the learner's own teacher-forced logprobs of the fixed sequence
    ids = probe_tokens(trainer.model.config.vocab_size)
    logp = torch.log_softmax(logits(trainer.model, ids)[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    assert descriptor.probe.tokens == tuple(ids)
    assert torch.allclose(torch.tensor(descriptor.probe.logprobs), logp, atol=1e-6)
    assert descriptor.probe.tolerance == LORA.check_tolerance
    every_other = PolicyTrainer(replace(spec, lora=replace(LORA, check_every=2)), 10)
    assert unpack_adapter(every_other.weights(3))[0].probe is None
    assert unpack_adapter(every_other.weights(4))[0].probe is not None


def test_bad_lora_settings_name_the_key(folder: Path) -> None:
    with pytest.raises(ValueError, match=r"learner\.lora\.target_modules names \['qkv_proj'\].*'q_proj'"):
        PolicyTrainer(GRPOLearner(folder, device="cpu", lora=LoraSpec(target_modules=("qkv_proj", "v_proj"))), 10)
    for bad, key in (({"rank": 0}, "rank"), ({"alpha": 0.0}, "alpha"), ({"dropout": 1.0}, "dropout"),
                     ({"target_modules": ()}, "target_modules"), ({"check_tolerance": 0.0}, "check_tolerance")):
        with pytest.raises(ValueError, match=rf"learner\.lora\.{key}"):
            LoraSpec(**bad)


def test_a_checkpoint_holds_the_adapter_and_resumes(spec: GRPOLearner, folder: Path, tmp_path: Path) -> None:
    """The next step after a resume equals the step the uninterrupted learner takes: weights, moments and
    step counts all came back; the checkpoint holds the adapter, not the base."""
    going = trained(spec)
    going.write_state(tmp_path, version=3)
    shard_bytes = sum(f.stat().st_size for f in (tmp_path / SHARDS_DIR).iterdir())
    assert shard_bytes < 0.5 * state_bytes(load_model(folder).state_dict())
    resumed = PolicyTrainer(spec, 100)
    assert resumed.read_state(tmp_path) == 3
    resumed.schedule(3)
    going.scheduler = None
    going.schedule(3)
    before = adapter(going)
    assert all(torch.equal(before[n], t) for n, t in adapter(resumed).items())
    going.train(groups(7), 1.0)
    resumed.train(groups(7), 1.0)
    after, again = adapter(going), adapter(resumed)
    assert all(torch.allclose(after[n], again[n], atol=1e-7) for n in after)
    assert any(not torch.equal(after[n], before[n]) for n in after)
    settings, stored = read_adapter(tmp_path)  # an export reads it without a model
    assert settings.rank == LORA.rank and stored.keys() == before.keys()
    assert all(torch.equal(stored[n], before[n]) for n in before)
    with pytest.raises(ValueError, match="holds a LoRA adapter .rank 4.*asks for full weights"):
        PolicyTrainer(replace(spec, lora=None), 10).read_state(tmp_path)
    with pytest.raises(ValueError, match="rank 8"):
        PolicyTrainer(replace(spec, lora=replace(LORA, rank=8)), 10).read_state(tmp_path)


def test_the_kl_reference_is_the_frozen_base(spec: GRPOLearner) -> None:
    trainer = PolicyTrainer(replace(spec, kl_coef=0.5), 100)
    trainer.schedule(0)
    assert trainer.reference is None  # no second model: the base with the adapter switched off
    first = trainer.train(groups(0), 1.0)
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-7)  # B starts at zero: the policy is the base
    later = [trainer.train(groups(step), 1.0)["kl_ref"] for step in (1, 2)]
    assert later[-1] > 0


@pytest.mark.parametrize("targets", [LORA.target_modules, ("q_proj", "down_proj", "lm_head")])
def test_a_checkpoint_exports_as_a_peft_folder_and_merged(spec: GRPOLearner, folder: Path, tmp_path: Path,
                                                          targets: tuple[str, ...]) -> None:
    """What an export of a LoRA run needs (stages.learner.lora_export): a PEFT folder peft itself loads, and
    whole weights merged as peft merges (an adapted tied head untied); both give the learner's logits."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    trainer = trained(replace(spec, lora=replace(LORA, target_modules=targets)))
    trainer.write_state(tmp_path, version=3)
    ids = [1, 5, 9, 12, 3, 7]
    want = logits(trainer.model, ids)
    out = write_adapter_folder(tmp_path, folder, tmp_path / "adapter")
    assert torch.allclose(logits(PeftModel.from_pretrained(load_model(folder), out), ids), want, atol=1e-6)
    merged, untied = merged_checkpoint(tmp_path, folder)
    assert untied == ("lm_head" in targets)
    config = AutoConfig.from_pretrained(folder, tie_word_embeddings=not untied)
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(merged, strict=False)
    assert not unexpected and missing == ([] if untied else ["lm_head.weight"])  # a tied head is the embedding
    assert torch.allclose(logits(model, ids), want, atol=1e-5)

    from stages.learner.export import export_adapter, export_checkpoint

    consumer = tmp_path / "checkpoint" / "consumer"  # what `baton export` reads: a checkpoint's consumer folder
    consumer.mkdir(parents=True)
    trainer.write_state(consumer, version=3)
    exported = export_checkpoint(tmp_path / "checkpoint", folder, tmp_path / "hf", dtype="float32")
    assert exported.version == 3
    assert torch.allclose(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "hf"), ids), want, atol=1e-5)
    alone = export_adapter(tmp_path / "checkpoint", folder, tmp_path / "peft")
    assert alone.dtype == "adapter"
    peft_model = PeftModel.from_pretrained(load_model(folder), tmp_path / "peft")
    assert torch.allclose(logits(peft_model, ids), want, atol=1e-6)


@pytest.fixture(scope="module")
def two_ranks(spec: GRPOLearner):
    with ranked_trainer(spec) as trainer:
        yield trainer


def test_two_ranks_with_lora_step_as_one(spec: GRPOLearner, two_ranks: RankedTrainer, tmp_path: Path) -> None:
    """FSDP2 over the peft model: the adapter gathered on rank 0 after three steps is one rank's; its probe
    too; and the two ranks' checkpoint resumes on one."""
    one = trained(spec)
    for step in range(3):
        two_ranks.train(groups(step), 1.0)
    single, sharded = unpack_adapter(one.weights(3)), unpack_adapter(two_ranks.weights(3))
    assert single[1].keys() == sharded[1].keys()
    assert max(float((single[1][n] - sharded[1][n]).abs().max()) for n in single[1]) <= 1e-5
    assert max(abs(a - b) for a, b in zip(single[0].probe.logprobs, sharded[0].probe.logprobs, strict=True)) <= 1e-5
    two_ranks.write_state(tmp_path, version=3)
    resumed = PolicyTrainer(spec, 100)
    assert resumed.read_state(tmp_path) == 3
    assert all(torch.equal(t, sharded[1][n]) for n, t in adapter(resumed).items())
