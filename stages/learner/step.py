"""`PolicyTrainer`: the model, its optimizer and one version's optimizer step(s).

A step on a list of decoded groups (`RolloutBatch`es):
1. pads their rows into [rows, T] tensors (token ids, behaviour logprobs, loss mask, attention mask)
   and computes group-centred advantages (divided by the group's std with `norm_adv_by_std`);
2. per PPO epoch: forward, the configured off-policy objective (`policies.correction`) against the
   behaviour logprobs and the proximal policy (the weights at the step's start: epoch 0's forward),
   aggregated over the loss mask as `loss_agg_mode` says, minus `entropy_coef` x entropy (of every row,
   or only of the rows of groups without signal), plus `kl_coef` x the k3 KL to the initial weights;
   clip gradients, take an AdamW step at the scheduled learning rate scaled for the batch's mean
   staleness (`staleness_lr_factor`), and step the scheduler once per version.
It returns the loss and the diagnostics the metrics record carries. The step is pure compute: it runs
in a worker thread while the actor's event loop keeps receiving the next groups.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from buffers.codec import RolloutBatch
from stages.data.model import load_model
from stages.learner.losses import (
    aggregate,
    entropy_bonus_rows,
    group_advantages,
    kl_k3,
    lr_scheduler,
    staleness_lr_factor,
    token_entropy,
    zero_variance_fraction,
)
from stages.learner.state import read_learner_state, write_learner_state


def episode_metrics(batches: list[RolloutBatch]) -> dict[str, float]:
    """Multi-turn episodes' numbers over a step's batches: `turns_mean`, and per number an environment
    reported (row fields `info/<name>`, NaN where an episode had none) its mean as `episode/<name>`."""
    turns = [b.row_fields["turns"] for b in batches if "turns" in b.row_fields]
    if not turns:
        return {}
    out = {"turns_mean": round(float(np.mean(np.concatenate(turns))), 4)}
    for name in sorted({f for b in batches for f in b.row_fields if f.startswith("info/")}):
        values = np.concatenate([b.row_fields[name] for b in batches if name in b.row_fields])
        if np.isfinite(values).any():
            out[f"episode/{name[len('info/'):]}"] = round(float(np.nanmean(values)), 4)
    return out


def batch_tensors(batches: list[RolloutBatch]) -> tuple[torch.Tensor, ...]:
    """The step's rows, padded to the longest: token ids, behaviour logprobs, loss mask, attention mask
    ([rows, T] each), and per row its reward and the index of its group ([rows] each)."""
    width = max(int(np.diff(b.offsets).max()) for b in batches)
    n = sum(b.rows for b in batches)
    ids = torch.zeros((n, width), dtype=torch.long)
    old, mask = torch.zeros((n, width)), torch.zeros((n, width))
    attn = torch.zeros((n, width), dtype=torch.long)
    rewards, group_index = torch.zeros(n), torch.zeros(n, dtype=torch.long)
    i = 0
    for g, b in enumerate(batches):
        for j in range(b.rows):
            row = b.row(j)
            k = len(row["tokens"])
            ids[i, :k] = torch.from_numpy(row["tokens"].astype(np.int64))
            old[i, :k] = torch.from_numpy(row["logprobs"].copy())
            mask[i, :k] = torch.from_numpy(row["loss_mask"].astype(np.float32))
            attn[i, :k] = 1
            rewards[i] = float(b.row_fields["rewards"][j])
            group_index[i] = g
            i += 1
    return ids, old, mask, attn, rewards, group_index


def pick_device(device: str) -> torch.device:
    """"auto": cuda when a GPU is visible, else cpu."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


