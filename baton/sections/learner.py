"""The consumer and what it trains on: [learner] (GRPO, LoRA), [staleness] and [replay]."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field

from baton.sections.base import BuildContext, Section, declared_defaults, default_of, kinds, same_as
from policies.selection import Selection, make_selection
from policies.staleness import MaxStaleness

if TYPE_CHECKING:
    from stages.learner import GRPOLearner
    from stages.learner.lora import LoraSpec

AGGREGATIONS = same_as("stages.learner.losses:AGGREGATIONS", ("token-mean", "seq-mean-token-mean",
                                                              "seq-mean-token-sum-norm"))
ENTROPY_SCOPES = same_as("stages.learner.losses:ENTROPY_SCOPES", ("all", "zero-variance"))
LR_DECAYS = same_as("stages.learner.losses:LR_DECAYS", ("constant", "linear", "cosine"))
ROUTING_REPLAYS = same_as("stages.learner.replay:ROUTING_REPLAYS", ("off", "rollout"))

LORA = declared_defaults("stages.learner.lora:LoraSpec")
LORA_TARGETS = LORA("target_modules", ("q_proj", "k_proj", "v_proj", "o_proj"))
GRPO_LEARNER = declared_defaults("stages.learner:GRPOLearner")


class LoraSection(Section):
    """[learner] lora: train LoRA adapters on a frozen base and publish only them (stages.learner.lora)."""

    rank: int = Field(LORA("rank", 8), ge=1, description="the adapters' rank")
    alpha: float = Field(LORA("alpha", 16.0), gt=0, description="the adapters' output is scaled by "
                         "alpha / rank")
    dropout: float = Field(LORA("dropout", 0.0), ge=0, lt=1, description="dropout on the adapters' "
                           "input, in training only")
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS),
                                      min_length=1, description="decoder linear modules to adapt, by the last part "
                                      "of their names (checked against the model)")
    check_every: int = Field(LORA("check_every", 1), ge=0, description="versions between checks "
                             "that each engine's logprobs of a fixed sequence equal the learner's (refused "
                             "otherwise); 0: never")
    check_tolerance: float = Field(LORA("check_tolerance", 0.0001), gt=0, description="most a checked "
                                   "logprob may differ, relative beyond 1 in size (bfloat16 engines: about 0.05)")
    target_experts: bool = Field(LORA("target_experts", False), description="mixture-of-experts models: "
                                 "adapt the fused experts too (each expert its own rank-r factors; peft's "
                                 "target_parameters), not only target_modules (the attention by default, never the "
                                 "router); needs dropout = 0 and the torch engine")

    def spec(self) -> LoraSpec:
        from stages.learner.lora import LoraSpec

        return LoraSpec(**{**self.model_dump(), "target_modules": tuple(self.target_modules)})


class GRPOSpec(Section):
    kind: Literal["grpo"] = Field("grpo",
        description="GRPO: group-normalised advantages and a PPO-clip loss (the built-in learner)")
    lr: float = Field(GRPO_LEARNER("lr", 0.0004), gt=0,
        description="AdamW learning rate, before warmup, decay and the staleness factor")
    groups_per_step: int = Field(GRPO_LEARNER("groups_per_step", 16), ge=1,
        description="new groups trained per learner step; each step makes one new version")
    clip_eps: float = Field(GRPO_LEARNER("clip_eps", 0.2), gt=0, description="PPO clip: ratio >= 1 - clip_eps "
                            "(and <= 1 + clip_eps unless clip_eps_high is set)")
    clip_eps_high: float | None = Field(GRPO_LEARNER("clip_eps_high", 0.28), gt=0, description="PPO clip, high "
                                        "side: ratio <= 1 + clip_eps_high (DAPO clip-higher); unset: clip_eps")
    loss_agg_mode: Literal[AGGREGATIONS] = Field(  # type: ignore[valid-type]
        GRPO_LEARNER("loss_agg_mode", "token-mean"), description="token-mean (DAPO), seq-mean-token-mean (GRPO) or "
        "seq-mean-token-sum-norm (Dr. GRPO: token sums / loss_max_tokens)")
    loss_max_tokens: int | None = Field(GRPO_LEARNER("loss_max_tokens", None), ge=1, description="Dr. GRPO's "
                                        "constant divisor; unset: the batch's padded width")
    norm_adv_by_std: bool = Field(GRPO_LEARNER("norm_adv_by_std", False), description="false: advantages are "
                                  "r - group mean, not divided by the group's std (Dr. GRPO)")
    entropy_coef: float = Field(GRPO_LEARNER("entropy_coef", 0.01), ge=0, description="entropy bonus")
    entropy_scope: Literal[ENTROPY_SCOPES] = Field(  # type: ignore[valid-type]
        GRPO_LEARNER("entropy_scope", "all"), description='"all" rows, or "zero-variance": only the rows of '
        "groups whose rewards are all equal (no signal)")
    entropy_cap: Annotated[float, Field(gt=0)] | Literal["auto", "off", "initial"] = Field("auto", description=
        "each token's entropy counts in the bonus only up to this (nats): a token above it gets no push, so the "
        'bonus cannot drive the policy towards uniform where rewards are flat; "initial": the policy\'s mean '
        'token entropy on its first step (kept in checkpoints); "off": uncapped; "auto" (the default): off up '
        'to staleness.k = 2, "initial" above (resolved when the config loads)')
    kl_coef: float = Field(GRPO_LEARNER("kl_coef", 0.0), ge=0, description="k3 KL penalty to the initial "
                           "weights (0: off, and no reference model is kept)")
    lr_warmup_steps: int = Field(GRPO_LEARNER("lr_warmup_steps", 0), ge=0, description="versions of linear "
                                 "warmup")
    lr_decay: Literal[LR_DECAYS] = Field(GRPO_LEARNER("lr_decay", "constant"),  # type: ignore[valid-type]
                                         description="after warmup: constant, or linear / cosine decay to "
                                         "min_lr_ratio x lr at the last version")
    min_lr_ratio: float = Field(GRPO_LEARNER("min_lr_ratio", 0.0), ge=0, le=1,
        description="the decay's floor: lr_decay ends at this x lr")
    lr_tuned_staleness: float = Field(GRPO_LEARNER("lr_tuned_staleness", 32.0), ge=0, description="the "
                                      "staleness lr was chosen at: a staler step trains at lr x ((this + 1) / (its "
                                      "mean staleness + 1)) ** lr_staleness_power")
    lr_staleness_power: float = Field(GRPO_LEARNER("lr_staleness_power", 2.0), ge=0, description="0: the "
                                      "same lr at every staleness")
    lr_staleness_floor: float = Field(GRPO_LEARNER("lr_staleness_floor", 0.4), ge=0, le=1, description="the "
                                      "cut never takes a step's lr below this x lr (0: no floor)")
    warn_entropy_below: float = Field(GRPO_LEARNER("warn_entropy_below", 0.05), ge=0, description="a "
                                      "learner.entropy_collapse event when the entropy falls below this ...")
    warn_reward_below: float = Field(GRPO_LEARNER("warn_reward_below", 0.5), description="... while the "
                                     "trailing mean reward is below this")
    warn_window: int = Field(GRPO_LEARNER("warn_window", 20), ge=1, description="versions in that trailing "
                             "mean")
    max_grad_norm: float = Field(GRPO_LEARNER("max_grad_norm", 1.0), gt=0,
        description="gradients are clipped to this global norm before each optimizer step")
    weight_decay: float = Field(GRPO_LEARNER("weight_decay", 0.0), ge=0, description="AdamW weight decay")
    adam_betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = Field(
        GRPO_LEARNER("adam_betas", (0.9, 0.999)), description="AdamW's decay rates of its gradient mean (momentum) "
        "and of its squared gradient, each in [0, 1)")
    epochs: int = Field(GRPO_LEARNER("epochs", 1), ge=1, description="optimizer passes over each step's "
                        "batch (PPO epochs)")
    device: str = Field(GRPO_LEARNER("device", "auto"), pattern=r"^(auto|cpu|cuda(:\d+)?)$",
                        description='"auto": cuda when a GPU is visible')
    world_size: int = Field(GRPO_LEARNER("world_size", 1), ge=1, description="learner ranks: processes, "
                            "one device each (a GPU each on CUDA), the model sharded over them with FSDP2; 1: one "
                            "process, the whole model")
    micro_batch_tokens: int | None = Field(GRPO_LEARNER("micro_batch_tokens", None), ge=1, description="padded "
                                           "tokens per forward/backward pass: each rank's rows are cut into micro-"
                                           "batches within it and their gradients accumulated; unset: one pass")
    activation_checkpointing: bool = Field(GRPO_LEARNER("activation_checkpointing", False), description="recompute "
                                           "activations in backward: less memory, about a third more compute")
    rank_timeout_s: float = Field(GRPO_LEARNER("rank_timeout_s", 300.0), gt=0, description="a collective of "
                                  "the learner's ranks not answered in this long fails the run")
    max_restarts: int = Field(GRPO_LEARNER("max_restarts", 2), ge=0, description="world_size > 1: a "
                              "learner rank that dies (or a collective that fails) restarts the rank group within "
                              "the run from the latest checkpoint, at most this many times; 0: the run fails with "
                              "LearnerRankFailed (resume it with baton run --resume)")
    expert_parallel: int = Field(GRPO_LEARNER("expert_parallel", 1), ge=1, description="mixture-of-experts "
                                 "models: ranks the experts are sharded over, each token sent to its experts' ranks "
                                 "and back; must divide the experts and equal learner.world_size (1: no expert "
                                 "parallelism, FSDP2 shards the experts as any weight)")
    routing_replay: Literal[ROUTING_REPLAYS] = Field(  # type: ignore[valid-type]
        GRPO_LEARNER("routing_replay", "off"), description="mixture-of-experts models: 'rollout' runs the "
        "learner's forwards through the experts the engine routed each generated token to (gate weights from the "
        "learner's own router over them), 'off' lets its router choose; router_disagreement is reported either way")
    load_balance_coef: float = Field(GRPO_LEARNER("load_balance_coef", 0.0), ge=0, description="mixture-"
                                     "of-experts models: the loss adds this x the load-balancing loss of the "
                                     "learner's router (transformers' own for the architecture, over the rows' real "
                                     "tokens); load_balance_loss is reported either way (0: not added)")
    lora: LoraSection | None = Field(None, description="[learner] lora = { rank, alpha, dropout, target_modules, "
                                     "target_experts }: "
                                     "LoRA adapters on a frozen base, each version publishing the adapter alone; "
                                     "unset: full fine-tuning")

    def make(self, ctx: BuildContext, **wiring: Any) -> GRPOLearner:
        """The learner on the model folder; `wiring`: what other sections decide (the transport, the
        correction, the selection, the engine's temperature, ...), composed by baton.builder."""
        from stages.learner import GRPOLearner

        assert ctx.model is not None
        return GRPOLearner(
            ctx.model, **self.model_dump(exclude={"kind", "lora", "entropy_cap"}),  # the others are GRPOLearner's
            lora=self.lora.spec() if self.lora is not None else None,
            entropy_cap=None if self.entropy_cap == "off" else self.entropy_cap,  # "auto" is resolved at load
            **wiring,
        )


class MaxStalenessSpec(Section):
    kind: Literal["max-staleness"] = Field("max-staleness",
        description="the built-in staleness policy: a bound k on how many versions old a trained token may be")
    k: int | None = Field(None, ge=0, description="default: MaxStaleness's k in async mode, 0 in sync mode")
    on_stale: Literal["drop", "requeue"] = Field(default_of(MaxStaleness, "on_stale"),
        description="a group older than k at the learner: 'drop' it, or 'requeue' its prompt to be generated again")
    max_span: int | None = Field(
        default_of(MaxStaleness, "max_span"), ge=1,
        description="most weight versions one sample may span; longer ones restart on the new weights",
    )
    admission: Literal["pace", "eager"] = Field(
        default_of(MaxStaleness, "admission"),
        description='"pace": producers wait rather than start work that would be too stale to train; '
        '"eager": they start work as fast as the channels take it, and what turns too stale is refused',
    )
    lead: int | None = Field(
        default_of(MaxStaleness, "lead"), ge=0,
        description="with admission = 'pace': most versions producers run ahead of the learner (0..k); "
        "unset: k, or k - (replay.max_reuse - 1) with replays, so a group arrives with room to be trained again",
    )

    def make(self, ctx: BuildContext) -> MaxStaleness:
        return MaxStaleness(**self.model_dump(exclude={"kind"}))  # the spec mirrors the class, key for key


LearnerSection = kinds(GRPOSpec)  # the learner kinds
StalenessSection = kinds(MaxStalenessSpec)  # the staleness kinds


class ReplaySpec(Section):
    """Which groups each learner step trains on, and how often one may be (policies.selection)."""

    max_reuse: int = Field(default_of(Selection, "max_reuse"), ge=1, description="most learner steps one group is "
                           "trained in (only while within k)")
    selection: Literal["fifo", "freshest", "uniform"] = Field(
        GRPO_LEARNER("selection", "fifo", attribute="kind"),
        description="fifo: in arrival order; freshest: newest version first; uniform: at random (seeded)"
    )
    ride_along: bool = Field(
        GRPO_LEARNER("replays_ride_along", False),
        description="with max_reuse > 1: a step trains groups_per_step new groups plus its replays (true), or "
        "replays take new groups' places (false); true keeps the staleness check's bound as without reuse"
    )
    drop_zero_signal: bool = Field(
        default_of(Selection, "drop_zero_signal"),
        description="filter groups whose rewards are all equal before they cost a step (DAPO dynamic sampling)"
    )
    max_filtered_batches: int = Field(
        default_of(Selection, "max_filtered_batches"), ge=1,
        description="a step that filters more than this many times groups_per_step groups fails the run"
    )

    def make(self, ctx: BuildContext) -> Selection:
        return make_selection(self.selection, max_reuse=self.max_reuse, drop_zero_signal=self.drop_zero_signal,
                              max_filtered_batches=self.max_filtered_batches, seed=ctx.seed)
