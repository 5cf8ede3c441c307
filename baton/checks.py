"""The checks across sections of a RunConfig, run in order by its one validator (`check_all`), before
anything starts: each raises a ValueError naming the keys and the fix. The first, `mode_sets_k`, also
resolves what depends on the staleness bound (staleness.k and lead, correction.kind and
learner.entropy_cap when `auto`); the last, `staleness_holds`, is the static check of `policies.bounds`.
A check imports the stage modules it reads (model folders, LoRA, experts) only when the config uses
them, so a config that does not loads no torch (baton.sections.base)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ByteSize

from baton.config import resolve
from baton.sections.base import default_of
from baton.sections.data import DatasetTaskSpec
from baton.sections.engines import SGLangEngineSpec, TorchEngineSpec, VLLMEngineSpec
from baton.sections.learner import GRPOSpec, MaxStalenessSpec
from baton.sections.rewards import MODEL_REWARDS, check_shared_tokenizer, is_url
from baton.sections.stores import MemoryStoreSpec, MooncakeStoreSpec
from policies.correction_settings import auto_entropy_cap
from policies.staleness import MaxStaleness, reuse_lead

if TYPE_CHECKING:
    from baton.schema import RunConfig


def check_all(cfg: RunConfig) -> None:
    """Every check, in this order (mode_sets_k first: the others read the k it resolves)."""
    for check in (mode_sets_k, learner_ranks_fit, lora_fits, episodes_from_one_place, own_model_fits,
                  model_rewards_load, distillation_fits, faults_fit, expert_parallel_fits, routing_replay_fits,
                  load_balance_fits, elastic_fits, staleness_holds):
        check(cfg)


def mode_sets_k(cfg: RunConfig) -> None:
    if isinstance(cfg.staleness, MaxStalenessSpec):
        if cfg.mode == "sync" and cfg.staleness.k not in (None, 0):
            raise ValueError(
                f"mode = 'sync' means staleness.k = 0, but staleness.k = {cfg.staleness.k}; "
                "remove staleness.k or set mode = 'async'"
            )
        if cfg.staleness.k is None:
            cfg.staleness.k = 0 if cfg.mode == "sync" else default_of(MaxStaleness, "k")
        set_lead(cfg, cfg.staleness)
    # a plug-in staleness policy names no k: its auto is k = 2's
    bound = cfg.staleness.k if isinstance(cfg.staleness, MaxStalenessSpec) else default_of(MaxStaleness, "k")
    cfg.correction.resolve_auto(bound)
    if isinstance(cfg.learner, GRPOSpec) and cfg.learner.entropy_cap == "auto":
        cfg.learner.entropy_cap = auto_entropy_cap(bound) or "off"
    if isinstance(cfg.store, MooncakeStoreSpec):
        check_mooncake_capacity(cfg, cfg.store)
    if cfg.weights.transport == "broadcast" and cfg.runtime == "local":
        raise ValueError(
            "weights.transport = 'broadcast' sends to engine processes, but runtime = 'local' keeps the "
            "engines in the learner's process; use weights.transport = 'inproc' or runtime = 'ray'"
        )
    if cfg.runtime == "ray" and isinstance(cfg.store, MemoryStoreSpec):
        raise ValueError(
            "runtime = 'ray' puts every stage in its own process, but store.kind = 'memory' lives in one; "
            "use store.kind = 'mooncake' or 'ray'"
        )
    if not cfg.model.create and not (Path(cfg.model.path) / "config.json").exists():
        raise ValueError(
            f"model.path = {cfg.model.path!r} holds no model (no config.json) and model.create = false; "
            "set model.create = true to make a tiny one there, or point model.path at an HF checkpoint"
        )


def learner_ranks_fit(cfg: RunConfig) -> None:
    """On the local runtime every learner rank is a process on this machine, each with its own device:
    a GPU each on CUDA, a core each on CPU."""
    if not isinstance(cfg.learner, GRPOSpec) or cfg.learner.world_size == 1 or cfg.runtime != "local":
        return
    import torch

    cuda = cfg.learner.device.startswith("cuda") or (cfg.learner.device == "auto" and torch.cuda.is_available())
    have, what = (torch.cuda.device_count(), "GPUs") if cuda else (os.cpu_count() or 1, "CPU cores")
    if cfg.learner.world_size > have:
        raise ValueError(
            f"learner.world_size = {cfg.learner.world_size}, but this machine has {have} {what} and every "
            f"learner rank needs one of its own; set learner.world_size to at most {have}, or use runtime = "
            "'ray' on a cluster that has them"
        )


def lora_fits(cfg: RunConfig) -> None:
    """LoRA's settings fit the model and the engine, before anything starts: target modules the model
    has (and the engine serves), a rank the server takes, room for the staleness window's adapters, a way in
    for them."""
    lora = cfg.learner.lora if isinstance(cfg.learner, GRPOSpec) else None
    if lora is None:
        return
    from stages.data.model import linear_module_names
    from stages.engines.vllm_lora import RANKS as VLLM_RANKS
    from stages.engines.vllm_lora import target_problem as vllm_target_problem
    from stages.learner.lora import check_targets

    check_targets(lora.target_modules, linear_module_names(cfg.model.path))
    lora.spec()  # its own checks (target_experts with dropout)
    if lora.target_experts:
        lora_experts_fit(cfg)
    if isinstance(cfg.engine, VLLMEngineSpec) and (problem := vllm_target_problem(lora.target_modules)):
        raise ValueError(f"learner.lora.target_modules = {list(lora.target_modules)} with engine.kind = 'vllm': "
                         f"{problem}")
    if not isinstance(cfg.engine, SGLangEngineSpec | VLLMEngineSpec):
        return
    engine, k = cfg.engine, cfg.staleness.k if isinstance(cfg.staleness, MaxStalenessSpec) else None
    server = "SGLang" if isinstance(engine, SGLangEngineSpec) else "vLLM"
    limit = engine.lora_rank_limit() or (VLLM_RANKS[-1] if server == "vLLM" else None)
    if limit is not None and lora.rank > limit:
        raise ValueError(f"learner.lora.rank = {lora.rank} is above the {server} server's --max-lora-rank {limit} "
                         "(engine.max_lora_rank or engine.extra_args; vLLM's largest: 512): it would refuse every "
                         "adapter; lower learner.lora.rank or raise engine.max_lora_rank")
    if k is not None and engine.max_loaded_loras is not None and engine.max_loaded_loras < k + 2:
        raise ValueError(f"engine.max_loaded_loras = {engine.max_loaded_loras}, but staleness.k = {k} keeps up "
                         f"to k + 1 adapters in use plus the one loading; set it to at least {k + 2} (or unset)")
    if isinstance(engine, SGLangEngineSpec) and engine.update == "distributed":
        raise ValueError("engine.update = 'distributed' moves full weights only; SGLang loads LoRA adapters from "
                         "tensors or a folder: with learner.lora set engine.update = 'tensor' (same host) or "
                         "'disk' (a folder the server reads)")


def lora_experts_fit(cfg: RunConfig) -> None:
    """learner.lora.target_experts needs a mixture-of-experts model (one `create` makes with model.experts,
    or a folder whose config has routed experts) and an engine that applies adapters on the experts: the
    torch engine merges them; SGLang's MoE LoRA (0.5.x) runs on CUDA kernels only and takes per-expert adapter
    names, so a server is not sent one."""
    from stages.data.routing import folder_moe_layout
    from stages.engines.vllm_lora import target_problem as vllm_target_problem

    dense = not cfg.model.experts if cfg.model.create else folder_moe_layout(cfg.model.path) is None
    if dense:
        where = "model.experts = 0 makes a dense model" if cfg.model.create else \
            f"model.path = {cfg.model.path!r} is not a mixture of experts"
        raise ValueError(f"learner.lora.target_experts = true adapts a mixture of experts' experts, but {where}: set "
                         "learner.lora.target_experts = false (the adapter then targets target_modules)")
    if isinstance(cfg.engine, VLLMEngineSpec):
        raise ValueError(f"learner.lora.target_experts = true: {vllm_target_problem((), target_experts=True)}")
    if isinstance(cfg.engine, SGLangEngineSpec):
        raise ValueError("learner.lora.target_experts = true: SGLang does not serve adapters on the experts here (its "
                         "MoE LoRA needs CUDA kernels and per-expert adapters); set learner.lora.target_experts = "
                         "false (attention adapters serve on SGLang), or use engine.kind = 'torch'")


def episodes_from_one_place(cfg: RunConfig) -> None:
    """Episodes come from the rollout's environment or from the gateway's agents, not both."""
    if cfg.gateway is None:
        return
    if cfg.environment is not None:
        raise ValueError("[gateway] and [environment] are both set: with a gateway the agents run the episodes; "
                         "remove [environment] (an agent may call its own tools) or [gateway]")
    if cfg.runtime == "ray":
        raise ValueError("[gateway] runs with runtime = 'local' for now (one gateway in front of the run's "
                         "engines); set runtime = 'local' or remove [gateway]")


def elastic_fits(cfg: RunConfig) -> None:
    """`[rollout] max_engines` (engines that join and leave while the run goes on): at least engine.count,
    not in gateway mode (docs/guides/elastic.md)."""
    most = cfg.rollout.max_engines
    if most is None:
        return
    if most < cfg.engine_count:
        raise ValueError(f"rollout.max_engines = {most} is below engine.count = {cfg.engine_count}; raise it to at "
                         f"least {cfg.engine_count}, or remove it for a fixed fleet")
    if cfg.gateway is not None:
        raise ValueError("rollout.max_engines does not combine with [gateway] (its gateway lives on the first "
                         "worker); remove one of them")


def own_model_fits(cfg: RunConfig) -> None:
    """A model folder of one's own loads, with a chat template when the task gives chat prompts; a
    reward or eval split needs a task that has answers to check (a dataset's)."""
    if not cfg.model.create:
        from stages.data.model import check_model_folder

        try:
            check_model_folder(cfg.model.path, needs_chat_template=isinstance(cfg.task, DatasetTaskSpec)
                               and cfg.task.uses_chat)
        except ValueError as exc:
            raise ValueError(f"model.path: {exc}") from None
    if cfg.eval.every and isinstance(cfg.task, DatasetTaskSpec) and cfg.task.eval_path is None:
        raise ValueError("eval.every is set, but the dataset task has no task.eval_path to evaluate")


def expert_parallel_fits(cfg: RunConfig) -> None:
    """learner.expert_parallel > 1 needs a mixture-of-experts model whose expert count it divides (`[model]
    experts` for a model `create` makes, else the folder's config) and equals learner.world_size (every rank
    one shard of the experts); LoRA's adapters are not sharded by experts yet."""
    degree = getattr(cfg.learner, "expert_parallel", 1)
    if degree == 1:
        return
    if cfg.learner.lora is not None:
        raise ValueError(f"learner.expert_parallel = {degree} and [learner] lora do not go together yet: set "
                         "learner.expert_parallel = 1 to train LoRA adapters")
    from stages.data.routing import folder_moe_layout
    from stages.learner.experts import check_expert_parallel

    if cfg.model.create:
        experts = cfg.model.experts
    else:
        layout = folder_moe_layout(cfg.model.path)
        experts = layout.experts if layout is not None else 0
    check_expert_parallel(degree, experts, cfg.learner.world_size)


def load_balance_fits(cfg: RunConfig) -> None:
    """learner.load_balance_coef > 0 weighs a router's load-balancing loss: it needs a mixture-of-experts model
    (one `create` makes with model.experts, or a folder whose config has routed experts)."""
    coef = getattr(cfg.learner, "load_balance_coef", 0.0)
    if coef <= 0:
        return
    from stages.data.routing import folder_moe_layout

    dense = not cfg.model.experts if cfg.model.create else folder_moe_layout(cfg.model.path) is None
    if dense:
        raise ValueError(f"learner.load_balance_coef = {coef} weighs a mixture-of-experts router's load-balancing "
                         "loss, but the model is dense: set model.experts (e.g. 8) or learner.load_balance_coef = 0")


def routing_replay_fits(cfg: RunConfig) -> None:
    """learner.routing_replay = 'rollout' needs a mixture-of-experts model (one `create` makes with
    model.experts, or a folder whose config has routed experts) and an engine that returns the experts it
    routed to: the torch engine and SGLang's server do on an MoE model, vLLM's CPU server does not; a plug-in says
    so by a class attribute `returns_routed_experts = True`."""
    replay = getattr(cfg.learner, "routing_replay", "off")
    if replay == "off":
        return
    from stages.learner.replay import check_routing_replay

    if cfg.model.create and not cfg.model.experts:
        raise ValueError("learner.routing_replay = 'rollout' replays routed experts, but model.experts = 0 makes a "
                         "dense model: set model.experts (e.g. 8), or learner.routing_replay = 'off'")
    engine = cfg.engine
    if isinstance(engine, TorchEngineSpec | SGLangEngineSpec):
        returns = True
    elif isinstance(engine, VLLMEngineSpec):  # not on CPU: Model Runner V2 needs Triton (stages.engines.vllm)
        from stages.engines.vllm import VLLMEngine

        returns = VLLMEngine.returns_routed_experts
    else:
        returns = getattr(resolve(engine.kind), "returns_routed_experts", False)
    # a model `create` makes is an MoE (checked above) made when the run starts: no folder to read yet
    check_routing_replay(None if cfg.model.create else cfg.model.path, replay, engine_returns_experts=returns)


def model_rewards_load(cfg: RunConfig) -> None:
    """Each model reward's folder, tokenizer, template, labels, parser and token file, before anything starts."""
    for name in MODEL_REWARDS:
        spec = getattr(cfg.reward, name, None)
        if spec is not None:
            try:
                spec.make()
            except ValueError as exc:
                raise ValueError(f"reward.{name}: {exc}") from None


def distillation_fits(cfg: RunConfig) -> None:
    """Teachers share the student's tokenizer; groups with equal rewards are not filtered (the teacher's
    term is their signal)."""
    if cfg.distill is None:
        return
    student = None if cfg.model.create and not (Path(cfg.model.path) / "tokenizer.json").exists() \
        else cfg.model.path
    for name, where in cfg.distill.teachers().items():
        if not is_url(where):
            key = "distill.teacher" if isinstance(cfg.distill.teacher, str) else f"distill.teacher.{name}"
            check_shared_tokenizer(where, student, key)
    if cfg.replay.drop_zero_signal:
        raise ValueError("replay.drop_zero_signal filters groups whose rewards are all equal, but with [distill] "
                         "the teacher's term gives them signal; set replay.drop_zero_signal = false")


def faults_fit(cfg: RunConfig) -> None:
    """Each planned fault has what its recovery needs; say which key to set before anything starts."""
    kinds = [f.kind for f in cfg.faults]
    twice = sorted({k for k in kinds if kinds.count(k) > 1})
    if twice:
        raise ValueError(f"faults: {', '.join(twice)} planned more than once; merge their `at` lists into one")
    if "engine.hang" in kinds and cfg.rollout.request_timeout_s is None:
        raise ValueError(
            "fault engine.hang needs rollout.request_timeout_s, which turns a hang into an error and the groups "
            "into regenerated ones; set rollout.request_timeout_s (e.g. 10)"
        )
    for kind in ("store.master_restart", "store.holder_crash"):
        if kind in kinds and not isinstance(cfg.store, MooncakeStoreSpec):
            raise ValueError(f"fault {kind} acts on Mooncake processes, but store.kind = {cfg.store.kind!r}; "
                             "set store.kind = 'mooncake' or remove the fault")
    if "store.master_restart" in kinds and cfg.runtime == "ray" and cfg.store.master == "auto":
        raise ValueError(
            "fault store.master_restart with runtime = 'ray' needs a master the faults runner owns: run it with "
            "`baton faults CONFIG`, or use runtime = 'local' (which restarts its own store.master = 'auto')"
        )
    elastic = [k for k in kinds if k in ELASTIC_FAULTS]
    if elastic and cfg.rollout.max_engines is None:
        raise ValueError(f"fault {elastic[0]} grows or shrinks the run's engines, which needs rollout.max_engines; set "
                         f"rollout.max_engines = {cfg.engine_count + 1} or remove the fault")
    in_push = [k for k in kinds if k in ("engine.join_in_push", "engine.preempt_in_push")]
    if in_push and cfg.runtime == "ray":
        raise ValueError(f"fault {in_push[0]} acts from the learner's push on the run's fleet, which on runtime = "
                         "'ray' lives in the driver, not the learner's process; use runtime = 'local' or "
                         "engine.join / engine.leave")
    if "store.holder_crash" in kinds and cfg.store.replicas < 2:
        raise ValueError(
            f"fault store.holder_crash is survived with store.replicas = 2, but store.replicas = "
            f"{cfg.store.replicas}; set store.replicas = 2 (`baton faults` does, and starts the second holder)"
        )


ELASTIC_FAULTS = ("engine.join", "engine.leave", "engine.join_in_push", "engine.preempt_in_push")


def staleness_holds(cfg: RunConfig) -> None:
    """The static check of `policies.bounds`: refuse a shape that can break the staleness bound. Runs after
    _mode_sets_k (validators run in the order defined), so staleness.k is set."""
    from policies.bounds import check

    shape = cfg.pipeline_shape()
    if shape is None:
        return  # plug-ins: their numbers mean what their authors say
    problems = check(shape)
    if problems:
        raise ValueError("the staleness bound does not hold: " + " | ".join(problems))


def set_lead(cfg: RunConfig, staleness: MaxStalenessSpec) -> None:
    """Check staleness.lead against k, or derive it from replay.max_reuse when unset: groups that
    arrive k versions old could never be trained again, so reuse would silently never happen."""
    k = staleness.k
    assert k is not None
    if staleness.lead is not None and staleness.lead > k:
        raise ValueError(
            f"staleness.lead = {staleness.lead} is more than staleness.k = {k}: producers may run at most k "
            f"versions ahead; set staleness.lead to at most {k}, or remove it"
        )
    if staleness.lead is None and cfg.replay.max_reuse > 1:
        staleness.lead = reuse_lead(k, cfg.replay.max_reuse)

def check_mooncake_capacity(cfg: RunConfig, store: MooncakeStoreSpec) -> None:
    """Miles's rule, per node: the segment must hold every byte the pipeline lets be in flight,
    times the replicas, below the master's eviction watermark (90 %)."""
    need = cfg.buffer.bytes_in_flight * store.replicas
    have = int(store.global_segment_size * 0.9)
    if need > have:
        raise ValueError(
            f"store.global_segment_size = {store.global_segment_size.human_readable()} holds "
            f"{ByteSize(have).human_readable()} before Mooncake evicts, but buffer.produced_bytes + "
            f"buffer.max_bytes + buffer.ready_bytes = {ByteSize(cfg.buffer.bytes_in_flight).human_readable()} "
            f"x store.replicas = {store.replicas} may be in flight; raise store.global_segment_size to at "
            f"least {ByteSize(-(-need * 10 // 9)).human_readable()} or lower the buffer's byte bounds"
        )
    if store.replicas > 1 and store.master == "auto":
        raise ValueError(
            f"store.replicas = {store.replicas} needs that many processes holding segments, but with "
            "store.master = 'auto' only the buffer's process holds one; use replicas = 1, "
            "or attach (store.master = 'host:port') to a cluster with more segment holders"
        )
