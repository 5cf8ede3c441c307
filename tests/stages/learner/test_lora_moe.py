"""LoRA on the tiny mixture of experts (stages.learner.lora with peft's `target_parameters`): by default the
adapter targets the attention alone (never the router, never the experts); `target_experts` adds the fused
experts, each expert its own factors, and only then do expert factors exist and train. A version names the
expert factors by their parameter; the torch engine's merge and `baton export` (merged, and the PEFT folder
peft loads) give the adapter model's logits."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint import CONSUMER_DIR
from stages.data.model import load_model, make_tiny_model, make_tiny_moe_model
from stages.engines.torch_adapter import AdapterMerger
from stages.learner import GRPOLearner
from stages.learner.export import export_adapter, export_checkpoint
from stages.learner.lora import EXPERT_PARAMETERS, LoraSpec
from stages.learner.step import PolicyTrainer
from stages.weights.adapter import (
    AdapterError,
    AdapterVersion,
    adapter_pairs,
    from_peft_names,
    to_peft_names,
    unpack_adapter,
)
from tests.stages.learner.test_ranks import groups

torch.set_num_threads(1)
IDS = [3, 10, 17, 24, 31, 38, 45, 2, 9, 16]
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_tiny_moe_model(tmp_path_factory.mktemp("lora_moe") / "moe")


def trained(folder: Path, experts: bool, steps: int = 2) -> PolicyTrainer:
    spec = GRPOLearner(folder, lr=1e-2, device="cpu", lora=LoraSpec(rank=4, alpha=8.0, target_experts=experts))
    trainer = PolicyTrainer(spec, 100)
    trainer.schedule(0)
    for step in range(steps):
        trainer.train(groups(step), 1.0)
    return trainer


@pytest.fixture(scope="module")
def attention_only(folder: Path) -> PolicyTrainer:
    return trained(folder, experts=False)


@pytest.fixture(scope="module")
def with_experts(folder: Path) -> PolicyTrainer:
    return trained(folder, experts=True)


def logits(model: torch.nn.Module, ids: list[int] = IDS) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def trainable(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_by_default_the_adapter_targets_the_attention_alone(attention_only: PolicyTrainer, folder: Path) -> None:
    names = trainable(attention_only)
    assert names and all(n.split(".")[-4] in ATTENTION for n in names), sorted(names)[:4]
    assert not [n for n in names if ".mlp." in n]  # neither the experts nor the router
    descriptor, tensors = unpack_adapter(attention_only.weights(2))
    assert descriptor.target_parameters == () and not [n for n in tensors if ".mlp." in n]
    base = load_model(folder).state_dict()
    experts = {n.replace(".base_layer", ""): t for n, t in attention_only.model.get_base_model().state_dict().items()
               if ".mlp." in n}
    assert experts and all(torch.equal(t, base[n]) for n, t in experts.items()), "experts and router stay the base's"


def test_target_experts_adds_each_experts_own_factors_and_trains_them(with_experts: PolicyTrainer) -> None:
    names = trainable(with_experts)
    expert_factors = {n: t for n, t in names.items() if ".mlp.experts." in n}
    assert len(expert_factors) == 2 * 2 * 2  # 2 layers x (gate_up, down) x (A, B)
    assert not [n for n in names if ".mlp.gate." in n], "never the router"
    assert {n for n in names if n.split(".")[-4] in ATTENTION} == set(names) - set(expert_factors)
    assert all(float(t.abs().max()) > 0 for n, t in expert_factors.items() if ".lora_B." in n), "B moved off zero"
    descriptor, tensors = unpack_adapter(with_experts.weights(2))
    assert descriptor.target_parameters == EXPERT_PARAMETERS
    experts, rank, hidden, inter = 8, 4, 64, 64
    shapes = {n.removeprefix("base_model.model.model.layers.0.mlp.experts."): tuple(t.shape)
              for n, t in tensors.items() if ".layers.0.mlp.experts." in n}
    assert shapes == {"gate_up_proj.lora_A.weight": (experts * rank, hidden),
                      "gate_up_proj.lora_B.weight": (2 * inter, experts * rank),
                      "down_proj.lora_A.weight": (experts * rank, inter),
                      "down_proj.lora_B.weight": (hidden, experts * rank)}
    assert from_peft_names(descriptor, to_peft_names(descriptor, tensors)).keys() == tensors.keys()


@pytest.mark.parametrize("experts", [False, True])
def test_the_torch_engines_merge_gives_the_adapter_models_logits(experts: bool, attention_only: PolicyTrainer,
                                                                  with_experts: PolicyTrainer, folder: Path) -> None:
    trainer = with_experts if experts else attention_only
    engine_model = load_model(folder)
    merger = AdapterMerger("torch-0", folder, {})
    merger.keep_base(engine_model, threading.Lock())
    weights = merger.merge(2, AdapterVersion(*unpack_adapter(trainer.weights(2))))  # probe checked in there
    merged = torch.func.functional_call(engine_model, weights, (), {"input_ids": torch.tensor([IDS])},
                                        tie_weights=False).logits[0]
    assert (merged - logits(trainer.model)).abs().max() < 1e-5
    if experts:
        assert not torch.equal(weights["model.layers.0.mlp.experts.down_proj"],
                               engine_model.model.layers[0].mlp.experts.down_proj)


def test_export_merges_the_expert_adapter_and_writes_a_folder_peft_loads(with_experts: PolicyTrainer,
                                                                         folder: Path, tmp_path: Path) -> None:
    from peft import PeftModel

    with_experts.write_state(tmp_path / "ckpt" / CONSUMER_DIR, version=2)
    want = logits(with_experts.model)
    export_checkpoint(tmp_path / "ckpt", folder, tmp_path / "merged")
    assert (logits(load_model(tmp_path / "merged")) - want).abs().max() < 1e-5
    export_adapter(tmp_path / "ckpt", folder, tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(load_model(folder), tmp_path / "adapter")
    assert (logits(loaded) - want).abs().max() < 1e-5


def test_an_expert_factor_of_the_wrong_shape_is_refused(with_experts: PolicyTrainer) -> None:
    descriptor, tensors = unpack_adapter(with_experts.weights(2))
    shapes = {n: tuple(p.shape) for n, p in with_experts.model.get_base_model().named_parameters()}
    shapes = {n.replace(".base_layer", ""): s for n, s in shapes.items() if "lora_" not in n}
    name = "base_model.model.model.layers.1.mlp.experts.down_proj.lora_A.weight"
    bad = {**tensors, name: tensors[name][:4]}
    with pytest.raises(AdapterError, match=r"down_proj lora_A has shape \(4, 64\), expected \(32, 64\)"):
        adapter_pairs(descriptor, bad, shapes)


def test_target_experts_is_refused_where_it_cannot_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"learner\.lora\.target_experts = true needs learner\.lora\.dropout = 0"):
        LoraSpec(target_experts=True, dropout=0.1)
    dense = make_tiny_model(tmp_path / "dense")
    with pytest.raises(ValueError, match=r"learner\.lora\.target_experts = true, but the model has no fused experts"):
        PolicyTrainer(GRPOLearner(dense, device="cpu", lora=LoraSpec(target_experts=True)), 10)


def test_a_run_with_expert_adapters_replays_routing_and_every_version_lands(folder: Path, tmp_path: Path) -> None:
    """The real pipeline (torch engine, memory store, GRPO learner with routing replay) for a few versions:
    every version is an adapter the engine merged after its probe matched, none refused; the learner routes
    every trained token as the engine did."""
    from buffers.memory import MemoryStore
    from buffers.ref_buffer import RefBuffer
    from pipeline.dsl import Pipeline
    from pipeline.telemetry import RunFolder
    from policies import MaxStaleness
    from stages.data.tasks import ReverseDigits
    from stages.engines.torch import TorchEngine
    from stages.rollout import Rollout

    engine = TorchEngine(folder)
    summary = Pipeline(
        name="moe-lora", steps=3, run_root=tmp_path, progress=False,
        producer=Rollout(ReverseDigits(digits=2), [engine], tokenizer=folder, group_size=4, batch_groups=2),
        buffer=RefBuffer(MemoryStore()),
        consumer=GRPOLearner(folder, groups_per_step=2, lr=1e-2, routing_replay="rollout",
                             lora=LoraSpec(rank=4, alpha=8.0, target_experts=True)),
        staleness=MaxStaleness(k=1),
    ).run()
    assert summary["ledger_balanced"] and summary["version"] == 3
    assert engine.stats["adapters_merged"] >= 3 and engine.stats["adapters_refused"] == 0
    records = [r for r in RunFolder(summary["run_dir"]).read_metrics() if "router_disagreement" in r]
    assert len(records) == 3 and all(r["router_disagreement"] == 0.0 for r in records)
