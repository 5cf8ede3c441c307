"""`TrainingModel`: one client's model on the learner's own trainer (`stages.learner.step.PolicyTrainer`). With a
`LoraSpec` the base is loaded and wrapped with peft, the AdamW is over the adapter alone, and a sampler's weights
are the adapter with its probe; without one (full fine-tuning) every weight is trained, and a sampler's weights are
the whole state dict, written to a safetensors file (`stages.weights.disk`) so that no copy of it stays in memory.

Tinker splits a step into calls: `forward_backward` adds the gradient of its datums' loss to what earlier calls
left (a sum, as Tinker's losses are sums), `optim_step` takes one AdamW step with the client's parameters and
clears the gradient; `forward` computes the same outputs without a gradient. The calls of one model run one at a
time, in the order they arrived (the service holds the model's lock around each).

Invariant: a `forward_backward` + `optim_step` here is the learner's step on the same rows: the logprobs come
from the same forward (`logprobs_of`), the policy-gradient losses are the learner's objectives
(`stages.service.losses`), and the optimizer is the trainer's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from stages.learner import GRPOLearner
from stages.learner.lora import LoraSpec
from stages.learner.sharding import clip_grad_norm
from stages.learner.step import PolicyTrainer
from stages.service.losses import INPUTS, loss_of
from stages.service.wire import Datum
from stages.weights.adapter import AdapterVersion, as_received
from stages.weights.disk import DiskNotice, write_weights

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
LORA_ALPHA = 32.0  # the adapter's output scale is alpha / rank
# how far a sampler's probe logprob may be from the learner's (relative beyond 1). The learner's default (1e-4)
# held for baton's own runs; a client's loop may train its adapter much further (alpha 32, its own lr), and the
# engine's merged weights (W + s BA) then round apart from peft's W x + s B(A x) by more: 3.0e-4 was seen after
# 172 RL steps at lr 2e-3, and the sampler refused a good adapter. The probe still refuses a sampler that serves
# the base or another version once the adapters differ by more than this in the probe's logprobs.
PROBE_TOLERANCE = 1e-3


def lora_spec(rank: int, train_attn: bool, train_mlp: bool, train_unembed: bool) -> LoraSpec:
    """The learner's `LoraSpec` for a Tinker `LoraConfig`: attention, MLP and unembedding as module names."""
    targets = ATTENTION * train_attn + MLP * train_mlp + ("lm_head",) * train_unembed
    return LoraSpec(rank=rank, alpha=LORA_ALPHA, target_modules=targets, check_tolerance=PROBE_TOLERANCE)


@dataclass(frozen=True)
class AdamSettings:
    """Tinker's `AdamParams` (its defaults: beta2 0.95, eps 1e-12; grad_clip_norm 0 clips nothing)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


def padded(data: list[Datum]) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The datums' tokens [rows, T] (right-padded), the 0/1 mask of real positions, and each loss input [rows, T]."""
    width = max(d.tokens.size for d in data)
    ids = torch.zeros((len(data), width), dtype=torch.long)
    mask = torch.zeros((len(data), width))
    inputs = {name: torch.zeros((len(data), width), dtype=torch.long if name == "target_tokens" else torch.float32)
              for name in data[0].inputs}
    for i, datum in enumerate(data):
        n = datum.tokens.size
        ids[i, :n], mask[i, :n] = torch.from_numpy(datum.tokens), 1.0
        for name, values in datum.inputs.items():
            inputs[name][i, :n] = torch.from_numpy(values.copy())
    return ids, mask, inputs


def dummy_datum(loss_fn: str) -> Datum:
    """Two tokens with every input of `loss_fn` zero: a rank without datums runs this row, masked out."""
    return Datum(np.zeros(2, dtype=np.int64), {name: np.zeros(2, dtype=np.int64 if name == "target_tokens" else
                                                             np.float32) for name in INPUTS[loss_fn]})


@dataclass
class Part:
    """One rank's share of a forward(_backward): its datums' logprobs, sum-loss, loss stats (token means) and
    the count of real positions they are over."""

    rows: list[np.ndarray]
    loss: float
    stats: dict[str, float]
    tokens: float


def metrics_of(parts: list[Part]) -> dict[str, float]:
    """The metrics of a forward(_backward) from every rank's part: `loss:sum` summed, each stat (a token mean)
    as `NAME:mean` over every rank's tokens."""
    tokens = max(sum(p.tokens for p in parts), 1.0)
    names = sorted({k for p in parts for k in p.stats})
    means = {f"{k}:mean": sum(p.stats.get(k, 0.0) * p.tokens for p in parts) / tokens for k in names}
    return {"loss:sum": sum(p.loss for p in parts), **means}


