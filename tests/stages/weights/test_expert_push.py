"""Every expert-parallel learner rank pushes its own experts straight to the engine: two real ranks over gloo
(`learner.expert_parallel = 2`, the 2-rank fixtures of tests/stages/learner/test_experts.py) push their version
from their shards with mooncake_p2p into an engine started from other random weights. Counted from the bucket
checks each rank reports: every rank wrote exactly its own experts' bytes of every fused expert tensor (and its
FSDP2 rows of the rest), none of the other rank's, each byte of the version once; and the engine then holds the
gathered model exactly."""

from __future__ import annotations

import anyio
import pytest
import torch

from stages.data.model import make_tiny_moe_model
from stages.weights.mooncake_shards import PushSettings
from stages.weights.reshard import BucketCheck, is_expert
from tests.stages.learner.test_experts import moe_folder, spec, two_ranks  # noqa: F401 - fixtures

torch.set_num_threads(1)


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
def test_each_expert_parallel_rank_sends_only_its_own_experts(spec, two_ranks, tmp_path) -> None:  # noqa: F811
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
