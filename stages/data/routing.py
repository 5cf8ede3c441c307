"""Mixture-of-experts routing: a model's expert layout, capturing the experts each token was routed to,
and replaying recorded experts in another forward (routing replay, R3).

Supported: the Qwen MoE families of transformers 5 (Qwen3-MoE, Qwen2-MoE), whose MoE layers keep their
router at `model.model.layers[i].mlp.gate`, a module that returns `(router_logits [tokens, E], scores
[tokens, k], indices [tokens, k])` for the flattened batch (`tokens = batch x seq`, row-major), and whose
experts module takes `(hidden, indices, scores)`. Everything here is a forward hook on those routers: a
dense model (`moe_layout` None) gets none, so its forwards cost nothing extra.

- `RoutingCapture` keeps the indices each router chose in the latest forward (the torch engine records
  every generated token's experts with it; a learner forward gives its own routing with it).
- `recorded_routing` (and its shorthand `replay_routing`) forces each masked token's indices to recorded
  ones; the scores stay a function of the model's own router: the softmax of its logits gathered at the
  recorded experts (renormalised over them when `norm_topk_prob`), so the router still trains. Unmasked
  tokens (prompt, padding) keep their own top-k. At the weights that recorded the experts the forward is
  bit-identical to a plain one. It counts, per MoE layer, the masked tokens whose own top-k set differs
  from the recorded set (`router_disagreement`), with replay on or off.

Recorded experts are indexed by INPUT position: the experts at position t are the routing of token t's
hidden state. An engine records, for each generated token, the routing of the position whose logits
sampled it (the one before it): see `stages.engines.torch_batch.Request`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# the codec token field that carries each token's routed experts from the producer to the learner:
# [tokens, moe layers, top_k] (the layout's id type), zeros where `loss_mask` is 0 (prompt, environment tokens)
ROUTED_EXPERTS_FIELD = "routed_experts"


@dataclass(frozen=True)
class MoELayout:
    """Which decoder layers are mixtures of experts, and their shape (every MoE layer has the same)."""

    layers: tuple[int, ...]  # decoder layer indices, increasing
    experts: int
    top_k: int
    norm_topk_prob: bool

    @property
    def id_dtype(self) -> type[np.integer]:
        """The smallest integer type that holds every expert id (uint8 up to 256 experts)."""
        return np.uint8 if self.experts <= 256 else np.int16

    @property
    def bytes_per_token(self) -> int:
        """What a token's routed experts cost in a rollout payload (the `ROUTED_EXPERTS_FIELD` column)."""
        return len(self.layers) * self.top_k * np.dtype(self.id_dtype).itemsize


