"""`build_pipeline(cfg)`: the Pipeline a RunConfig describes, the same objects the Python DSL builds.

Every kinded part (task, engine, store, learner, staleness, weights) is made through one registry,
`KINDS[part][kind]`, of small named factories `factory(spec, cfg, **context)`; a `"pkg.mod:Class"`
kind (a PluginSpec) takes the same path, `make_part`, and is called with its section's other keys.
The parts without kinds (model, rollout, buffer, correction, selection, watchdog, faults) have one
factory each below. Factories only call the parts' public constructors.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from baton import schema
from baton.config import ConfigError, resolve
from baton.schema import PluginSpec, RunConfig, default_of
from buffers import MemoryStore, RefBuffer
from buffers.mooncake import MooncakeSettings, MooncakeStore
from buffers.mooncake import MooncakeStoreSpec as MooncakeOpener
from buffers.ray_store import RayStoreSpec as RayStoreOpener
from pipeline.dsl import Pipeline
from pipeline.faults import FaultSpec
from pipeline.watchdog import WatchdogSettings
from policies import MaxStaleness
from policies.correction import Correction
from policies.selection import Selection, make_selection
from stages.data.datasets import DatasetTask
from stages.data.model import make_tiny_model
from stages.data.rewards import RewardFunction, weighted_sum
from stages.data.tasks import Addition, ReverseDigits
from stages.engines.sglang import SGLangEngine
from stages.engines.sglang_lora import LoraServing
from stages.engines.torch import TorchEngine
from stages.learner import GRPOLearner
from stages.rollout import Rollout
from stages.rollout.episode import EpisodeLimits
from stages.rollout.evaluation import Evaluation
from stages.rollout.gateway_worker import GatewaySettings
from stages.scorers import ComposedReward, Distillation, ServerSettings, SGLangTeacher, TorchTeacher
from stages.weights import make_transport, transport_options
from stages.weights.base import WeightTransport


def reverse_digits(spec: schema.ReverseDigitsSpec, cfg: RunConfig) -> ReverseDigits:
    return ReverseDigits(digits=spec.digits)


def addition(spec: Any, cfg: RunConfig) -> Addition:
    return Addition()


def dataset_task(spec: schema.DatasetTaskSpec, cfg: RunConfig) -> DatasetTask:
    """Reads (and checks) every row now, before anything starts; the run's seed orders the epochs."""
    try:
        return DatasetTask(**spec.model_dump(exclude={"kind", "metadata_fields"}),
                           metadata_fields=tuple(spec.metadata_fields), seed=cfg.seed)
    except ValueError as exc:
        raise ConfigError(f"task: {exc}") from None


def torch_engine(spec: Any, cfg: RunConfig, *, model: Path, index: int) -> TorchEngine:
    return TorchEngine(model, name=f"torch-{index}", seed=cfg.seed + index, dtype=cfg.model.dtype)


def lora_serving(spec: schema.SGLangEngineSpec, cfg: RunConfig) -> LoraServing | None:
    """With learner.lora, what each server is launched to serve: the adapters' rank (or the server's limit), their
    target modules, and room for the staleness window (k + 2 unless engine.max_loaded_loras says more)."""
    lora = cfg.learner.lora if isinstance(cfg.learner, schema.GRPOSpec) else None
    if lora is None:
        return None
    k = cfg.staleness.k if isinstance(cfg.staleness, schema.MaxStalenessSpec) else default_of(MaxStaleness, "k")
    return LoraServing(max_rank=spec.lora_rank_limit() or lora.rank, target_modules=tuple(lora.target_modules),
                       max_loaded=spec.max_loaded_loras or k + 2)


def sglang_engine(spec: schema.SGLangEngineSpec, cfg: RunConfig, *, model: Path, index: int) -> SGLangEngine:
    return SGLangEngine(
        model, name=f"sglang-{index}", url=spec.urls[index] if spec.urls else None, python=spec.python,
        dtype=spec.dtype if "dtype" in spec.model_fields_set else cfg.model.dtype, device=spec.device,
        threads=spec.threads, max_total_tokens=spec.max_total_tokens,
        extra_args=tuple(spec.extra_args), update=spec.update, pause_mode=spec.pause_mode,
        max_restarts=spec.max_restarts, lora=lora_serving(spec, cfg),
        # locally every engine sees every GPU; on Ray each process sees the one Ray gave it
        gpu_id=spec.base_gpu_id + index if spec.device == "cuda" and cfg.runtime == "local" else None,
    )


def memory_store(spec: Any, cfg: RunConfig) -> MemoryStore:
    return MemoryStore(capacity_bytes=spec.capacity)


