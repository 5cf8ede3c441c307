"""`GRPOLearner`: the consumer stage as the DSL and the config build it. It makes one actor, the learner.

The actor (`stages.learner.actor.LearnerActor`) collects each version's groups (collector.py), trains
on them (step.py: `PolicyTrainer`), publishes the new weights through the transport and checkpoints;
what the run shows of it comes from report.py. Nothing here imports `stages.rollout`: the two halves
meet only through refs, the ledger and the run folder (`stages.runfiles`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pipeline.channel import Channel
from pipeline.context import RunContext
from pipeline.contracts import Resources
from pipeline.faults import plan_of
from pipeline.telemetry import Panel
from policies.correction import Correction
from policies.selection import Fifo, Selection
from stages.learner import report
from stages.learner.actor import LearnerActor
from stages.learner.lora import LoraSpec
from stages.learner.losses import (
    AGGREGATIONS,
    DISTILL_MODES,
    ENTROPY_SCOPES,
    LR_DECAYS,
    DistillMode,
    EntropyScope,
    LossAggregation,
    LrDecay,
)
from stages.learner.ranks import uses_cuda
from stages.learner.replay import ROUTING_REPLAYS, RoutingReplay
from stages.weights import make_transport
from stages.weights.base import WeightTransport, subscribe_producers
from stages.weights.faulty import with_weight_faults


@dataclass
class GRPOLearner:
    """The DSL/config object: `GRPOLearner(model_path, lr=4e-4, groups_per_step=16)`. The defaults are the
    learning defaults measured in docs/results/learning.md, "What the defaults learn" (every built-in task at
    every seed tried)."""

    model_path: str | Path
    lr: float = 4e-4  # 1.5e-3 learns reverse-digits sooner but locks addition (docs/results/learning.md)
    groups_per_step: int = 16  # groups trained per version (one optimizer step)
    clip_eps: float = 0.2  # PPO clip, low side (and the high side unless clip_eps_high is set)
    clip_eps_high: float | None = 0.28  # PPO clip, high side (DAPO's clip-higher); None: clip_eps
    loss_agg_mode: LossAggregation = "token-mean"  # stages.learner.losses.aggregate
    loss_max_tokens: int | None = None  # seq-mean-token-sum-norm's constant divisor; None: the batch's width
    norm_adv_by_std: bool = False  # False: Dr. GRPO advantages (r - group mean, no std scaling)
    entropy_coef: float = 0.01  # entropy bonus: loss -= coef x aggregated entropy
    entropy_scope: EntropyScope = "all"  # "zero-variance": the bonus counts only rows of groups without signal
    # each token's entropy counts in the bonus up to this (nats); "initial": the policy's mean token entropy
    # on its first step (kept in checkpoints); None: uncapped
    entropy_cap: float | Literal["initial"] | None = None
    kl_coef: float = 0.0  # k3 KL penalty to the initial weights (kept in memory only when > 0)
    distill_coef: float = 0.0  # on-policy distillation: the teacher's per-token term's weight (0: off)
    distill_mode: DistillMode = "advantage"  # "advantage": added to GRPO's; "loss": the whole advantage
    distill_baseline: bool = True  # the teacher's term less its leave-one-out mean over the group's other rows
    lr_warmup_steps: int = 0  # linear warmup over this many versions
    lr_decay: LrDecay = "constant"  # after warmup: constant, linear or cosine to min_lr_ratio x lr at the last step
    min_lr_ratio: float = 0.0
    # the staleness lr was chosen at: a staler step's lr x ((this + 1) / (staleness + 1)) ** lr_staleness_power
    lr_tuned_staleness: float = 32.0  # the full step up to k = 32, the cut above (docs/results/learning.md)
    lr_staleness_power: float = 2.0  # 0: the same lr at every staleness
    lr_staleness_floor: float = 0.4  # the cut never takes the lr below this x lr (from k = 52 on)
    warn_entropy_below: float = 0.05  # a learner.entropy_collapse event when entropy falls below this ...
    warn_reward_below: float = 0.5  # ... while the trailing mean reward is below this
    warn_window: int = 20  # versions in the trailing reward
    replays_ride_along: bool = False  # reuse: replays train on top of groups_per_step new groups, not in their place
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)  # AdamW's (momentum, second-moment) decay rates
    epochs: int = 1  # optimizer passes over each step's batch (PPO epochs)
    temperature: float = 1.0
    weights: str | WeightTransport = "inproc"
    snapshot_every: int = 1  # keep every n-th version in the store for engine processes that (re)start; 0: never
    export_every: int = 0  # export each checkpoint of a multiple of this version as an HF folder (export.py); 0: never
    device: str = "auto"  # "auto": cuda when a GPU is visible, else cpu
    world_size: int = 1  # learner ranks (processes, one device each), the model sharded over them with FSDP2
    micro_batch_tokens: int | None = None  # padded tokens per forward/backward pass (gradient accumulation)
    activation_checkpointing: bool = False  # recompute activations in backward: less memory, ~1/3 more compute
    rank_timeout_s: float = 300.0  # a collective no rank answers for this long fails the run
    # a rank that dies (or a collective that fails) restarts the whole group from the latest checkpoint, within
    # the run, at most this many times (stages.learner.restart); 0: the run fails with LearnerRankFailed
    max_restarts: int = 2
    expert_parallel: int = 1  # MoE: experts sharded over this many ranks, tokens sent to them (stages.learner.experts)
    # mixture-of-experts routing replay (R3): "rollout" routes each generated token, in the learner's forwards
    # (policy, proximal, reference), to the experts the engine recorded for it, gate weights from the current
    # router over them; "off": the learner's own routing. Router metrics are reported either way, whenever the
    # groups carry experts (stages.learner.replay); "rollout" needs an MoE model and an engine that returns them
    routing_replay: RoutingReplay = "off"
    # mixture-of-experts models: the policy loss plus this x transformers' load-balancing loss of the current
    # router over the rows' real tokens; reported as load_balance_loss whatever the coefficient (0: not added)
    load_balance_coef: float = 0.0
    lora: LoraSpec | None = None  # train LoRA adapters on a frozen base and publish only them (stages.learner.lora)
    correction: Correction = Correction()  # off-policy correction of the loss (policies.correction)
    selection: Selection = Fifo()  # which groups a step trains on, reuse, zero-signal filter (policies.selection)

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"learner.lr must be > 0, got {self.lr}")
        if self.groups_per_step < 1:
            raise ValueError(f"learner.groups_per_step must be >= 1, got {self.groups_per_step}")
        if self.epochs < 1:
            raise ValueError(f"learner.epochs must be >= 1, got {self.epochs}")
        if self.loss_agg_mode not in AGGREGATIONS:
            raise ValueError(
                f"learner.loss_agg_mode must be one of {', '.join(AGGREGATIONS)}, got {self.loss_agg_mode!r}"
            )
        if self.lr_decay not in LR_DECAYS:
            raise ValueError(f"learner.lr_decay must be one of {', '.join(LR_DECAYS)}, got {self.lr_decay!r}")
        if self.entropy_scope not in ENTROPY_SCOPES:
            raise ValueError(f"learner.entropy_scope must be one of {', '.join(ENTROPY_SCOPES)}, "
                             f"got {self.entropy_scope!r}")
        if self.entropy_cap != "initial" and self.entropy_cap is not None and self.entropy_cap <= 0:
            raise ValueError(f"learner.entropy_cap must be > 0, 'initial' or unset (uncapped), got {self.entropy_cap}")
        if self.lr_tuned_staleness < 0:
            raise ValueError(f"learner.lr_tuned_staleness must be >= 0, got {self.lr_tuned_staleness}")
        if self.lr_staleness_power < 0:
            raise ValueError(f"learner.lr_staleness_power must be >= 0, got {self.lr_staleness_power}")
        if not 0 <= self.lr_staleness_floor <= 1:
            raise ValueError(f"learner.lr_staleness_floor must be in [0, 1], got {self.lr_staleness_floor}")
        if len(self.adam_betas) != 2 or not all(0 <= beta < 1 for beta in self.adam_betas):
            raise ValueError(f"learner.adam_betas must be two numbers in [0, 1), got {self.adam_betas}")
        if self.export_every < 0:
            raise ValueError(f"checkpoint.export_every must be >= 0 (0: never), got {self.export_every}")
        if self.world_size < 1:
            raise ValueError(f"learner.world_size must be >= 1, got {self.world_size}")
        if self.max_restarts < 0:
            raise ValueError(f"learner.max_restarts must be >= 0 (0: a dead rank fails the run), "
                             f"got {self.max_restarts}")
        if self.expert_parallel < 1:
            raise ValueError(f"learner.expert_parallel must be >= 1, got {self.expert_parallel}")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ValueError(f"learner.micro_batch_tokens must be >= 1 (or unset), got {self.micro_batch_tokens}")
        if self.clip_eps_high is not None and self.clip_eps_high <= 0:
            raise ValueError(f"learner.clip_eps_high must be > 0, got {self.clip_eps_high}")
        if self.distill_coef < 0:
            raise ValueError(f"distill.coef must be >= 0, got {self.distill_coef}")
        if self.routing_replay not in ROUTING_REPLAYS:
            raise ValueError(f"learner.routing_replay must be one of {', '.join(ROUTING_REPLAYS)}, "
                             f"got {self.routing_replay!r}")
        if self.load_balance_coef < 0:
            raise ValueError(f"learner.load_balance_coef must be >= 0 (0: reported, not added to the loss), "
                             f"got {self.load_balance_coef}")
        if self.distill_mode not in DISTILL_MODES:
            raise ValueError(f"distill.mode must be one of {', '.join(DISTILL_MODES)}, got {self.distill_mode!r}")

    @property
    def units_per_version(self) -> int:
        return self.groups_per_step

    @property
    def max_uses(self) -> int:
        """Most times one sample is trained on (the run's ledger enforces it)."""
        return self.selection.max_reuse

    def resources(self, index: int) -> Resources:
        """The learner's process (rank 0): one CPU, and one GPU when it trains on CUDA."""
        return Resources(cpus=1, gpus=1 if uses_cuda(self.device) else 0)

    def helpers(self) -> list[Resources]:
        """Its other ranks (`world_size - 1`), each like rank 0."""
        return [self.resources(0)] * (self.world_size - 1)

    def actors(self, ctx: RunContext, inbox: Channel | None, outbox: Channel | None) -> list[LearnerActor]:
        """The learner actor, subscribed to every engine: those of this process, and those of the producer
        processes (Ray runtime) through their mailboxes."""
        assert inbox is not None
        transport = make_transport(self.weights) if isinstance(self.weights, str) else self.weights
        transport = with_weight_faults(transport, plan_of(ctx), services=ctx.services)  # itself unless planned
        # engines in this process: those there now, and each that joins later (an elastic run); one that
        # leaves is unsubscribed before it stops
        ctx.services.weight_receivers.watch(transport.subscribe)
        # engines in other processes (Ray runtime): those there now, and each producer process that joins later;
        # one that leaves is unsubscribed before it stops
        remote = subscribe_producers(transport, ctx.services.producers)
        # a restarted producer process catches up from the latest version at once
        ctx.services.on_producer_restart = lambda index: remote[f"producer-{index}"].resend()
        # snapshots serve engine processes that (re)start and engines that join an elastic run (their fence);
        # engines that started with this process never need one
        snapshot_every = self.snapshot_every if remote or ctx.services.fleet is not None else 0
        actor = LearnerActor(self, ctx, inbox, transport, snapshot_every)
        ctx.add_status(actor.status)
        return [actor]

    # -- what the pipeline shows and returns (stages.learner.report) ---------------------------------
    def summary(self, records: list[dict], run_dir: Path | None = None) -> dict[str, Any]:
        return report.summary(records, run_dir)

    def progress(self, last: dict | None) -> dict[str, Any]:
        return report.progress(last)

    def report_panels(self, records: list[dict], run_dir: Path | None = None) -> list[Panel]:
        return report.report_panels(records, run_dir)
