"""Routing replay in the learner's step: the recorded experts of a step's rows as tensors, and the router
metrics of a forward (`stages.data.routing` does the replay itself).

A row's experts come from the codec token field `ROUTED_EXPERTS_FIELD` ([tokens, moe layers, top_k], one
entry per token, meaningful where `loss_mask` is 1: the tokens an engine generated); `routed_tensors`
pads them like `stages.learner.step.batch_tensors` pads the token ids, and the mask is the loss mask, so
`stages.data.routing.inputs_of_tokens` moves both to the positions a replayed forward routes.
"""

from __future__ import annotations

import numpy as np
import torch

from buffers.codec import RolloutBatch
from stages.data.routing import ROUTED_EXPERTS_FIELD, RoutingAgreement


def routed_tensors(batches: list[RolloutBatch], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's recorded experts, [rows, width, moe layers, top_k] in their stored type (0 on padding), and
    where they were recorded, bool [rows, width] (the loss mask). ValueError naming the first group without
    them: replay needs every group's experts (an engine that returns them, `returns_routed_experts`)."""
    missing = [b.meta.get("group", "?") for b in batches if ROUTED_EXPERTS_FIELD not in b.token_fields]
    if missing:
        raise ValueError(f"routing replay is on, but group {missing[0]} carries no {ROUTED_EXPERTS_FIELD}: "
                         "its engine did not return the experts it routed to")
    first = batches[0].token_fields[ROUTED_EXPERTS_FIELD]
    inner, rows = first.shape[1:], sum(b.rows for b in batches)
    experts = np.zeros((rows, width, *inner), dtype=first.dtype)
    mask = np.zeros((rows, width), dtype=bool)
    i = 0
    for b in batches:
        values, loss_mask = b.token_fields[ROUTED_EXPERTS_FIELD], b.token_fields["loss_mask"]
        if values.shape[1:] != inner:
            raise ValueError(f"group {b.meta.get('group', '?')} carries experts of shape {values.shape[1:]}, "
                             f"another group {inner}: one model routes them all")
        for lo, hi in zip(b.offsets[:-1], b.offsets[1:], strict=True):
            experts[i, : hi - lo] = values[lo:hi]
            mask[i, : hi - lo] = loss_mask[lo:hi]
            i += 1
    return torch.from_numpy(experts), torch.from_numpy(mask)


def routing_metrics(seen: RoutingAgreement) -> dict[str, float]:
    """A step's router metrics: `router_disagreement` (mean over MoE layers of the share of recorded tokens
    routed to other experts than the rollout's: 0 under replay), its worst layer, and `router_drift` (the
    same share for the learner's own top-k, what replay overrides)."""
    used, own = seen.disagreement(), seen.own_disagreement()
    return {"router_disagreement": round(float(np.mean(used)), 6),
            "router_disagreement_max": round(max(used), 6),
            "router_drift": round(float(np.mean(own)), 6)}
