"""The learner's routing-replay inputs (stages.learner.replay): a step's recorded experts padded like its
token ids, masked by the loss mask, and the router metrics of a replayed forward. The groups here are
stand-ins with a 2-D token field, which the codec does not carry yet (its token fields are 1-D)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from stages.data.routing import ROUTED_EXPERTS_FIELD, RoutingAgreement
from stages.learner.replay import routed_tensors, routing_metrics


@dataclass
class Group:
    offsets: np.ndarray
    token_fields: dict[str, np.ndarray]
    meta: dict = field(default_factory=lambda: {"group": "g"})

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1


def _group(lengths: list[int], prompt: int, start: int) -> Group:
    tokens = sum(lengths)
    experts = (np.arange(tokens * 4).reshape(tokens, 2, 2) + start).astype(np.uint8)
    mask = np.concatenate([np.r_[np.zeros(prompt), np.ones(n - prompt)] for n in lengths]).astype(np.uint8)
    experts[mask == 0] = 0
    return Group(np.r_[0, np.cumsum(lengths)], {ROUTED_EXPERTS_FIELD: experts, "loss_mask": mask})


def test_routed_tensors_pad_rows_like_the_token_ids_and_mask_by_the_loss_mask() -> None:
    groups = [_group([5, 3], prompt=2, start=0), _group([4], prompt=1, start=100)]
    experts, mask = routed_tensors(groups, width=6)
    assert experts.shape == (3, 6, 2, 2) and experts.dtype == torch.uint8 and mask.dtype == torch.bool
    assert mask.sum(1).tolist() == [3, 1, 3]
    assert torch.equal(experts[1, :3], torch.from_numpy(groups[0].token_fields[ROUTED_EXPERTS_FIELD][5:8]))
    assert torch.equal(experts[2, :4], torch.from_numpy(groups[1].token_fields[ROUTED_EXPERTS_FIELD]))
    assert not experts[:, 5:].any() and not experts[1, 3:].any()


def test_a_group_without_experts_or_of_another_shape_is_refused() -> None:
    bare = Group(np.array([0, 3]), {"loss_mask": np.ones(3, np.uint8)}, {"group": "bare"})
    with pytest.raises(ValueError, match="group bare carries no routed_experts"):
        routed_tensors([_group([3], 1, 0), bare], width=3)
    other = _group([3], 1, 0)
    other.token_fields[ROUTED_EXPERTS_FIELD] = np.zeros((3, 4, 2), np.uint8)
    with pytest.raises(ValueError, match="one model"):
        routed_tensors([_group([3], 1, 0), other], width=3)


def test_routing_metrics() -> None:
    seen = RoutingAgreement(2)
    seen.used, seen.own, seen.positions = torch.tensor([0.0, 0.0]), torch.tensor([2.0, 6.0]), 8
    assert routing_metrics(seen) == {"router_disagreement": 0.0, "router_disagreement_max": 0.0,
                                     "router_drift": 0.5}
