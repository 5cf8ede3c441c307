"""Routing replay in the learner's step: the recorded experts of a step's rows as tensors, the forward that
compares (and, with `routing_replay = "rollout"`, replays) them, and the router metrics (`stages.data.routing`
does the replay itself). `check_routing_replay` is the setting's check before a run.

The setting (`GRPOLearner.routing_replay`): "off" routes every forward by the learner's own router;
"rollout" routes the tokens an engine generated to the experts it recorded for them (R3), in the policy's
forward, which also gives the proximal logprobs, and in the reference's. Either way, a step whose groups all
carry experts reports the router metrics (`routing_metrics`) and `logprob_gap`.

A row's experts come from the codec token field `ROUTED_EXPERTS_FIELD` ([tokens, moe layers, top_k], one
entry per token, meaningful where `loss_mask` is 1: the tokens an engine generated); `routed_tensors`
pads them like `stages.learner.step.batch_tensors` pads the token ids, and the mask is the loss mask, so
`stages.data.routing.inputs_of_tokens` moves both to the positions a replayed forward routes.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from buffers.codec import RolloutBatch
from stages.data.routing import ROUTED_EXPERTS_FIELD, RoutingAgreement, folder_moe_layout, recorded_routing

RoutingReplay = Literal["off", "rollout"]
ROUTING_REPLAYS: tuple[str, ...] = ("off", "rollout")
LAYER_SHARE = "router_share/"  # a micro-batch's per-layer shares: "router_share/{used|own}/{layer}"


def check_routing_replay(model_path: str | Path | None, replay: str, engine_returns_experts: bool) -> None:
    """ValueError naming `learner.routing_replay` and the fix unless the setting can work: a known value, and
    with "rollout" a mixture-of-experts model (its folder's config) and an engine that returns the experts it
    routed each token to (`stages.engines.base.returns_routed_experts`). Reads the config only; `model_path`
    None: a model known to be an MoE that is not made yet."""
    if replay not in ROUTING_REPLAYS:
        raise ValueError(f"learner.routing_replay must be one of {', '.join(ROUTING_REPLAYS)}, got {replay!r}")
    if replay == "off":
        return
    if model_path is not None and folder_moe_layout(model_path) is None:
        raise ValueError(f"learner.routing_replay = 'rollout' replays the experts each token was routed to, but "
                         f"the model in {str(model_path)!r} is dense (its config has no routed experts): set "
                         "learner.routing_replay = 'off', or train a mixture-of-experts model")
    if not engine_returns_experts:
        raise ValueError("learner.routing_replay = 'rollout' needs the experts the engine routed each token to, "
                         "and this engine cannot return them: set learner.routing_replay = 'off', or use an "
                         "engine that returns routed experts (engine.kind = 'torch' or 'sglang')")


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


def routed_forward(model: torch.nn.Module, routing: tuple[torch.Tensor, torch.Tensor] | None,
                   replay: bool) -> AbstractContextManager[RoutingAgreement | None]:
    """`recorded_routing` of `model` over `routing` (the input-position experts and mask of
    `stages.data.routing.inputs_of_tokens`); with no routing, a block that changes nothing and sees None."""
    if routing is None:
        return nullcontext(None)
    return recorded_routing(model, *routing, replay=replay)


def routing_metrics(seen: RoutingAgreement) -> dict[str, float]:
    """A step's router metrics: `router_disagreement` (mean over MoE layers of the share of recorded tokens
    routed to other experts than the rollout's: 0 under replay), its worst layer, and `router_drift` (the
    same share for the learner's own top-k, what replay overrides)."""
    return _metrics(seen.disagreement(), seen.own_disagreement())


def _metrics(used: list[float], own: list[float]) -> dict[str, float]:
    return {"router_disagreement": round(float(np.mean(used)), 6),
            "router_disagreement_max": round(max(used), 6),
            "router_drift": round(float(np.mean(own)), 6)}


def layer_shares(seen: RoutingAgreement | None, layers: int) -> dict[str, float]:
    """One micro-batch's per-layer shares as diagnostics (zeros for a pass that saw no routing: an empty
    one). Weighted by the micro-batch's trained tokens (its masked positions) and summed over micro-batches
    and ranks, they give the step's shares exactly; `fold_layer_shares` turns them into the metrics."""
    used = seen.disagreement() if seen is not None else [0.0] * layers
    own = seen.own_disagreement() if seen is not None else [0.0] * layers
    return {**{f"{LAYER_SHARE}used/{j}": u for j, u in enumerate(used)},
            **{f"{LAYER_SHARE}own/{j}": o for j, o in enumerate(own)}}


def fold_layer_shares(info: dict[str, float]) -> dict[str, float]:
    """`info` with the step's per-layer shares (`layer_shares`, aggregated) replaced by `routing_metrics`."""
    shares = {k: v for k, v in info.items() if k.startswith(LAYER_SHARE)}
    if not shares:
        return info
    layers = len(shares) // 2
    used = [shares[f"{LAYER_SHARE}used/{j}"] for j in range(layers)]
    own = [shares[f"{LAYER_SHARE}own/{j}"] for j in range(layers)]
    return {**{k: v for k, v in info.items() if k not in shares}, **_metrics(used, own)}