def moe_layout(model_or_config) -> MoELayout | None:
    """The expert layout of a model or its config (a transformers model, a `PretrainedConfig`); None when
    it has no routed experts (a dense model). Layers follow transformers' own rule: layer i is sparse
    unless it is in `mlp_only_layers`, when (i + 1) is a multiple of `decoder_sparse_step`."""
    config = getattr(model_or_config, "config", model_or_config)
    config = getattr(config, "text_config", None) or config
    experts = int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0) or 0)
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    if experts <= 0 or top_k <= 0:
        return None
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    layers = tuple(i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    if not layers:
        return None
    return MoELayout(layers, experts, top_k, bool(getattr(config, "norm_topk_prob", False)))


def folder_moe_layout(folder: str | Path) -> MoELayout | None:
    """The expert layout of the model in a local folder, from its config.json alone (no weights read); None
    for a dense model, or a folder without a readable config (the model checks say what is wrong with it)."""
    from transformers import AutoConfig

    if not (Path(folder) / "config.json").is_file():  # never a hub id: nothing is downloaded
        return None
    try:
        return moe_layout(AutoConfig.from_pretrained(folder))
    except (OSError, ValueError, KeyError):
        return None


def routers(model: torch.nn.Module, layout: MoELayout) -> list[torch.nn.Module]:
    """The router module of each MoE layer of `layout`, in order (ValueError when the model keeps its
    routers elsewhere than the Qwen MoE families do). A peft model's are its base model's (LoRA never wraps them)."""
    if hasattr(model, "get_base_model"):  # a peft PeftModel
        model = model.get_base_model()
    base = getattr(model, "model", model)
    try:
        found = [base.layers[i].mlp.gate for i in layout.layers]
    except (AttributeError, IndexError) as exc:
        raise ValueError(f"{type(model).__name__} keeps its routers elsewhere than layers[i].mlp.gate ({exc}): "
                         "routing capture and replay support the Qwen MoE families") from None
    return found


class RoutingCapture:
    """Forward hooks that keep the experts each MoE layer's router chose in the latest forward of `model`
    (only forwards run by the thread that made the capture or last called `own_thread`). `remove` them
    when done."""

    def __init__(self, model: torch.nn.Module, layout: MoELayout) -> None:
        self.layout = layout
        self._latest: list[torch.Tensor | None] = [None] * len(layout.layers)
        self._thread = threading.get_ident()
        self._handles = [gate.register_forward_hook(self._hook(j)) for j, gate in enumerate(routers(model, layout))]

    def _hook(self, j: int):
        def keep(module, args, output) -> None:
            if threading.get_ident() == self._thread:
                self._latest[j] = output[2]
        return keep

    def own_thread(self) -> None:
        """Record the forwards of the calling thread from now on (the engine's decode thread)."""
        self._thread = threading.get_ident()

    def all_positions(self, rows: int) -> torch.Tensor:
        """The latest forward's experts, [rows, seq, moe layers, top_k] (int64, on the model's device)."""
        if any(t is None for t in self._latest):
            raise RuntimeError("no forward has run since the capture was installed")
        return torch.stack([t.view(rows, -1, self.layout.top_k) for t in self._latest], 2)

    def last_position(self, rows: int) -> torch.Tensor:
        """The latest forward's experts at each row's last position, [rows, moe layers, top_k]."""
        return self.all_positions(rows)[:, -1]

    def last_ids(self, rows: int) -> np.ndarray:
        """`last_position` on the CPU as the layout's id type (what a completion carries)."""
        return self.last_position(rows).to("cpu").numpy().astype(self.layout.id_dtype)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def inputs_of_tokens(experts: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token recorded experts ([batch, seq, layers, top_k], token t's at column t, as a completion
    carries them, `mask` true on the tokens that have them) moved to the input positions a replayed forward
    needs them at: token t's experts route position t - 1, the one whose logits give token t's logprob.
    The last position gets none (its logits predict nothing the loss reads)."""
    shifted = torch.cat([experts[:, 1:], torch.zeros_like(experts[:, :1])], 1)
    where = torch.cat([mask[:, 1:].bool(), torch.zeros_like(mask[:, :1], dtype=torch.bool)], 1)
    return shifted, where


def own_routing(model: torch.nn.Module, **inputs) -> torch.Tensor:
    """The experts `model` itself routes each input position to, [batch, seq, moe layers, top_k] (int64):
    one no-grad forward of `inputs` (input_ids [batch, seq], attention_mask ...)."""
    layout = moe_layout(model)
    if layout is None:
        raise ValueError("own_routing needs a mixture-of-experts model; this one is dense")
    capture = RoutingCapture(model, layout)
    try:
        with torch.no_grad():
            model(**inputs)
        return capture.all_positions(inputs["input_ids"].shape[0])
    finally:
        capture.remove()


def router_disagreement(own: torch.Tensor, recorded: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per MoE layer, the share of masked positions whose top-k SET in `own` differs from `recorded` (both
    [..., layers, top_k]; `mask` [...]), float [layers]; zeros when nothing is masked."""
    counts = _differing(own, recorded, mask)
    return counts / max(int(mask.bool().sum()), 1)


def _differing(own: torch.Tensor, recorded: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """How many masked positions route to another expert set: `own`, `recorded` [*positions, *rest, top_k]
    and `mask` [*positions] give float [*rest] (rest: the layers, or nothing for one layer)."""
    differ = (own.sort(-1).values != recorded.to(own.device, own.dtype).sort(-1).values).any(-1)
    where = mask.to(own.device).bool()
    where = where.reshape(where.shape + (1,) * (differ.dim() - where.dim()))
    return (differ & where).sum(tuple(range(mask.dim()))).float()


class RoutingAgreement:
    """What `recorded_routing` saw over its forwards, per MoE layer: masked positions whose expert set
    differed from the recorded one, as routed (`used`: 0 under replay) and as the model's own router would
    route them (`own`), and masked positions in all (a recomputed forward counts twice in each, which
    keeps the shares). The counts stay on the model's device until a share is asked for: no device sync
    per layer."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.used: torch.Tensor | None = None  # float [layers], once a forward ran
        self.own: torch.Tensor | None = None
        self.positions: int | torch.Tensor = 0

    def add(self, layer: int, own: torch.Tensor, used: torch.Tensor, positions: torch.Tensor | None) -> None:
        """Count one router's forward (`positions`: the forward's masked positions, given by its first layer)."""
        if self.used is None or self.own is None:
            self.used = torch.zeros(self.layers, device=own.device)
            self.own = torch.zeros(self.layers, device=own.device)
        self.own[layer] += own
        self.used[layer] += used
        if positions is not None:
            self.positions = self.positions + positions

    def disagreement(self) -> list[float]:
        """Per MoE layer, the share of masked positions the forward routed to other experts than recorded
        (the router disagreement metric: replay makes it 0)."""
        return self._shares(self.used)

    def own_disagreement(self) -> list[float]:
        """Per MoE layer, the share of masked positions whose own top-k differs from the recorded experts
        (equal to `disagreement` without replay; with it, how far the router has moved from the rollout's)."""
        return self._shares(self.own)

    def _shares(self, counts: torch.Tensor | None) -> list[float]:
        if counts is None:
            return [0.0] * self.layers
        return (counts.cpu() / max(int(self.positions), 1)).tolist()


@contextmanager
def recorded_routing(model: torch.nn.Module, experts: torch.Tensor, mask: torch.Tensor,
                     replay: bool = True) -> Iterator[RoutingAgreement]:
    """Within the block, every forward of `model` over [batch, seq] inputs compares its routing with
    `experts` (recorded, [batch, seq, moe layers, top_k], any integer type) at the positions of `mask`
    ([batch, seq], true where experts were recorded) and, when `replay`, routes those positions to the
    recorded experts (see the module docstring). A forward over another number of positions raises
    ValueError."""
    layout = moe_layout(model)
    if layout is None:
        raise ValueError("routing replay needs a mixture-of-experts model; this one is dense")
    batch, seq = mask.shape
    if tuple(experts.shape) != (batch, seq, len(layout.layers), layout.top_k):
        raise ValueError(f"recorded experts have shape {tuple(experts.shape)}; this model and mask need "
                         f"{(batch, seq, len(layout.layers), layout.top_k)} (batch, seq, moe layers, top_k)")
    flat_mask = mask.reshape(-1).bool()
    flat = experts.reshape(batch * seq, len(layout.layers), layout.top_k)  # as stored (uint8): int64 per layer
    seen = RoutingAgreement(len(layout.layers))
    hooks = [gate.register_forward_hook(_replay_hook(flat[:, j], flat_mask, j, layout, seen, replay))
             for j, gate in enumerate(routers(model, layout))]
    try:
        yield seen
    finally:
        for handle in hooks:
            handle.remove()


def replay_routing(model: torch.nn.Module, experts: torch.Tensor, mask: torch.Tensor):
    """`recorded_routing` with replay on: the masked positions use the recorded experts."""
    return recorded_routing(model, experts, mask, replay=True)


def _replay_hook(recorded: torch.Tensor, mask: torch.Tensor, layer: int, layout: MoELayout,
                 seen: RoutingAgreement, replay: bool):
    def hook(module, args, output):
        logits, scores, own = output
        if own.shape[0] != recorded.shape[0]:
            raise ValueError(f"a forward over {own.shape[0]} positions, but the recorded experts cover "
                             f"{recorded.shape[0]} (batch x seq)")
        here, where = recorded.to(own.device, own.dtype), mask.to(own.device)
        own_differing = _differing(own, here, where)
        indices = torch.where(where[:, None], here, own) if replay else own
        used = _differing(indices, here, where) if replay else own_differing
        seen.add(layer, own_differing, used, where.sum() if layer == 0 else None)
        if not replay:
            return None
        weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, indices)
        if layout.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), indices
    return hook