def mooncake_store(spec: schema.MooncakeStoreSpec, cfg: RunConfig) -> MooncakeStore | MooncakeOpener:
    """Locally, the store itself; on Ray, an opener: each process opens its own client (the buffer's holds
    the segment)."""
    settings = MooncakeSettings(
        protocol=spec.protocol, device=spec.device, global_segment_size=int(spec.global_segment_size),
        local_buffer_size=int(spec.local_buffer_size), chunk_bytes=int(spec.chunk_bytes), replicas=spec.replicas,
    )
    if cfg.runtime == "ray":
        return MooncakeOpener(settings, master=spec.master)
    return MooncakeStore.open(settings, master=spec.master)


def ray_store(spec: schema.RayStoreSpec, cfg: RunConfig) -> RayStoreOpener:
    """One index per run, so runs sharing a cluster never mix keys."""
    capacity = int(spec.capacity) if spec.capacity else None
    return RayStoreOpener(name=f"ray-{cfg.name}-{uuid.uuid4().hex[:8]}", capacity_bytes=capacity)


def grpo_learner(spec: Any, cfg: RunConfig, *, model: Path) -> GRPOLearner:
    return GRPOLearner(
        model, **spec.model_dump(exclude={"kind", "lora", "entropy_cap"}),  # the others are GRPOLearner fields
        lora=spec.lora.spec() if spec.lora is not None else None,
        entropy_cap=None if spec.entropy_cap == "off" else spec.entropy_cap,  # "auto" is resolved at load
        temperature=cfg.engine_sampling().get("temperature", default_of(GRPOLearner, "temperature")),
        weights=make_part("weights", cfg), snapshot_every=cfg.weights.snapshot_every,
        correction=make_correction(cfg), selection=make_selection_policy(cfg),
        replays_ride_along=cfg.replay.ride_along, export_every=cfg.checkpoint.export_every,
        distill_coef=cfg.distill.coef if cfg.distill else 0.0,
        distill_mode=cfg.distill.mode if cfg.distill else default_of(GRPOLearner, "distill_mode"),
        distill_baseline=cfg.distill.baseline if cfg.distill else default_of(GRPOLearner, "distill_baseline"),
    )


def max_staleness(spec: schema.MaxStalenessSpec, cfg: RunConfig) -> MaxStaleness:
    return MaxStaleness(**spec.model_dump(exclude={"kind"}))  # the spec mirrors the class, key for key


def weight_transport(spec: schema.WeightsSpec, cfg: RunConfig) -> WeightTransport | str:
    """The transport (a built-in or a plug-in's path) with the config keys its constructor takes, those set
    (unset: its own default), or its name when it gets none (the learner makes it then)."""
    values = {"protocol": spec.protocol, "device": spec.device,
              "bucket_bytes": int(spec.bucket_bytes) if spec.bucket_bytes else None,
              "pace_bytes_per_s": float(spec.pace) if spec.pace else None, "retries": spec.retries, "root": spec.root,
              "sparse": spec.sparse,
              # the learner trains in float32; engines holding another dtype get (and are diffed in) theirs
              "engine_dtype": cfg.model.dtype if cfg.model.dtype != "float32" else None}
    options = {key: values[key] for key in transport_options(spec.transport) if values.get(key) is not None}
    return make_transport(spec.transport, **options) if options else spec.transport


def make_correction(cfg: RunConfig) -> Correction:
    return Correction(**cfg.correction.model_dump())


def make_selection_policy(cfg: RunConfig) -> Selection:
    r = cfg.replay
    return make_selection(r.selection, max_reuse=r.max_reuse, drop_zero_signal=r.drop_zero_signal,
                          max_filtered_batches=r.max_filtered_batches, seed=cfg.seed)


KINDS: dict[str, dict[str, Callable[..., Any]]] = {
    "task": {"reverse-digits": reverse_digits, "addition": addition, "dataset": dataset_task},
    "engine": {"torch": torch_engine, "sglang": sglang_engine},
    "store": {"memory": memory_store, "mooncake": mooncake_store, "ray": ray_store},
    "learner": {"grpo": grpo_learner},
    "staleness": {"max-staleness": max_staleness},
    "weights": {"transport": weight_transport},  # every transport, a built-in or a plug-in's path
}


def make_part(part: str, cfg: RunConfig, **context: Any) -> Any:
    """The object `cfg.<part>` describes: its kind's factory from KINDS (given `context`, e.g. the model),
    or a plug-in's class, resolved from `"pkg.mod:Class"` and called with the section's other keys."""
    spec = getattr(cfg, part)
    if isinstance(spec, PluginSpec):
        return resolve(spec.kind)(**(spec.model_extra or {}))
    return KINDS[part][spec.kind](spec, cfg, **context)


def make_model(spec: schema.ModelSpec) -> Path:
    """The model folder: a tiny random-init model made there when `create` (reused when present)."""
    if not spec.create:
        return Path(spec.path)
    return make_tiny_model(spec.path, hidden_size=spec.hidden_size, layers=spec.layers, heads=spec.heads,
                           kv_heads=spec.kv_heads, seed=spec.seed)


