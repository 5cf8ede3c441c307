"""The run config: a TOML file that maps one to one onto the Python DSL. `RunConfig` composes one section
per table ([model], [task], [engine], ... [simulate]); each section, and the factory of what it
describes (`make(ctx)`), lives in its own module of `baton.sections`; the README's "Config reference"
lists every key. A `kind` key picks a built-in class or a "pkg.mod:Class" plug-in.

Unknown keys and bad values fail validation, naming the key, the value and what is allowed. So do the
checks across sections (`baton.checks`), among them a config whose shape can break its own staleness
bound (`policies.bounds`: queues that let groups age past k, PPO epochs that compound staleness, a reuse
count k cannot reach), before anything starts.

A default is defined once, in the part's own class; a section that mirrors a class declares it
(`declared_defaults`, checked against the class by the tests) or, for a light part, reads it from there
(`default_of`). Validating a config imports no torch, transformers, ray, sglang or stage implementation
(baton.sections.base says how): a config error is reported at once. `baton.builder` turns a validated
RunConfig into the Pipeline, importing the parts as it makes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from baton import checks
from baton.config import load_toml, to_toml, validate
from baton.sections import data as _data
from baton.sections import engines as _engines
from baton.sections import learner as _learner
from baton.sections import rewards as _rewards
from baton.sections import rollout as _rollout
from baton.sections import run as _run
from baton.sections import stores as _stores
from baton.sections.base import BuildContext, PluginSpec, Section, declared_defaults, default_of
from baton.sections.correction import CorrectionSpec
from baton.sections.rewards import resolve
from baton.sections.run import SimulateSpec
from baton.sections.weights import WeightsSpec
from pipeline.faults import FAULT_KINDS
from policies.staleness import MaxStaleness, staleness_lr_factor

PIPELINE = declared_defaults("pipeline.dsl:Pipeline")


class RunConfig(Section):
    name: str = Field("baton", pattern=r"^[A-Za-z0-9_.-]+$",
        description="the run's name: the run folder's prefix (run_root/<name>-<timestamp>) and the first part of "
                    "every store key")
    seed: int = Field(PIPELINE("seed", 0),
        description="seeds torch, prompt sampling, engine sampling and the dataset's shuffle (the tiny model's init "
                    "has model.seed)")
    steps: int = Field(PIPELINE("steps", 60), ge=1, description="learner versions to train")
    mode: Literal["async", "sync"] = Field("async",
        description="sync: staleness.k = 0 through the same code path (on-policy); async: the staleness policy's k")
    runtime: Literal["local", "ray"] = Field(PIPELINE("runtime", "local"),
        description="local: every actor a task in one event loop; ray: every actor a Ray actor in its own process")
    run_root: str = Field(PIPELINE("run_root", "runs"), description="where run folders are made")
    model: _data.ModelSpec = Field(_data.ModelSpec(), description="[model]: the model folder engines and learner load")
    task: _data.TaskSection = Field(_data.ReverseDigitsSpec(),  # type: ignore[valid-type]
        description="[task]: where prompts and answers come from")
    reward: _rewards.RewardSpec | None = Field(None, description="[reward]: the reward function; unset: the task's own "
                                      "(a dataset task: exact_match)")
    distill: _rewards.DistillSpec | None = Field(None, description="[distill]: on-policy distillation from a teacher "
                                                 "model; unset: none")
    eval: _data.EvalSpec = Field(_data.EvalSpec(), description="[eval]: evaluation during training; off unless "
                                 "eval.every is set")
    engine: _engines.EngineSection = Field(_engines.TorchEngineSpec(),  # type: ignore[valid-type]
        description="[engine]: the inference engines the producer generates on")
    rollout: _rollout.RolloutSpec = Field(_rollout.RolloutSpec(),
        description="[rollout]: the producer's group size and engine-call timeout")
    environment: _rollout.EnvironmentSpec | None = Field(None, description="[environment]: multi-turn episodes; unset: "
                                                "single-turn")
    episode: _rollout.EpisodeSpec = Field(_rollout.EpisodeSpec(), description="[episode]: per-episode limits, "
                                          "whatever the environment")
    gateway: _rollout.GatewaySpec | None = Field(None, description="[gateway]: train agents that speak the OpenAI API")
    store: _stores.StoreSection = Field(_stores.MemoryStoreSpec(),  # type: ignore[valid-type]
        description="[store]: where rollout payloads live (refs travel through the channels)")
    buffer: _run.BufferSpec = Field(_run.BufferSpec(),
        description="[buffer]: the bounds of the buffer stage and of the channels around it")
    learner: _learner.LearnerSection = Field(_learner.GRPOSpec(),  # type: ignore[valid-type]
        description="[learner]: the consumer: loss, optimizer and device")
    staleness: _learner.StalenessSection = Field(_learner.MaxStalenessSpec(),  # type: ignore[valid-type]
        description="[staleness]: what may be generated and trained, from weight versions")
    correction: CorrectionSpec = Field(CorrectionSpec(), description="[correction]: off-policy correction in the loss")
    replay: _learner.ReplaySpec = Field(_learner.ReplaySpec(),
        description="[replay]: which groups each step trains on, and how often one may be")
    weights: WeightsSpec = Field(WeightsSpec(), description="[weights]: how each new version reaches the engines")
    telemetry: _run.TelemetrySpec = Field(_run.TelemetrySpec(),
        description="[telemetry]: logs, the progress line and metric sinks")
    ray: _run.RaySpec = Field(_run.RaySpec(), description="[ray]: which Ray cluster runtime = 'ray' uses")
    checkpoint: _run.CheckpointSpec = Field(_run.CheckpointSpec(),
        description="[checkpoint]: checkpoints for `baton run --resume`")
    watchdog: _run.WatchdogSpec = Field(_run.WatchdogSpec(), description="[watchdog]: hang diagnosis")
    faults: list[_run.FaultConfig] = Field(default_factory=list, description="[[faults]]: injected faults "
                                           "(pipeline.faults)")
    simulate: SimulateSpec | None = Field(None, description="[simulate]: cluster shape and declared costs for "
                                          "`baton simulate` (baton.simulate); `baton run` ignores it")

    @model_validator(mode="after")
    def _sections_fit_together(self) -> RunConfig:
        """The checks across sections (`baton.checks`), in order; the first resolves staleness.k and `auto`s."""
        checks.check_all(self)
        return self

    def build_context(self, model: Path | None = None, index: int = 0) -> BuildContext:
        """What a section's `make` may read of the rest of this config."""
        staleness = self.staleness
        k = staleness.k if isinstance(staleness, _learner.MaxStalenessSpec) else default_of(MaxStaleness, "k")
        lora = self.learner.lora if isinstance(self.learner, _learner.GRPOSpec) else None
        return BuildContext(seed=self.seed, dtype=self.model.dtype, k=k, runtime=self.runtime, name=self.name,
                            model=model, index=index, lora=lora.spec() if lora is not None else None)

    @property
    def engine_count(self) -> int:
        """Engine workers: the engine section's `count`, built-in or plug-in alike."""
        return int(self.engine.count)

    def engine_sampling(self) -> dict[str, Any]:
        """The rollout's sampling keys the engine section sets (batch_groups, temperature, top_p), whatever
        its kind."""
        return dict(self.engine.sampling())

    @property
    def learner_ranks(self) -> int:
        """The learner's world size (a plug-in learner: one)."""
        return self.learner.world_size if isinstance(self.learner, _learner.GRPOSpec) else 1

    def pipeline_shape(self) -> Any:
        """The numbers that decide staleness (a `policies.bounds.PipelineShape`); None for plug-in parts."""
        from policies.bounds import PipelineShape

        if not isinstance(self.staleness, _learner.MaxStalenessSpec) or not isinstance(self.learner,
                                                                                      _learner.GRPOSpec):
            return None
        return PipelineShape(
            k=self.staleness.k, groups_per_step=self.learner.groups_per_step,
            engines=max(self.engine_count, self.rollout.max_engines or 0),  # an elastic run's most engines
            batch_groups=self.engine_sampling().get("batch_groups", 1), produced_channel=self.buffer.produced_channel,
            buffer_refs=self.buffer.max_refs, ready_channel=self.buffer.ready_channel,
            admission=self.staleness.admission, max_reuse=self.replay.max_reuse, epochs=self.learner.epochs,
            replays_ride_along=self.replay.ride_along,
            corrected=self.correction.kind != "none", lead=self.staleness.lead,
        )

    def expert_bytes_per_token(self) -> int:
        """What each token's routed experts add to a rollout payload (0 for a dense model)."""
        model = self.model
        if model.create and not model.experts:
            return 0
        from stages.data.routing import MoELayout, folder_moe_layout

        if model.create:
            return MoELayout(tuple(range(model.layers)), model.experts, model.top_k, True).bytes_per_token
        layout = folder_moe_layout(model.path)
        return layout.bytes_per_token if layout is not None else 0

    def window_report(self) -> str | None:
        """What the staleness window holds at most, in groups, samples and store bytes (`baton check`)."""
        from policies.bounds import live_groups
        from stages.environments.tokens import EpisodeTokens

        shape = self.pipeline_shape()
        if shape is None:
            return None
        groups = live_groups(shape)
        samples = groups * self.rollout.group_size
        new_tokens = self.task.max_new_tokens if isinstance(self.task, _data.BUILT_IN_TASKS) else None
        experts = self.expert_bytes_per_token()
        per_token = samples * (EpisodeTokens.ROW_BYTES_PER_TOKEN + experts)
        line = (f"staleness window (k = {shape.k}, {shape.admission} admission): up to {groups} groups, {samples} "
                f"samples, live at once; in the store that is {per_token / 2**10:,.1f} KiB per token of a sample"
                + (f" (routed experts: {experts} B of each token's)" if experts else ""))
        if new_tokens:
            line += f", {per_token * new_tokens / 2**20:,.2f} MiB for completions of {new_tokens} tokens plus prompts"
        learner = self.learner
        if isinstance(learner, _learner.GRPOSpec) and shape.k > 0:
            factor = staleness_lr_factor(shape.k, learner.lr_tuned_staleness, learner.lr_staleness_power,
                                         learner.lr_staleness_floor)
            line += (f"; a step on groups {shape.k} versions old trains at {factor:.2f} x lr "
                     "(learner.lr_tuned_staleness, lr_staleness_power, lr_staleness_floor)")
        return line

    def resolved_toml(self) -> str:
        return to_toml(self.model_dump(mode="json", exclude_none=True))


def load_run_config(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """The RunConfig of the TOML at `path` with `--set` overrides; a ConfigError names every bad key."""
    return validate(RunConfig, load_toml(path, overrides), source=str(path))


__all__ = ["FAULT_KINDS", "BuildContext", "CorrectionSpec", "PluginSpec", "RunConfig", "SimulateSpec", "WeightsSpec",
           "default_of", "load_run_config", "resolve"]
