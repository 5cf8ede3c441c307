"""The expert-parallel learner (stages.learner.experts): the setting's check, and two real ranks over gloo
(this process rank 0, one spawned rank: one group serves the module) whose experts are split between them,
tokens sent to their experts' ranks by all-to-all. With routing replay on, their steps on groups the torch
engine generated equal one rank's (weights gathered after the steps); each rank holds about half of the
experts' parameters and AdamW state; a checkpoint they write loads into one rank exactly and back; a push from
the shards (mooncake_p2p) lands every rank's own experts in the engine: counted from the bucket checks each
rank reports, every rank wrote exactly its own experts' bytes of every fused expert tensor (and its FSDP2 rows of
the rest), none of the other rank's, each byte of the version once."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from stages.data.model import make_tiny_moe_model
from stages.learner import GRPOLearner
from stages.learner.experts import ShardedExperts, check_expert_parallel
from stages.learner.step import PolicyTrainer
from stages.weights.mooncake_shards import PushSettings
from stages.weights.reshard import BucketCheck, is_expert
from tests.stages.learner.test_replay import _generated_groups

torch.set_num_threads(1)
STEPS = 4


def test_the_degree_must_divide_the_experts_and_equal_the_world() -> None:
    check_expert_parallel(1, 0, 4)  # off: anything goes
    check_expert_parallel(2, 8, 2)
    with pytest.raises(ValueError, match="learner.expert_parallel = 3 must divide the model's 8 experts"):
        check_expert_parallel(3, 8, 3)
    with pytest.raises(ValueError, match="learner.expert_parallel = 2 must equal learner.world_size = 4"):
        check_expert_parallel(2, 8, 4)
    with pytest.raises(ValueError, match="learner.expert_parallel = 2 shards the experts.*dense"):
        check_expert_parallel(2, 0, 2)
    with pytest.raises(ValueError, match="learner.expert_parallel must be >= 1"):
        GRPOLearner("m", expert_parallel=0)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory) -> Path:
    return make_tiny_moe_model(tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def spec(moe_folder) -> GRPOLearner:
    # lr 1e-3: AdamW's first step moves a weight by lr x g / (|g| + eps), so float-order noise in gradients near
    # eps shows as up to ~2e-3 x lr in the weights (FSDP2 alone: 6e-6, experts sent by all-to-all: 1.9e-5 at 1e-2)
    # a load-balancing term: the dense router's loss is computed on each rank's own tokens, summed as the rest
    return GRPOLearner(moe_folder, device="cpu", lr=1e-3, routing_replay="rollout", micro_batch_tokens=24,
                       load_balance_coef=0.01)


@pytest.fixture(scope="module")
def generated(moe_folder):
    return _generated_groups(moe_folder)


@pytest.fixture(scope="module")
def two_ranks(spec):
    from dataclasses import replace

    from tests.helpers.learner_ranks import ranked_trainer

    with ranked_trainer(replace(spec, expert_parallel=2)) as trainer:
        yield trainer


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
def test_two_expert_parallel_ranks_step_as_one(spec, generated, two_ranks) -> None:
    one = PolicyTrainer(spec, 100)
    one.schedule(0)
    for step in range(STEPS):
        batches = generated if step != 1 else generated[:1]  # one group: rank 1 sends and runs empty passes
        a, b = one.train(batches, 0.0), two_ranks.train(batches, 0.0)
        for key in ("loss", "grad_norm", "router_disagreement", "logprob_gap", "load_balance_loss"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
    assert b["router_disagreement"] == 0.0
    experts = [m for m in two_ranks.model.modules() if isinstance(m, ShardedExperts)]
    assert len(experts) == 2 and all(m.gate_up_proj.to_local().shape[0] == 4 for m in experts)
    single, sharded = one.weights(), two_ranks.weights()
    assert max_diff(single, sharded) <= 1e-5
    assert max_diff(single, PolicyTrainer(spec, 1).weights()) > 1e-3, "it trained"


def expert_state_bytes(trainer) -> int:
    """This rank's bytes of expert parameters, their gradients and their AdamW state (benchmarks/moe.py's
    figure too)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    params = [p for n, p in trainer.model.named_parameters() if ".experts." in n]
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for p in params for v in trainer.optimizer.state[p].values() if torch.is_tensor(v) and v.dim() > 0]
    return sum(local(t).numel() * local(t).element_size() for t in (*params, *grads, *state))