def logprobs_of(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target_i | tokens_0..i) at every position [rows, T], in float32, as the learner's step computes them."""
    logits = model(input_ids=ids, attention_mask=mask.long()).logits.float()
    return torch.log_softmax(logits, -1).gather(2, targets[:, :, None]).squeeze(-1)


class TrainingModel:
    """One `create_model`'s model over the base folder `model_path`: LoRA with `lora`, full fine-tuning without
    (see the module docstring). With `world_size` > 1 this is one rank's trainer of a model sharded over the
    service's ranks (FSDP2; `stages.service.ranked` drives every rank's calls in the same order)."""

    def __init__(self, model_path: Path, lora: LoraSpec | None, device: str = "cpu", world_size: int = 1) -> None:
        self.lora, self.world_size = lora, world_size
        spec = GRPOLearner(model_path, lora=lora, device=device, entropy_coef=0.0, world_size=world_size)
        self.trainer = PolicyTrainer(spec, steps=1, world_size=world_size)
        self.steps = 0  # optimizer steps taken: the version a sampler saved now serves

    def forward_backward(self, data: list[Datum], loss_fn: str, settings: dict[str, float],
                         backward: bool) -> tuple[list[np.ndarray], dict[str, float]]:
        """Each datum's target logprobs and the metrics (`loss:sum`, ...); with `backward`, the loss's gradient
        added to the model's (this process is the whole model: world size 1)."""
        part = self.part(data, loss_fn, settings, backward)
        return part.rows, metrics_of([part])

    def part(self, data: list[Datum], loss_fn: str, settings: dict[str, float], backward: bool) -> Part:
        """This rank's share of a forward(_backward): its datums' target logprobs, their sum-loss and stats; with
        `backward` the gradient of that sum-loss times the world size (FSDP2 averages the ranks' gradients, and
        Tinker's losses are sums: the ranks' shares must add up to the whole batch's gradient). No datums: one
        masked dummy row, so that this rank runs the pass's collectives with the others and adds nothing."""
        device = self.trainer.device
        ids, mask, inputs = padded(data or [dummy_datum(loss_fn)])
        if not data:
            mask.zero_()
        ids, mask = ids.to(device), mask.to(device)
        inputs = {k: v.to(device) for k, v in inputs.items()}
        with torch.set_grad_enabled(backward):
            logp = logprobs_of(self.trainer.model, ids, mask, inputs["target_tokens"])
            loss, stats = loss_of(loss_fn, settings, logp, inputs, mask)
            if backward:
                (loss * self.world_size).backward()
        rows = [logp[i, : d.tokens.size].detach().cpu().numpy() for i, d in enumerate(data)]
        return Part(rows, float(loss.detach()), stats, float(mask.sum()))

    def write_state(self, folder: Path) -> None:
        """The learner's checkpoint of this model (`PolicyTrainer.write_state`; a collective when sharded)."""
        self.trainer.write_state(folder, self.steps)

    def read_state(self, folder: Path, optimizer: bool) -> None:
        """Load a checkpoint `write_state` wrote (at any world size): its weights, and its AdamW moments when
        `optimizer` (else AdamW starts afresh)."""
        self.steps = self.trainer.read_state(folder)
        if not optimizer:
            self.trainer.optimizer.state.clear()

    def optim_step(self, adam: AdamSettings) -> dict[str, float]:
        """One AdamW step on the gradient the `forward_backward` calls since the last step summed; clears it."""
        for group in self.trainer.optimizer.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                         weight_decay=adam.weight_decay)
        norm = clip_grad_norm(self.trainer.model, adam.grad_clip_norm if adam.grad_clip_norm > 0 else float("inf"))
        self.trainer.optimizer.step()
        self.trainer.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm:mean": norm, "learning_rate:mean": adam.learning_rate}

    def adapter(self) -> AdapterVersion:
        """The adapter as it is now, with its probe, as an engine receives a version (LoRA models only)."""
        assert self.lora is not None, "a full fine-tuning model has no adapter"
        received = as_received(self.trainer.weights(self.steps))
        assert isinstance(received, AdapterVersion)
        return received

    def load_into(self, model: torch.nn.Module) -> int:
        """Copy every weight of this (fully fine-tuned) model into `model`, one of the same base; returns the
        version they are (`export_model`'s fill). Sharded: gathered whole to rank 0 (a collective)."""
        model.load_state_dict(self.trainer.weights(self.steps))
        return self.steps

    def sampler_weights(self, folder: Path) -> AdapterVersion | DiskNotice:
        """The weights a sampler saved now serves: the adapter (kept in memory: it is small), or, fully fine-tuned,
        every weight written to `folder/model.safetensors` (tied ones once), named by its file and checksum."""
        if self.lora is not None:
            return self.adapter()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "model.safetensors"
        return DiskNotice(self.steps, str(path), write_weights(path, self.trainer.weights(self.steps)))