class PolicyTrainer:
    """The policy being trained, its optimizer and lr schedule (see the module docstring). `spec` is the
    learner's config (`stages.learner.GRPOLearner`)."""

    def __init__(self, spec: Any, steps: int) -> None:
        self.spec, self.steps = spec, steps
        self.device = pick_device(spec.device)
        self.model = load_model(spec.model_path).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
        self.reference: torch.nn.Module | None = None  # the initial weights, for the KL penalty (kl_coef > 0)
        if spec.kl_coef > 0:  # the model folder holds the initial weights, also on resume
            self.reference = load_model(spec.model_path).to(self.device).requires_grad_(False)
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None

    def schedule(self, version: int) -> None:
        """The learning-rate schedule, at `version` (0, or a checkpoint's): a function of the version alone."""
        spec = self.spec
        for group in self.optimizer.param_groups:
            group["initial_lr"] = spec.lr
        self.scheduler = lr_scheduler(self.optimizer, spec.lr_warmup_steps, self.steps, spec.lr_decay,
                                      spec.min_lr_ratio, start=version)

    def weights(self) -> dict[str, torch.Tensor]:
        """The weights to publish: the full state dict."""
        return self.model.state_dict()

    def write_state(self, folder: Path, version: int) -> None:
        write_learner_state(folder, version, self.model, self.optimizer, self.spec.selection)

    def read_state(self, folder: Path) -> int:
        """Load a checkpoint's learner state; returns its version."""
        return read_learner_state(folder, self.model, self.optimizer, self.spec.selection)

    def step(self, batches: list[RolloutBatch], mean_staleness: float = 0.0) -> dict[str, float]:
        """One version's optimizer step(s) on `batches`; the loss and the diagnostics for the metrics."""
        model, opt, spec = self.model, self.optimizer, self.spec
        ids, old, mask, attn, rewards, group_index = batch_tensors(batches)
        ids, old, mask, attn = (t.to(self.device) for t in (ids, old, mask, attn))
        adv = group_advantages(rewards, group_index, scale_by_std=spec.norm_adv_by_std)[:, None].to(self.device)
        reduce = partial(aggregate, mode=spec.loss_agg_mode, max_tokens=spec.loss_max_tokens)
        m = mask[:, 1:]
        reference = self._reference_logprobs(ids, attn) if self.reference is not None else None
        bonus_rows = entropy_bonus_rows(rewards, group_index, spec.entropy_scope)[:, None].to(self.device)
        proximal: torch.Tensor | None = None
        lr_scale = staleness_lr_factor(mean_staleness, spec.lr_tuned_staleness, spec.lr_staleness_power)
        for group in opt.param_groups:  # the scheduler sets each step's lr afresh, so this lasts one step
            group["lr"] *= lr_scale
        lr = opt.param_groups[0]["lr"]
        for epoch in range(spec.epochs):  # PPO epochs: later passes see ratios move away from 1, and clip
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / spec.temperature
            logp_all = torch.log_softmax(logits, -1)
            logp = logp_all.gather(2, ids[:, 1:, None]).squeeze(-1)
            if epoch == 0:  # the proximal policy: the weights at the step's start, before any update of them;
                proximal = logp.detach()  # epoch 0's forward runs on exactly those, so it costs no extra forward
            loss, info = spec.correction.loss(logp, old[:, 1:], proximal, adv, m, spec.clip_eps,
                                              spec.clip_eps_high, reduce)
            entropy = token_entropy(logp_all) if spec.entropy_coef > 0 else token_entropy(logp_all.detach())
            if spec.entropy_coef > 0:
                loss = loss - spec.entropy_coef * reduce(entropy * bonus_rows, m)
            if reference is not None:
                kl = reduce(kl_k3(logp, reference), m)
                loss = loss + spec.kl_coef * kl
                info["kl_ref"] = float(kl.detach())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
            opt.step()
        self.scheduler.step()
        info["entropy"] = float((entropy.detach() * m).sum() / m.sum().clamp(min=1))
        info["reward"] = round(float(np.mean([b.row_fields["rewards"].mean() for b in batches])), 4)  # per group
        info["zero_var_frac"] = round(zero_variance_fraction(rewards, group_index), 4)
        info["lr"] = lr
        info["lr_staleness_factor"] = round(lr_scale, 4)
        return {"loss": round(loss.item(), 5), "grad_norm": round(float(grad_norm), 4), **info,
                **episode_metrics(batches)}

    def _reference_logprobs(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Each token's logprob under the initial weights (the KL penalty's reference), without gradient."""
        with torch.no_grad():
            logits = self.reference(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / self.spec.temperature
            return torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None]).squeeze(-1)