@pytest.mark.slow
def test_each_rank_holds_half_the_experts_state(spec, generated, two_ranks) -> None:
    one = PolicyTrainer(spec, 100)
    one.schedule(0)
    one.train(generated, 0.0)
    two_ranks.train(generated, 0.0)
    ratio = expert_state_bytes(two_ranks.trainer) / expert_state_bytes(one)
    assert ratio <= 0.55, ratio


@pytest.mark.slow
def test_checkpoints_load_between_expert_parallel_and_one_rank(spec, generated, two_ranks, tmp_path) -> None:
    two_ranks.train(generated, 0.0)
    (tmp_path / "two").mkdir()
    two_ranks.write_state(tmp_path / "two", version=3)
    one = PolicyTrainer(spec, 100)
    assert one.read_state(tmp_path / "two") == 3
    assert max_diff(one.weights(), two_ranks.weights()) == 0.0
    one.schedule(3)
    two_ranks.schedule(3)
    one.train(generated, 0.0)
    two_ranks.train(generated, 0.0)  # the same step only if the moments came along
    assert max_diff(one.weights(), two_ranks.weights()) <= 1e-5

    (tmp_path / "one").mkdir()
    one.write_state(tmp_path / "one", version=4)
    assert two_ranks.read_state(tmp_path / "one") == 4
    assert max_diff(one.weights(), two_ranks.weights()) == 0.0


class RecordingSource:
    """The learner's ranks as the transport sees them (`ShardSource`), keeping every rank's bucket checks."""

    def __init__(self, ranks) -> None:  # noqa: ANN001 - a RankedTrainer
        self.ranks, self.checks, self.layout = ranks, [], None

    def receive_layout(self, version: int, settings: PushSettings):  # noqa: ANN201 - a Layout
        self.layout = self.ranks.receive_layout(version, settings)
        return self.layout

    def write(self, peer: str, address: int, version: int, settings: PushSettings) -> list[BucketCheck]:
        checks = self.ranks.write(peer, address, version, settings)
        self.checks += checks
        return checks


def written(checks: list[BucketCheck], rank: int, start: int, stop: int) -> list[tuple[int, int]]:
    """The byte ranges [a, b) of [start, stop) that `rank` wrote, merged."""
    spans = sorted((max(o, start), min(o + n, stop)) for c in checks if c.src_rank == rank for o, n in c.ranges
                   if o < stop and o + n > start)
    merged: list[tuple[int, int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


@pytest.mark.slow
def test_each_expert_parallel_rank_sends_only_its_own_experts(spec, two_ranks, tmp_path) -> None:
    from stages.engines.torch import TorchEngine
    from stages.weights.mooncake_p2p import MooncakeP2PTransport

    source = RecordingSource(two_ranks)
    other = make_tiny_moe_model(tmp_path / "other", seed=1)  # the engine starts on other weights: all must land

    async def scenario() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        engine = TorchEngine(other)
        await engine.start()
        transport = MooncakeP2PTransport(bucket_bytes=1 << 16)
        transport.subscribe(engine)
        try:
            before = {n: t.clone() for n, t in engine._model.state_dict().items()}
            await transport.publish_shards(1, source)
            assert engine.version == 1 and transport.stats["copied"] == 0, "written from the ranks' own shards"
            return before, {n: t.clone() for n, t in engine._model.state_dict().items()}  # tied lm_head too
        finally:
            await transport.close()
            await engine.stop()

    before, live = anyio.run(scenario)
    learner = two_ranks.weights()
    assert all(not torch.equal(before[n], learner[n]) for n in learner if before[n].numel() > 1 and "norm" not in n)
    assert learner.keys() <= live.keys() and all(torch.equal(live[n], learner[n]) for n in learner)

    experts = [e for e in source.layout.tensors if is_expert(e.name)]
    assert len(experts) == 4  # gate_up_proj and down_proj of 2 MoE layers
    sent = [sum(n for c in source.checks if c.src_rank == r for _, n in c.ranges) for r in range(2)]
    assert sum(sent) == sum(e.nbytes for e in source.layout.tensors), "every byte of the version, once"
    for e in experts:  # [E, ...]: rank r's experts are the r-th half of the tensor's bytes, and only those
        half = e.nbytes // 2
        for rank in range(2):
            mine = (e.offset + rank * half, e.offset + (rank + 1) * half)
            assert written(source.checks, rank, e.offset, e.offset + e.nbytes) == [mine], (e.name, rank)
    expert_bytes = sum(e.nbytes for e in experts)
    dense = [sent[r] - expert_bytes // 2 for r in range(2)]
    assert min(dense) > 0 and abs(dense[0] - dense[1]) <= 0.2 * sum(dense), dense  # FSDP2's rows of the rest
