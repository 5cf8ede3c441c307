"""The tiny mixture of experts through the real pipeline (torch engine, memory store, GRPO learner) at k = 2:
each generated token's routed experts travel from the engine through the codec to the learner. With
`routing_replay = "rollout"` the learner routes every trained token as the engine did (router disagreement 0
on every step, its first step's logprobs the engine's); with replay off the disagreement is reported."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from buffers.memory import MemoryStore
from buffers.ref_buffer import RefBuffer
from pipeline.dsl import Pipeline
from pipeline.telemetry import RunFolder
from policies import MaxStaleness
from stages.data.model import make_tiny_moe_model
from stages.data.tasks import ReverseDigits
from stages.engines.torch import TorchEngine
from stages.learner import GRPOLearner
from stages.rollout import Rollout

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    return make_tiny_moe_model(tmp_path_factory.mktemp("tiny_moe"))


def run(model: Path, tmp_path: Path, replay: str, steps: int) -> tuple[dict, list[dict]]:
    summary = Pipeline(
        name=f"moe-{replay}",
        steps=steps,
        run_root=tmp_path,
        progress=False,
        producer=Rollout(ReverseDigits(digits=2), [TorchEngine(model)], tokenizer=model, group_size=4,
                         batch_groups=4),
        buffer=RefBuffer(MemoryStore()),
        consumer=GRPOLearner(model, groups_per_step=4, lr=1e-3, routing_replay=replay),
        staleness=MaxStaleness(k=2),
    ).run()
    records = [r for r in RunFolder(summary["run_dir"]).read_metrics() if "router_disagreement" in r]
    return summary, records


def test_replay_routes_every_trained_token_as_the_engine_did(moe_model: Path, tmp_path: Path) -> None:
    summary, records = run(moe_model, tmp_path, "rollout", steps=20)
    assert summary["ledger_balanced"] and summary["version"] == 20
    assert len(records) == 20
    assert all(r["router_disagreement"] == 0.0 and r["router_disagreement_max"] == 0.0 for r in records)
    assert records[0]["logprob_gap"] < 1e-5  # version 0's tokens at version 0: the engine's logprobs
    assert max(r["router_drift"] for r in records) > 0  # the router moved: replay held the routing


def test_without_replay_the_disagreement_is_reported(moe_model: Path, tmp_path: Path) -> None:
    summary, records = run(moe_model, tmp_path, "off", steps=8)
    assert summary["ledger_balanced"] and len(records) == 8
    assert all(r["router_disagreement"] == r["router_drift"] for r in records)
    assert records[0]["router_disagreement"] < 0.05 and max(r["router_disagreement"] for r in records) > 0
