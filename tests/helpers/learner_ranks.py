"""A learner of several real ranks (processes in one gloo group) for the tests that step it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch.distributed as dist

from stages.learner import GRPOLearner
from stages.learner.ranks import RankedTrainer, RankGroup
from stages.learner.step import PolicyTrainer


@contextmanager
def ranked_trainer(spec: GRPOLearner, world_size: int = 2, steps: int = 100) -> Iterator[RankedTrainer]:
    """`spec` on `world_size` spawned ranks, scheduled at version 0; the group is closed on exit, and no
    process group is left initialised in this process."""
    ranked = replace(spec, world_size=world_size)
    group = RankGroup(ranked, steps=steps)
    group.spawn()
    group.join()
    try:
        trainer = RankedTrainer(PolicyTrainer(ranked, steps, world_size=world_size), group)
        trainer.schedule(0)
        yield trainer
    finally:
        group.close()
    assert not dist.is_initialized()
