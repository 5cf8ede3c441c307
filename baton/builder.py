"""`build_pipeline(cfg)`: the Pipeline a RunConfig describes, the same objects the Python DSL builds.

Composition only: each section makes what it describes (`cfg.<section>.make(ctx)`, baton.sections), given
a `BuildContext` (`RunConfig.build_context`), never the whole config; a `"pkg.mod:Class"` kind takes the
same path (`PluginSpec.make`; an engine plug-in `EnginePluginSpec.make`, with the model and its index).
What one part needs of another section (the learner's transport, correction, selection, the engine's
temperature) is wired here.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from baton.schema import RunConfig, default_of
from buffers import RefBuffer
from pipeline.dsl import Pipeline
from pipeline.faults import FaultSpec
from policies.correction import Correction
from policies.selection import Selection
from stages.data.rewards import RewardFunction
from stages.learner import GRPOLearner
from stages.rollout import Rollout
from stages.scorers import ComposedReward, Distillation


def learner_wiring(cfg: RunConfig) -> dict[str, Any]:
    """What the learner takes from the other sections: the transport, correction, selection, the engines'
    temperature, replays, exports and distillation."""
    distill = cfg.distill
    return dict(
        temperature=cfg.engine_sampling().get("temperature", default_of(GRPOLearner, "temperature")),
        weights=cfg.weights.make(cfg.build_context()), snapshot_every=cfg.weights.snapshot_every,
        correction=make_correction(cfg), selection=make_selection_policy(cfg),
        replays_ride_along=cfg.replay.ride_along, export_every=cfg.checkpoint.export_every,
        distill_coef=distill.coef if distill else 0.0,
        distill_mode=distill.mode if distill else default_of(GRPOLearner, "distill_mode"),
        distill_baseline=distill.baseline if distill else default_of(GRPOLearner, "distill_baseline"),
    )


def make_part(part: str, cfg: RunConfig, *, model: Path | None = None, index: int = 0) -> Any:
    """The object `cfg.<part>` (task, engine, store, learner, staleness) describes, built-in or plug-in:
    its section's `make`, given the build context (the model folder, the engine's index)."""
    ctx = cfg.build_context(model, index)
    if part == "learner":
        return cfg.learner.make(ctx, **learner_wiring(cfg))
    return getattr(cfg, part).make(ctx)


def grpo_learner(spec: Any, cfg: RunConfig, *, model: Path) -> GRPOLearner:
    """The built-in learner of `cfg` on `model`, wired to the other sections."""
    return spec.make(cfg.build_context(model), **learner_wiring(cfg))


def make_correction(cfg: RunConfig) -> Correction:
    return cfg.correction.make()


def make_selection_policy(cfg: RunConfig) -> Selection:
    return cfg.replay.make(cfg.build_context())


def make_reward(cfg: RunConfig) -> RewardFunction | ComposedReward | None:
    """[reward]: one function, or a weighted sum with the model rewards; None: the task's own."""
    return cfg.reward.make() if cfg.reward is not None else None


def make_distillation(cfg: RunConfig) -> Distillation | None:
    """[distill]: each teacher (a folder in this process with torch, or on SGLang; a url on its server)."""
    return cfg.distill.make() if cfg.distill is not None else None


def make_rollout(cfg: RunConfig, model: Path) -> Rollout:
    """The producer: the task and `engine.count` engines (any kind: indices 0 .. count - 1), the engine
    section's sampling keys, and how to make engine `index` of an elastic run (`[rollout] max_engines`)."""
    ctx = cfg.build_context(model)
    task = cfg.task.make(ctx)
    engines = [make_part("engine", cfg, model=model, index=i) for i in range(cfg.engine_count)]
    environment = cfg.environment
    return Rollout(task, engines, tokenizer=model, group_size=cfg.rollout.group_size,
                   request_timeout_s=cfg.rollout.request_timeout_s, max_failed_in_a_row=cfg.rollout.max_failed_in_a_row,
                   reward=make_reward(cfg),
                   evaluation=cfg.eval.make(ctx, task), limits=cfg.episode.make(),
                   environment=environment.kind if environment else None,
                   environment_options=environment.options() if environment else {},
                   gateway=cfg.gateway.make() if cfg.gateway else None,
                   teacher=make_distillation(cfg), transport=cfg.weights.transport,
                   engine_factory=functools.partial(_engine, cfg, model), **cfg.engine_sampling())


def _engine(cfg: RunConfig, model: Path, index: int) -> Any:
    """Engine `index` of the config (an elastic run's joiner: `Rollout.engine_factory`)."""
    return make_part("engine", cfg, model=model, index=index)


def make_buffer(cfg: RunConfig) -> RefBuffer:
    return cfg.buffer.make(make_part("store", cfg))


def make_faults(cfg: RunConfig) -> list[FaultSpec] | None:
    return [fault.make() for fault in cfg.faults] or None


def build_pipeline(cfg: RunConfig) -> Pipeline:
    """The Pipeline this config describes. Seeds torch with the run's seed before any model is made (the
    process itself is prepared by `Pipeline.run`: pipeline.process, the same for the DSL and the CLI)."""
    torch.manual_seed(cfg.seed)
    model = cfg.model.make()
    buffer = make_buffer(cfg)
    producer = make_rollout(cfg, model)
    return Pipeline(
        name=cfg.name, seed=cfg.seed, steps=cfg.steps, runtime=cfg.runtime, run_root=cfg.run_root,
        producer=producer, buffer=buffer, consumer=make_part("learner", cfg, model=model),
        staleness=make_part("staleness", cfg),
        produced_channel=(cfg.buffer.produced_channel, int(cfg.buffer.produced_bytes)),
        ready_channel=(cfg.buffer.ready_channel, int(cfg.buffer.ready_bytes)),
        progress=cfg.telemetry.progress, sinks=cfg.telemetry.sinks, ray_address=cfg.ray.address,
        ray_placement_timeout_s=cfg.ray.placement_timeout_s, ray_resources=cfg.ray.resources,
        checkpoint_every=cfg.checkpoint.every, checkpoint_keep=cfg.checkpoint.keep,
        watchdog=cfg.watchdog.make(), faults=make_faults(cfg), config_text=cfg.resolved_toml(),
        max_workers=cfg.rollout.max_engines,
    )


__all__ = ["build_pipeline", "make_part"]