def make_reward(cfg: RunConfig) -> RewardFunction | ComposedReward | None:
    """[reward]: one function, or the weighted sum of `weights`, with the model rewards of [reward.classifier]
    and [reward.judge] composed in; None: the task's own."""
    spec = cfg.reward
    if spec is None:
        return None
    rules = {name: weight for name, weight in spec.weights.items() if name not in schema.MODEL_REWARDS}
    fn = spec.function or (weighted_sum(*rules.items()) if rules else None)
    rule = RewardFunction(fn, timeout_s=spec.timeout_s, on_error=spec.on_error, batched=spec.batched) if fn else None
    models = [(getattr(spec, name).make(), spec.weights[name]) for name in schema.MODEL_REWARDS
              if getattr(spec, name) is not None]
    return ComposedReward(rule, models, on_error=spec.on_error) if models else rule


def make_distillation(cfg: RunConfig) -> Distillation | None:
    """[distill]: each teacher (a folder in this process with torch, or on SGLang; a url on its server)."""
    spec = cfg.distill
    if spec is None:
        return None
    teachers: dict[str, Any] = {}
    for name, where in spec.teachers().items():
        if schema.is_url(where) or spec.backend == "sglang":
            at = {"url": where} if schema.is_url(where) else {"model": where}
            teachers[name] = SGLangTeacher(ServerSettings(**at, **spec.model_dump(include={
                "token_file", "concurrency", "timeout_s", "retries", "max_restarts", "python", "dtype", "device"})),
                name=f"teacher-{name}")
        else:
            teachers[name] = TorchTeacher(where, dtype=spec.dtype, name=f"teacher-{name}")
    return Distillation(teachers, key=spec.teacher_key, on_error=spec.on_error)


def make_evaluation(cfg: RunConfig, task: Any) -> Evaluation | None:
    """[eval]: a dataset task's eval split, or seeded samples of a built-in task; None when eval.every = 0."""
    if not cfg.eval.every:
        return None
    eval_task = task.eval_task() if isinstance(task, DatasetTask) else task
    return Evaluation(eval_task, seed=cfg.seed, **cfg.eval.model_dump())


def make_rollout(cfg: RunConfig, model: Path) -> Rollout:
    """The producer: the task and `engine.count` engines; the engine section's sampling keys when it has them."""
    task = make_part("task", cfg)
    engines = [make_part("engine", cfg, model=model, index=i) for i in range(cfg.engine_count)]
    sampling = cfg.engine_sampling()
    environment = cfg.environment
    return Rollout(task, engines, tokenizer=model, group_size=cfg.rollout.group_size,
                   request_timeout_s=cfg.rollout.request_timeout_s, reward=make_reward(cfg),
                   evaluation=make_evaluation(cfg, task), limits=EpisodeLimits(**cfg.episode.model_dump()),
                   environment=environment.kind if environment else None,
                   environment_options=environment.options() if environment else {},
                   gateway=GatewaySettings(**cfg.gateway.model_dump()) if cfg.gateway else None,
                   teacher=make_distillation(cfg), transport=cfg.weights.transport, **sampling)


def make_buffer(cfg: RunConfig) -> RefBuffer:
    return RefBuffer(make_part("store", cfg), max_refs=cfg.buffer.max_refs, max_bytes=int(cfg.buffer.max_bytes))


def make_faults(cfg: RunConfig) -> list[FaultSpec] | None:
    return [FaultSpec(f.kind, tuple(f.at), f.probability, f.seed, f.delay_s) for f in cfg.faults] or None


def build_pipeline(cfg: RunConfig) -> Pipeline:
    """The Pipeline this config describes. Seeds torch with the run's seed before any model is made."""
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    model = make_model(cfg.model)
    buffer = make_buffer(cfg)
    producer = make_rollout(cfg, model)
    return Pipeline(
        name=cfg.name, seed=cfg.seed, steps=cfg.steps, runtime=cfg.runtime, run_root=cfg.run_root,
        producer=producer, buffer=buffer, consumer=make_part("learner", cfg, model=model),
        staleness=make_part("staleness", cfg),
        produced_channel=(cfg.buffer.produced_channel, int(cfg.buffer.produced_bytes)),
        ready_channel=(cfg.buffer.ready_channel, int(cfg.buffer.ready_bytes)),
        progress=cfg.telemetry.progress, sinks=cfg.telemetry.sinks, ray_address=cfg.ray.address,
        ray_placement_timeout_s=cfg.ray.placement_timeout_s,
        checkpoint_every=cfg.checkpoint.every, checkpoint_keep=cfg.checkpoint.keep,
        watchdog=WatchdogSettings(**cfg.watchdog.model_dump()),
        faults=make_faults(cfg), config_text=cfg.resolved_toml(),
    )


__all__ = ["KINDS", "build_pipeline", "make_part"]
