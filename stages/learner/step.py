"""`PolicyTrainer`: the model, its optimizer and one version's optimizer step(s), on one learner rank.

A step on a list of decoded groups (`RolloutBatch`es):
1. pads their rows into [rows, T] tensors (token ids, behaviour logprobs, loss mask, attention mask)
   and computes group-centred advantages (divided by the group's std with `norm_adv_by_std`); with
   on-policy distillation (`distill_coef` > 0) the advantages become per token: the teacher's term
   `-distill_coef * (behaviour - teacher logprob)` from the batch's `teacher_logprobs` field is added
   to them, or replaces them (`distill_mode = "loss"`; `losses.distill_advantages`);
2. per PPO epoch, per micro-batch (rows within `micro_batch_tokens` padded tokens): forward, the
   configured off-policy objective (`policies.correction`) against the behaviour logprobs and the
   proximal policy (the weights at the step's start: epoch 0's forward), aggregated over the loss
   mask as `loss_agg_mode` says, minus `entropy_coef` x entropy (each token's at most `entropy_cap`),
   plus `kl_coef` x the k3 KL to the initial weights; backward. Then clip gradients, take an AdamW step
   at the scheduled learning rate scaled for the batch's mean staleness (`staleness_lr_factor`); the
   scheduler steps once a version.

On a mixture-of-experts model whose groups carry the experts their engine routed each token to (the codec
field `routed_experts`), each micro-batch's forward and backward compare the learner's routing with the
recorded one, and with `routing_replay = "rollout"` route the generated tokens to the recorded experts
(`stages.learner.replay`); the step then reports the router metrics and `logprob_gap` (the mean |behaviour -
proximal| logprob over trained tokens). A dense model's step is unchanged.

Invariant: a step on N ranks is the step on one rank. Each rank trains whole groups (its share, split
by tokens: `stages.learner.ranks`), and every aggregation divides by the step's global count
(`StepPlan`: trained tokens or rows over all ranks, the longest row), so the ranks' gradients sum to
the one-rank gradient; FSDP2 averages them over ranks, so each rank's loss is scaled by the world size
for backward. Every rank runs the same number of forward/backward passes (`StepPlan.micro_batches`; a
rank with less data runs empty ones), as FSDP's collectives require. The step is pure compute: it runs
in a worker thread while the actor's event loop keeps receiving the next groups.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from buffers.codec import RolloutBatch
from policies.balance import micro_batches
from stages.data.routing import ROUTED_EXPERTS_FIELD, inputs_of_tokens, moe_layout
from stages.learner import sharding
from stages.learner.lora import AdapterPublisher
from stages.learner.losses import (
    aggregate,
    distill_advantages,
    entropy_bonus_rows,
    entropy_bonus_term,
    group_advantages,
    kl_k3,
    lr_scheduler,
    staleness_lr_factor,
    token_entropy,
    zero_variance_fraction,
)
from stages.learner.replay import (
    check_routing_replay,
    fold_layer_shares,
    layer_shares,
    routed_forward,
    routed_tensors,
)
from stages.learner.state import read_learner_state, write_learner_state

TEACHER_FIELD = "teacher_logprobs"  # the token field the producer's teacher writes (stages.scorers.teacher)


class StepPlan(msgspec.Struct, frozen=True):
    """What every rank of one step must agree on (rank 0 computes it from all the step's groups)."""

    mean_staleness: float
    tokens: float  # trained (masked) tokens over every rank's rows
    rows: float  # rows with a trained token, over every rank
    width: int  # loss positions of the longest row over every rank (its tokens minus one)
    micro_batches: int = 1  # forward/backward passes each rank runs per epoch
    routed: bool = False  # every group carries routed experts: every rank reports the router metrics


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


def scoring_metrics(batches: list[RolloutBatch]) -> dict[str, float]:
    """Model scoring's numbers over a step's batches: the mean seconds a group's scoring took (`scoring_s`,
    with model scorers), and with distillation the teacher log-ratio per model token, `behaviour -
    teacher` logprob, its mean and spread (`distill/log_ratio_mean`, `distill/log_ratio_std`)."""
    out: dict[str, float] = {}
    seconds = [b.row_fields["scoring_s"] for b in batches if "scoring_s" in b.row_fields]
    if seconds:
        out["scoring_s"] = round(float(np.mean(np.concatenate(seconds))), 5)
    taught = [b for b in batches if TEACHER_FIELD in b.token_fields]
    if taught:
        ratios = np.concatenate([(b.token_fields["logprobs"] - b.token_fields[TEACHER_FIELD])[
            b.token_fields["loss_mask"].astype(bool)] for b in taught])
        if ratios.size:
            out["distill/log_ratio_mean"] = round(float(ratios.mean()), 5)
            out["distill/log_ratio_std"] = round(float(ratios.std()), 5)
    return out


def group_figures(batches: list[RolloutBatch]) -> dict[str, float]:
    """What a step's metrics say of its groups: the mean reward per group, the fraction of groups whose
    rewards are all equal, the episodes' numbers (`episode_metrics`) and model scoring's (`scoring_metrics`)."""
    rewards = torch.from_numpy(np.concatenate([b.row_fields["rewards"] for b in batches]).astype(np.float32))
    group_index = torch.from_numpy(np.repeat(np.arange(len(batches)), [b.rows for b in batches]))
    return {"reward": round(float(np.mean([b.row_fields["rewards"].mean() for b in batches])), 4),
            "zero_var_frac": round(zero_variance_fraction(rewards, group_index), 4), **episode_metrics(batches),
            **scoring_metrics(batches)}


def teacher_tensor(batches: list[RolloutBatch], width: int) -> torch.Tensor:
    """The step's `teacher_logprobs`, [rows, width] like `batch_tensors`' logprobs; every group must carry them."""
    missing = [b.meta.get("group", "?") for b in batches if TEACHER_FIELD not in b.token_fields]
    if missing:
        raise ValueError(f"learner.distill_coef > 0, but group {missing[0]} has no {TEACHER_FIELD}: the producer "
                         "scores with a teacher only when the config has a [distill] table")
    teacher = torch.zeros((sum(b.rows for b in batches), width))
    i = 0
    for b in batches:
        values = b.token_fields[TEACHER_FIELD]
        for lo, hi in zip(b.offsets[:-1], b.offsets[1:], strict=True):
            teacher[i, : hi - lo] = torch.from_numpy(values[lo:hi].astype(np.float32))
            i += 1
    return teacher


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


def row_lengths(batches: list[RolloutBatch]) -> list[int]:
    """Every row's token count, in `batch_tensors` order."""
    return [int(n) for b in batches for n in np.diff(b.offsets)]


def trained_positions(batches: list[RolloutBatch]) -> list[int]:
    """Per row, how many of its tokens the loss trains: masked tokens after the first (the loss reads
    positions 1.. of each row)."""
    return [int(b.token_fields["loss_mask"][lo + 1:hi].sum()) for b in batches
            for lo, hi in zip(b.offsets[:-1], b.offsets[1:], strict=True)]


def plan_step(shares: list[list[RolloutBatch]], mean_staleness: float, max_tokens: int | None) -> StepPlan:
    """The plan of a step whose rank r trains the groups `shares[r]` (see the module docstring)."""
    trained = [n for share in shares for n in trained_positions(share)]
    lengths = [row_lengths(share) for share in shares]
    width = max((n for per_rank in lengths for n in per_rank), default=2) - 1
    passes = max((len(micro_batches(per_rank, max_tokens)) for per_rank in lengths), default=1)
    groups = [b for share in shares for b in share]
    routed = bool(groups) and all(ROUTED_EXPERTS_FIELD in b.token_fields for b in groups)
    return StepPlan(mean_staleness, float(sum(trained)), float(sum(n > 0 for n in trained)), max(width, 1),
                    max(passes, 1), routed)


class PolicyTrainer:
    """The policy being trained on this rank, its optimizer and lr schedule (see the module docstring).
    `spec` is the learner's config (`stages.learner.GRPOLearner`); `world_size` > 1 shards the model
    with FSDP2 over the process group this rank has joined."""

    def __init__(self, spec: Any, steps: int, world_size: int = 1, shard: bool | None = None) -> None:
        self.spec, self.steps, self.world_size = spec, steps, world_size
        self.sharded = world_size > 1 if shard is None else shard
        self.device = sharding.pick_device(spec.device, world_size)
        self.model = sharding.load_policy(spec.model_path, self.device, world_size, spec.activation_checkpointing,
                                          self.sharded, spec.lora, spec.expert_parallel)
        if spec.routing_replay != "off":  # replay on a dense model fails here, naming the setting
            check_routing_replay(spec.model_path, spec.routing_replay, engine_returns_experts=True)
        self.routing_layers = len(layout.layers) if (layout := moe_layout(self.model)) is not None else 0
        self.balanced = self.routing_layers > 0 and hasattr(self.model.config, "output_router_logits")
        if spec.load_balance_coef > 0 and not self.balanced:
            raise ValueError(f"learner.load_balance_coef = {spec.load_balance_coef} weighs a mixture-of-experts "
                             f"model's load-balancing loss, but the model in {str(spec.model_path)!r} has no "
                             "router whose logits transformers returns: set learner.load_balance_coef = 0")
        trained = [p for p in self.model.parameters() if p.requires_grad]  # with LoRA: the adapter's only
        self.optimizer = torch.optim.AdamW(trained, lr=spec.lr, betas=tuple(spec.adam_betas),
                                           weight_decay=spec.weight_decay)
        self.adapter = AdapterPublisher(spec.lora, Path(spec.model_path)) if spec.lora is not None else None
        self.reference: torch.nn.Module | None = None  # the initial weights, for the KL penalty (kl_coef > 0)
        # the model folder holds the initial weights, also on resume; with LoRA they are the frozen base itself
        if spec.kl_coef > 0 and spec.lora is None:
            self.reference = sharding.load_policy(spec.model_path, self.device, world_size, shard=self.sharded,
                                                  expert_parallel=spec.expert_parallel).requires_grad_(False)
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        # the bonus's cap in nats; with "initial" None until the first step has measured the policy's entropy
        self.entropy_cap: float | None = None if spec.entropy_cap == "initial" else spec.entropy_cap

    def schedule(self, version: int) -> None:
        """The learning-rate schedule, at `version` (0, or a checkpoint's): a function of the version alone."""
        spec = self.spec
        for group in self.optimizer.param_groups:
            group["initial_lr"] = spec.lr
        self.scheduler = lr_scheduler(self.optimizer, spec.lr_warmup_steps, self.steps, spec.lr_decay,
                                      spec.min_lr_ratio, start=version)

    def weights(self, version: int = 0) -> dict[str, torch.Tensor]:
        """What `version` publishes: the live state dict on one rank; on several, every parameter gathered
        whole, one at a time, to rank 0's host memory (a collective: every rank calls it; the others get {}).
        With LoRA, the adapter alone and its descriptor (`stages.learner.lora`), on every rank."""
        if self.adapter is not None:
            return self.adapter.version(self.model, self.device, version)
        if not self.sharded:
            return self.model.state_dict()
        return sharding.full_weights(self.model)

    def write_state(self, folder: Path, version: int) -> None:
        """This rank's part of a checkpoint (a collective with several ranks)."""
        write_learner_state(folder, version, self.model, self.optimizer, self.spec.selection, self.sharded,
                            self.spec.lora, self.entropy_cap if self.spec.entropy_cap == "initial" else None)

    def read_state(self, folder: Path) -> int:
        """Load a checkpoint's learner state, written at any world size; returns its version. With
        `entropy_cap = "initial"` the cap the run measured on its first step comes back with it (a checkpoint
        without one measures it afresh on the next step)."""
        learner = read_learner_state(folder, self.model, self.optimizer, self.spec.selection, self.sharded,
                                     self.spec.lora)
        if self.spec.entropy_cap == "initial":
            self.entropy_cap = learner.entropy_cap
        return learner.version

    def train(self, batches: list[RolloutBatch], mean_staleness: float = 0.0) -> dict[str, float]:
        """One version's step on all of `batches` (this rank is the whole learner)."""
        return self.step(batches, plan_step([batches], mean_staleness, self.spec.micro_batch_tokens))

    def step(self, batches: list[RolloutBatch], plan: StepPlan | None = None) -> dict[str, float]:
        """One version's optimizer step(s) on this rank's `batches`; the loss and the diagnostics for the
        metrics (over every rank's rows)."""
        plan = plan if plan is not None else plan_step([batches], 0.0, self.spec.micro_batch_tokens)
        spec, opt = self.spec, self.optimizer
        lr_scale = staleness_lr_factor(plan.mean_staleness, spec.lr_tuned_staleness, spec.lr_staleness_power,
                                       spec.lr_staleness_floor)
        for group in opt.param_groups:  # the scheduler sets each step's lr afresh, so this lasts one step
            group["lr"] *= lr_scale
        lr = opt.param_groups[0]["lr"]
        rows = _Rows.of(batches, spec, plan.routed or spec.routing_replay == "rollout")
        chunks = _padded(micro_batches(rows.lengths, spec.micro_batch_tokens), plan.micro_batches)
        proximal: list[torch.Tensor | None] = [None] * len(chunks)
        for _ in range(spec.epochs):  # PPO epochs: later passes see ratios move away from 1, and clip
            opt.zero_grad(set_to_none=True)
            totals = _Totals()
            for i, chunk in enumerate(chunks):
                proximal[i] = self._micro_step(rows, chunk, plan, proximal[i], totals)
            grad_norm = sharding.clip_grad_norm(self.model, spec.max_grad_norm)
            opt.step()
        self.scheduler.step()
        info = fold_layer_shares(totals.result(plan.tokens, self.world_size))
        info["lr"], info["lr_staleness_factor"] = lr, round(lr_scale, 4)
        info["grad_norm"] = round(grad_norm, 4)
        if self.spec.entropy_cap == "initial" and self.entropy_cap is None and info.get("entropy", 0.0) > 0:
            self.entropy_cap = info["entropy"]  # over every rank's tokens: the same cap on every rank
        if self.entropy_cap is not None:
            info["entropy_cap"] = round(self.entropy_cap, 4)
        return {**info, **(group_figures(batches) if batches else {})}

    def _micro_step(self, rows: _Rows, chunk: list[int], plan: StepPlan, proximal: torch.Tensor | None,
                    totals: _Totals) -> torch.Tensor:
        """Forward and backward of one micro-batch (an empty `chunk` runs a masked dummy row); returns the
        proximal logprobs of its rows (epoch 0's forward)."""
        spec = self.spec
        ids, old, mask, attn, adv, bonus = rows.take(chunk, self.device)
        adv = adv[:, 1:] if adv.shape[1] > 1 else adv  # per-token advantages: at the loss's positions 1..
        reduce = partial(aggregate, mode=spec.loss_agg_mode, max_tokens=spec.loss_max_tokens or plan.width,
                         denominator=plan.tokens if spec.loss_agg_mode == "token-mean" else plan.rows)
        m = mask[:, 1:]
        routing, replay = rows.routing(chunk, self.device), spec.routing_replay == "rollout"
        with routed_forward(self.model, routing, replay) as seen:  # through backward: a recompute replays too
            logits, balance = self._forward(ids, attn)
            logits = logits[:, :-1].float() / spec.temperature
            logp_all = torch.log_softmax(logits, -1)
            logp = logp_all.gather(2, ids[:, 1:, None]).squeeze(-1)
            proximal = logp.detach() if proximal is None else proximal  # the weights at the step's start
            entropy = token_entropy(logp_all if spec.entropy_coef > 0 else logp_all.detach())
            loss, info = spec.correction.loss(logp, old[:, 1:], proximal, adv, m, spec.clip_eps, spec.clip_eps_high,
                                              reduce, entropy=entropy)
            if spec.entropy_coef > 0:
                loss = loss - spec.entropy_coef * reduce(entropy_bonus_term(entropy, self.entropy_cap) * bonus, m)
            if spec.kl_coef > 0:
                ref_logits = self._reference_logits(ids, attn, routing)
                reference = torch.log_softmax(ref_logits / spec.temperature, -1).gather(2, ids[:, 1:, None])
                per_token = kl_k3(logp, reference.squeeze(-1))
                loss = loss + spec.kl_coef * reduce(per_token, m)
                info["kl_ref"] = float((per_token.detach() * m).sum() / m.sum().clamp(min=1))
            if balance is not None:  # weighted by the micro-batch's share of the step's trained tokens, as reported
                if spec.load_balance_coef > 0:
                    loss = loss + spec.load_balance_coef * balance * (m.sum() / max(plan.tokens, 1.0))
                info["load_balance_loss"] = float(balance.detach())
            (loss * self.world_size).backward()  # FSDP2 averages the ranks' gradients; they must sum
        info["entropy"] = float((entropy.detach() * m).sum() / m.sum().clamp(min=1))
        if plan.routed:  # every rank adds the same keys: the totals are summed over ranks in one collective
            info |= layer_shares(seen, self.routing_layers)
            info["logprob_gap"] = float(((proximal - old[:, 1:]).abs() * m).sum() / m.sum().clamp(min=1))
        totals.add(float(loss.detach()), info, float(m.sum()))
        return proximal

    def _forward(self, ids: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The policy's logits [rows, T, vocab] and, for a mixture-of-experts model, transformers' own
        load-balancing loss of its architecture (`load_balancing_loss_func`, the model's `aux_loss`) over this
        forward's router logits (the current router's, also under replay) at the rows' real tokens (`attn`);
        None for a dense model."""
        if not self.balanced:
            return self.model(input_ids=ids, attention_mask=attn).logits, None
        out = self.model(input_ids=ids, attention_mask=attn, output_router_logits=True)
        balance = getattr(out, "aux_loss", None)
        if balance is None and self.spec.load_balance_coef > 0:
            raise ValueError(f"learner.load_balance_coef = {self.spec.load_balance_coef}, but this model's forward "
                             "returns no load-balancing loss: set learner.load_balance_coef = 0")
        return out.logits, balance

    def _reference_logits(self, ids: torch.Tensor, attn: torch.Tensor,
                          routing: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """The initial weights' logits for the KL penalty: the reference model's (routed as the policy's
        forward is), or with LoRA the base's (the adapter switched off for this forward)."""
        with torch.no_grad():
            if self.reference is not None:
                with routed_forward(self.reference, routing if self.spec.routing_replay == "rollout" else None, True):
                    return self.reference(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
            with self.model.disable_adapter():
                return self.model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()


class _Rows:
    """One rank's rows of a step as tensors, and the advantage and entropy-bonus weight of each row."""

    def __init__(self, ids, old, mask, attn, rewards, group_index, adv, bonus, experts=None) -> None:
        self.ids, self.old, self.mask, self.attn = ids, old, mask, attn
        self.rewards, self.group_index, self.adv, self.bonus = rewards, group_index, adv, bonus
        self.experts = experts  # the recorded experts and where, [rows, T, moe layers, top_k] and [rows, T]
        self.lengths = [int(n) for n in attn.sum(-1)]

    @classmethod
    def of(cls, batches: list[RolloutBatch], spec: Any, routed: bool) -> _Rows:
        """The rows of `batches`, with their recorded experts when `routed` (every group must carry them)."""
        if not batches:  # a rank without groups this step: one masked dummy row keeps the collectives in step
            z = torch.zeros((0, 2))
            return cls(z.long(), z, z, z.long(), torch.zeros(0), torch.zeros(0, dtype=torch.long),
                       torch.zeros(0, 1), torch.zeros(0, 1))
        ids, old, mask, attn, rewards, group_index = batch_tensors(batches)
        adv = group_advantages(rewards, group_index, scale_by_std=spec.norm_adv_by_std)[:, None]
        if spec.distill_coef > 0:  # per-token advantages: GRPO's plus (or replaced by) the teacher's term
            teacher = teacher_tensor(batches, ids.shape[1])
            adv = distill_advantages(adv, old, teacher, mask, spec.distill_coef, spec.distill_mode,
                                     group_index if spec.distill_baseline else None)
        bonus = entropy_bonus_rows(rewards, group_index, spec.entropy_scope)[:, None]
        experts = routed_tensors(batches, ids.shape[1]) if routed else None
        return cls(ids, old, mask, attn, rewards, group_index, adv, bonus, experts)

    def take(self, chunk: list[int], device: torch.device) -> tuple[torch.Tensor, ...]:
        """The rows `chunk`, cut to their longest row, on `device` (empty: one masked dummy row)."""
        if not chunk:
            one = torch.zeros((1, 2))
            return tuple(t.to(device) for t in (one.long(), one, one, one.long() + 1, one[:, :1], one[:, :1]))
        index = torch.tensor(chunk)
        width = max(self.lengths[i] for i in chunk)
        cut = (t[index, :width] for t in (self.ids, self.old, self.mask, self.attn))
        adv = self.adv[index, :width] if self.adv.shape[1] > 1 else self.adv[index]  # per token with distillation
        return tuple(t.to(device) for t in (*cut, adv, self.bonus[index]))

    def routing(self, chunk: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The recorded experts of the rows `chunk` at the input positions a replayed forward routes (as
        `take` cuts them), or None: no experts, or an empty pass."""
        if self.experts is None or not chunk:
            return None
        index, width = torch.tensor(chunk), max(self.lengths[i] for i in chunk)
        experts, where = (t[index, :width].to(device) for t in self.experts)
        return inputs_of_tokens(experts, where)


def _padded(chunks: list[list[int]], passes: int) -> list[list[int]]:
    """`chunks` followed by empty ones up to `passes` (at least one pass)."""
    return chunks + [[] for _ in range(max(passes, 1) - len(chunks))]


class _Totals:
    """A step's loss (summed: each micro-batch's is already divided by the global count) and diagnostics
    (weighted by trained tokens), over micro-batches and then over ranks."""

    def __init__(self) -> None:
        self.loss, self.tokens = 0.0, 0.0
        self.weighted: dict[str, float] = {}

    def add(self, loss: float, info: dict[str, float], tokens: float) -> None:
        self.loss += loss
        self.tokens += tokens
        for key, value in info.items():
            self.weighted[key] = self.weighted.get(key, 0.0) + float(value) * tokens

    def result(self, global_tokens: float, world_size: int) -> dict[str, float]:
        keys = sorted(self.weighted)
        values = [self.loss, self.tokens, *(self.weighted[k] for k in keys)]
        if world_size > 1:
            values = sharding.sum_over_ranks(values)
        loss, tokens, *weighted = values
        return {"loss": round(loss, 5), **{k: v / max(tokens, 1.0) for k, v in zip(keys, weighted, strict=True)}}
