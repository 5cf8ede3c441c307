"""The run config: a TOML file that maps one to one onto the Python DSL.

    name, seed, steps, mode ("async" | "sync"), runtime ("local"), run_root
    [model]      path, create, hidden_size, layers, heads, kv_heads, seed
    [task]       kind = "reverse-digits" | "addition" | "pkg.mod:Class" (+ its keys)
    [engine]     kind = "torch" | "sglang" | "pkg.mod:Class", count, batch_groups, temperature, top_p
                 (sglang: urls, python, dtype, device, threads, max_total_tokens, extra_args, update,
                 pause_mode, max_restarts)
    [rollout]    group_size
    [store]      kind = "memory" (capacity) | "mooncake" (master, protocol, device, global_segment_size,
                 local_buffer_size, chunk_bytes, replicas) | "pkg.mod:Class"
    [buffer]     max_refs, max_bytes, produced_channel, produced_bytes, ready_channel, ready_bytes
    [learner]    kind = "grpo", lr, groups_per_step, clip_eps, max_grad_norm, weight_decay, epochs, device
    [staleness]  kind = "max-staleness", k, on_stale = "drop" | "requeue", max_span, admission = "pace" | "eager"
    [correction] kind = "none" | "tis" | "decoupled", tis_cap, decoupled_cap
    [replay]     max_reuse, selection = "fifo" | "freshest" | "uniform", drop_zero_signal, max_filtered_batches
    [weights]    transport = "inproc" | "mooncake_p2p" (protocol, device, bucket_bytes, pace, retries)
                 | "disk" (root, retries) | "delta" | "broadcast" (retries; runtime = "ray")
    [telemetry]  log_format = "console" | "json", progress
    [[faults]]   kind (pipeline.faults.FAULT_KINDS), at = [occurrences] | probability, seed, delay_s
    [checkpoint] every (versions between checkpoints, 0: off), keep (checkpoints kept); both runtimes
    [watchdog]   warn_after_s, fail_after_s (seconds without progress; 0: off), poll_s; both runtimes
    [simulate]   costs and cluster shape for `baton simulate` (stages.simulate.SimulateSpec); not used by run

Unknown keys and bad values fail validation, naming the key, the value and what is allowed. So does a
config whose shape can break its own staleness bound (`policies.bounds`: queues that let groups age
past k, PPO epochs that compound staleness, a reuse count k cannot reach), before anything starts.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pipeline.config import ConfigError, resolve, to_toml
from pipeline.faults import FAULT_KINDS, FaultSpec
from stages.simulate import SimulateSpec


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PluginSpec(BaseModel):
    """`kind = "package.module:Class"`; every other key is passed to the class as a keyword."""

    model_config = ConfigDict(extra="allow")
    kind: Annotated[str, Field(pattern=r"^[\w.]+:\w+$")]

    def build(self, **extra: Any) -> Any:
        return resolve(self.kind)(**{**(self.model_extra or {}), **extra})


def kinds(*members: type[BaseModel]) -> Any:
    """A discriminated union on `kind` (the first member is the default when `kind` is omitted),
    plus the `pkg.mod:Class` plug-in form."""
    default = members[0].model_fields["kind"].default

    def tag(value: Any) -> str:
        kind = value.get("kind", default) if isinstance(value, dict) else getattr(value, "kind", default)
        return "plugin" if isinstance(kind, str) and ":" in kind else kind

    union: Any = Annotated[PluginSpec, Tag("plugin")]
    for member in members:
        union = union | Annotated[member, Tag(member.model_fields["kind"].default)]
    return Annotated[union, Discriminator(tag)]


class ModelSpec(Section):
    path: str = "runs/models/tiny-qwen2"
    create: bool = Field(True, description="make a random-init tiny model there if it is missing")
    hidden_size: int = Field(64, ge=8)
    layers: int = Field(2, ge=1)
    heads: int = Field(4, ge=1)
    kv_heads: int = Field(2, ge=1)
    seed: int = Field(0, description="seed of the random init (independent of the run's seed)")


class ReverseDigitsSpec(Section):
    kind: Literal["reverse-digits"] = "reverse-digits"
    digits: int = Field(2, ge=1, le=16)


class AdditionSpec(Section):
    kind: Literal["addition"] = "addition"


class TorchEngineSpec(Section):
    kind: Literal["torch"] = "torch"
    count: int = Field(1, ge=1, le=16, description="engine workers (each its own producer actor)")
    batch_groups: int = Field(16, ge=1, description="groups generated per engine call")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)


class SGLangEngineSpec(Section):
    """SGLang servers: launched on 127.0.0.1 (CPU flags when no GPU), or attached by `urls`."""

    kind: Literal["sglang"] = "sglang"
    count: int = Field(1, ge=1, le=64, description="servers (each its own producer actor)")
    urls: list[Annotated[str, Field(pattern=r"^https?://[\w.-]+:\d+/?$")]] = Field(
        default_factory=list, description="attach to running servers instead of launching (one per engine)"
    )
    python: str | None = Field(
        None, description="interpreter with sglang (default: $BATON_SGLANG_PYTHON, then .venv-sglang)"
    )
    batch_groups: int = Field(16, ge=1, description="groups generated per engine call")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int = Field(1, ge=1, description="torch threads per server process on CPU")
    max_total_tokens: int = Field(16384, ge=256, description="KV-cache tokens per server")
    extra_args: list[str] = Field(default_factory=list, description="more sglang.launch_server flags, verbatim")
    update: Literal["tensor", "distributed", "disk"] = Field(
        "tensor", description="how weights enter the server: update_weights_from_{tensor,distributed,disk}"
    )
    pause_mode: Literal["in_place", "retract"] = Field(
        "in_place", description="how in-flight requests pause for a weight update (keep or recompute their KV)"
    )
    max_restarts: int = Field(3, ge=0, description="restarts of a dead server before the run fails")
    base_gpu_id: int = Field(0, ge=0, description="device = 'cuda': engine i runs on GPU base_gpu_id + i")

    @model_validator(mode="after")
    def _check(self) -> SGLangEngineSpec:
        if self.urls and len(self.urls) != self.count:
            if "count" in self.model_fields_set:
                raise ValueError(f"engine.urls has {len(self.urls)} entries but engine.count = {self.count}; "
                                 "give one url per engine or drop engine.count")
            self.count = len(self.urls)
        return self

    @field_validator("python")
    @classmethod
    def _server_environment(cls, python: str | None, info: ValidationInfo) -> str | None:
        """Launching needs an interpreter with sglang; say how to make one before anything starts."""
        if not info.data.get("urls"):
            from stages.engines.sglang_server import SGLangUnavailable, sglang_python

            try:
                sglang_python(python)
            except SGLangUnavailable as exc:
                raise ValueError(f"cannot launch an SGLang server: {exc}") from None
        return python


class RolloutSpec(Section):
    group_size: int = Field(8, ge=2)
    request_timeout_s: float | None = Field(
        None, gt=0, description="an engine call not answered within this is an error and its groups are generated "
        "again; unset: wait (required by the engine.hang fault)"
    )


class FaultConfig(Section):
    """One `[[faults]]` entry (pipeline.faults): a named injection point and when it fires."""

    kind: Literal[FAULT_KINDS] = Field(description="the injection point, e.g. 'store.get_fail'")  # type: ignore[valid-type]
    at: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=list, description="occurrences (1-based) at which it fires; learner.crash: learner versions"
    )
    probability: float = Field(0.0, ge=0, le=1, description="instead of `at`: the chance it fires at each occurrence")
    seed: int = Field(0, description="seeds the `probability` draws")
    delay_s: float = Field(5.0, gt=0, description="engine.hang / channel.stall: how long it lasts")

    @model_validator(mode="after")
    def _one_schedule(self) -> FaultConfig:
        if bool(self.at) == bool(self.probability):
            both = "both `at` and" if self.at else "neither `at` nor"
            raise ValueError(
                f"fault {self.kind!r} has {both} `probability`: give exactly one, e.g. at = [3] "
                "(fire at the 3rd occurrence) or probability = 0.01"
            )
        return self


class MemoryStoreSpec(Section):
    kind: Literal["memory"] = "memory"
    capacity: ByteSize | None = None


class MooncakeStoreSpec(Section):
    """Mirrors Miles's `--mooncake-store-init-kwargs`; MOONCAKE_* environment variables give defaults."""

    kind: Literal["mooncake"] = "mooncake"
    master: str = Field(
        default_factory=lambda: os.environ.get("MOONCAKE_MASTER_ADDR", "auto"),
        pattern=r"^(auto|[\w.-]+:\d+)$",
        description='"auto" starts a master on 127.0.0.1 for the run; "host:port" attaches',
    )
    protocol: str = Field(default_factory=lambda: os.environ.get("MOONCAKE_PROTOCOL", "tcp"))
    device: str = Field(default_factory=lambda: os.environ.get("MOONCAKE_DEVICE", ""))
    global_segment_size: ByteSize = ByteSize(1 << 30)
    local_buffer_size: ByteSize = ByteSize(16 << 20)
    chunk_bytes: ByteSize = ByteSize(64 << 20)
    replicas: int = Field(1, ge=1)


class RayStoreSpec(Section):
    """Ray's object store (Miles's `--object-store-backend ray`): one numpy object per batch."""

    kind: Literal["ray"] = "ray"
    capacity: ByteSize | None = None


class BufferSpec(Section):
    max_refs: int = Field(256, ge=1)
    max_bytes: ByteSize = ByteSize(256 << 20)
    produced_channel: int = Field(64, ge=1, description="refs in flight producer -> buffer")
    produced_bytes: ByteSize = Field(ByteSize(64 << 20), description="payload bytes in flight producer -> buffer")
    ready_channel: int = Field(16, ge=1, description="refs in flight buffer -> learner")
    ready_bytes: ByteSize = Field(ByteSize(64 << 20), description="payload bytes in flight buffer -> learner")

    @property
    def bytes_in_flight(self) -> int:
        """The most payload bytes the pipeline lets exist at once (channels + replay index)."""
        return int(self.produced_bytes) + int(self.max_bytes) + int(self.ready_bytes)


class GRPOSpec(Section):
    kind: Literal["grpo"] = "grpo"
    lr: float = Field(3e-3, gt=0)
    groups_per_step: int = Field(16, ge=1)
    clip_eps: float = Field(0.2, gt=0)
    max_grad_norm: float = Field(1.0, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    epochs: int = Field(1, ge=1, description="optimizer passes over each step's batch (PPO epochs)")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description='"auto": cuda when a GPU is visible')


class MaxStalenessSpec(Section):
    kind: Literal["max-staleness"] = "max-staleness"
    k: int | None = Field(None, ge=0, description="default: 2 in async mode, 0 in sync mode")
    on_stale: Literal["drop", "requeue"] = "drop"
    max_span: int | None = Field(
        None, ge=1, description="most weight versions one sample may span; longer ones restart on the new weights"
    )
    admission: Literal["pace", "eager"] = Field(
        "pace",
        description='"pace": producers wait rather than start work that would be too stale to train; '
        '"eager": they start work as fast as the channels take it, and what turns too stale is refused',
    )


class CorrectionSpec(Section):
    """Off-policy correction in the learner's loss (policies.correction)."""

    kind: Literal["none", "tis", "decoupled"] = Field(
        "none", description="none: PPO-clip on behaviour logprobs; tis / decoupled: clip against the learner's "
        "logprobs at the step's start, tokens weighted by pi_prox / pi_behav"
    )
    tis_cap: float = Field(2.0, ge=1, description="tis: importance weights above this are truncated to it")
    decoupled_cap: float | None = Field(
        None, ge=1, description="decoupled: tokens whose importance weight exceeds this are left out; unset: none are"
    )

    @model_validator(mode="after")
    def _cap_matches_kind(self) -> CorrectionSpec:
        if self.decoupled_cap is not None and self.kind != "decoupled":
            raise ValueError(
                f"correction.decoupled_cap = {self.decoupled_cap} applies only to correction.kind = 'decoupled', "
                f"but correction.kind = {self.kind!r}; remove correction.decoupled_cap or set correction.kind = "
                "'decoupled'"
            )
        return self


class ReplaySpec(Section):
    """Which groups each learner step trains on, and how often one may be (policies.selection)."""

    max_reuse: int = Field(1, ge=1, description="most learner steps one group is trained in (only while within k)")
    selection: Literal["fifo", "freshest", "uniform"] = Field(
        "fifo", description="fifo: in arrival order; freshest: newest version first; uniform: at random (seeded)"
    )
    drop_zero_signal: bool = Field(
        False, description="filter groups whose rewards are all equal before they cost a step (DAPO dynamic sampling)"
    )
    max_filtered_batches: int = Field(
        10, ge=1, description="a step that filters more than this many times groups_per_step groups fails the run"
    )


class WeightsSpec(Section):
    """How each new version reaches the engines; independent of `store` (rollout data)."""

    transport: Literal["inproc", "mooncake_p2p", "disk", "delta", "broadcast"] = "inproc"
    protocol: str = Field("tcp", description='mooncake_p2p: TransferEngine protocol, "tcp" or "rdma"')
    device: str = Field("", description="mooncake_p2p: RDMA device names (empty for tcp)")
    bucket_bytes: ByteSize = Field(ByteSize(32 << 20), description="mooncake_p2p: bytes per checksummed bucket")
    pace: ByteSize | None = Field(None, description="mooncake_p2p: push at most this many bytes per second")
    retries: int = Field(2, ge=0, description="re-sends of a refused version before the run fails (mooncake_p2p, disk)")
    root: str | None = Field(None, description="disk: folder every engine can read (default: a temporary one)")
    snapshot_every: int = Field(
        1, ge=0, description="keep every n-th version in the store for engines that (re)start; 0: never"
    )


class CheckpointSpec(Section):
    """Checkpoints into the run folder, for `baton run --resume RUN_DIR` (pipeline.checkpoint)."""

    every: int = Field(20, ge=0, description="write a checkpoint every this many versions; 0: never")
    keep: int = Field(2, ge=1, description="complete checkpoints kept in the run folder (older ones are removed)")


class WatchdogSpec(Section):
    """Hang diagnosis (pipeline.watchdog): progress is the version or the ledger moving."""

    warn_after_s: float = Field(60.0, ge=0, description="log where every stage waits after this long without "
                                "progress (and again each time as long again passes); 0: never")
    fail_after_s: float = Field(300.0, ge=0, description="fail the run with PipelineHung after this long without "
                                "progress; 0: never")
    poll_s: float = Field(1.0, gt=0, description="how often the watchdog looks")

    @model_validator(mode="after")
    def _warn_before_failing(self) -> WatchdogSpec:
        if self.fail_after_s and self.warn_after_s and self.warn_after_s >= self.fail_after_s:
            raise ValueError(
                f"watchdog.warn_after_s = {self.warn_after_s:g} must be below watchdog.fail_after_s = "
                f"{self.fail_after_s:g} (or 0), so a hang is reported before the run fails; lower warn_after_s"
            )
        return self


class RaySpec(Section):
    address: str | None = Field(None, description="attach to this Ray cluster; default: start one on 127.0.0.1")


class TelemetrySpec(Section):
    log_format: Literal["console", "json"] = "console"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    progress: bool = True


class RunConfig(Section):
    name: str = Field("baton", pattern=r"^[A-Za-z0-9_.-]+$")
    seed: int = 0
    steps: int = Field(60, ge=1, description="learner versions to train")
    mode: Literal["async", "sync"] = "async"
    runtime: Literal["local", "ray"] = "local"
    run_root: str = "runs"
    model: ModelSpec = ModelSpec()
    task: kinds(ReverseDigitsSpec, AdditionSpec) = ReverseDigitsSpec()  # type: ignore[valid-type]
    engine: kinds(TorchEngineSpec, SGLangEngineSpec) = TorchEngineSpec()  # type: ignore[valid-type]
    rollout: RolloutSpec = RolloutSpec()
    store: kinds(MemoryStoreSpec, MooncakeStoreSpec, RayStoreSpec) = MemoryStoreSpec()  # type: ignore[valid-type]
    buffer: BufferSpec = BufferSpec()
    learner: kinds(GRPOSpec) = GRPOSpec()  # type: ignore[valid-type]
    staleness: kinds(MaxStalenessSpec) = MaxStalenessSpec()  # type: ignore[valid-type]
    correction: CorrectionSpec = CorrectionSpec()
    replay: ReplaySpec = ReplaySpec()
    weights: WeightsSpec = WeightsSpec()
    telemetry: TelemetrySpec = TelemetrySpec()
    ray: RaySpec = RaySpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    watchdog: WatchdogSpec = WatchdogSpec()
    faults: list[FaultConfig] = Field(default_factory=list, description="[[faults]]: injected faults (pipeline.faults)")
    simulate: SimulateSpec | None = Field(None, description="[simulate]: cluster shape and declared costs for "
                                          "`baton simulate` (stages.simulate); `baton run` ignores it")

    @model_validator(mode="after")
    def _mode_sets_k(self) -> RunConfig:
        if isinstance(self.staleness, MaxStalenessSpec):
            if self.mode == "sync" and self.staleness.k not in (None, 0):
                raise ValueError(
                    f"mode = 'sync' means staleness.k = 0, but staleness.k = {self.staleness.k}; "
                    "remove staleness.k or set mode = 'async'"
                )
            if self.staleness.k is None:
                self.staleness.k = 0 if self.mode == "sync" else 2
        if isinstance(self.store, MooncakeStoreSpec):
            self._check_mooncake_capacity(self.store)
        if self.weights.transport == "broadcast" and self.runtime == "local":
            raise ValueError(
                "weights.transport = 'broadcast' sends to engine processes, but runtime = 'local' keeps the "
                "engines in the learner's process; use weights.transport = 'inproc' or runtime = 'ray'"
            )
        if self.runtime == "ray" and isinstance(self.store, MemoryStoreSpec):
            raise ValueError(
                "runtime = 'ray' puts every stage in its own process, but store.kind = 'memory' lives in one; "
                "use store.kind = 'mooncake' or 'ray'"
            )
        if not self.model.create and not (Path(self.model.path) / "config.json").exists():
            raise ValueError(
                f"model.path = {self.model.path!r} holds no model (no config.json) and model.create = false; "
                "set model.create = true to make a tiny one there, or point model.path at an HF checkpoint"
            )
        return self

    @model_validator(mode="after")
    def _faults_fit(self) -> RunConfig:
        """Each planned fault has what its recovery needs; say which key to set before anything starts."""
        kinds = [f.kind for f in self.faults]
        twice = sorted({k for k in kinds if kinds.count(k) > 1})
        if twice:
            raise ValueError(f"faults: {', '.join(twice)} planned more than once; merge their `at` lists into one")
        if "engine.hang" in kinds and self.rollout.request_timeout_s is None:
            raise ValueError(
                "fault engine.hang needs rollout.request_timeout_s, which turns a hang into an error and the groups "
                "into regenerated ones; set rollout.request_timeout_s (e.g. 10)"
            )
        for kind in ("store.master_restart", "store.holder_crash"):
            if kind in kinds and not isinstance(self.store, MooncakeStoreSpec):
                raise ValueError(f"fault {kind} acts on Mooncake processes, but store.kind = {self.store.kind!r}; "
                                 "set store.kind = 'mooncake' or remove the fault")
        if "store.master_restart" in kinds and self.runtime == "ray" and self.store.master == "auto":
            raise ValueError(
                "fault store.master_restart with runtime = 'ray' needs a master the faults runner owns: run it with "
                "`baton faults CONFIG`, or use runtime = 'local' (which restarts its own store.master = 'auto')"
            )
        if "store.holder_crash" in kinds and self.store.replicas < 2:
            raise ValueError(
                f"fault store.holder_crash is survived with store.replicas = 2, but store.replicas = "
                f"{self.store.replicas}; set store.replicas = 2 (`baton faults` does, and starts the second holder)"
            )
        return self

    @model_validator(mode="after")
    def _staleness_holds(self) -> RunConfig:
        """The static check of `policies.bounds`: refuse a shape that can break the staleness bound."""
        from policies.bounds import PipelineShape, check

        if not isinstance(self.staleness, MaxStalenessSpec) or not isinstance(self.learner, GRPOSpec):
            return self  # plug-ins: their numbers mean what their authors say
        k = self.staleness.k if self.staleness.k is not None else (0 if self.mode == "sync" else 2)
        problems = check(PipelineShape(
            k=k, groups_per_step=self.learner.groups_per_step, engines=getattr(self.engine, "count", 1),
            batch_groups=getattr(self.engine, "batch_groups", 1), produced_channel=self.buffer.produced_channel,
            buffer_refs=self.buffer.max_refs, ready_channel=self.buffer.ready_channel,
            admission=self.staleness.admission, max_reuse=self.replay.max_reuse, epochs=self.learner.epochs,
            corrected=self.correction.kind != "none",
        ))
        if problems:
            raise ValueError("the staleness bound does not hold: " + " | ".join(problems))
        return self

    def _check_mooncake_capacity(self, store: MooncakeStoreSpec) -> None:
        """Miles's rule, per node: the segment must hold every byte the pipeline lets be in flight,
        times the replicas, below the master's eviction watermark (90 %)."""
        need = self.buffer.bytes_in_flight * store.replicas
        have = int(store.global_segment_size * 0.9)
        if need > have:
            raise ValueError(
                f"store.global_segment_size = {store.global_segment_size.human_readable()} holds "
                f"{ByteSize(have).human_readable()} before Mooncake evicts, but buffer.produced_bytes + "
                f"buffer.max_bytes + buffer.ready_bytes = {ByteSize(self.buffer.bytes_in_flight).human_readable()} "
                f"x store.replicas = {store.replicas} may be in flight; raise store.global_segment_size to at "
                f"least {ByteSize(-(-need * 10 // 9)).human_readable()} or lower the buffer's byte bounds"
            )
        if store.replicas > 1 and store.master == "auto":
            raise ValueError(
                f"store.replicas = {store.replicas} needs that many processes holding segments, but with "
                "store.master = 'auto' only the buffer's process holds one; use replicas = 1, "
                "or attach (store.master = 'host:port') to a cluster with more segment holders"
            )

    def resolved_toml(self) -> str:
        return to_toml(self.model_dump(mode="json", exclude_none=True))


def build_pipeline(cfg: RunConfig):
    """The Pipeline this config describes (the same objects the Python DSL builds)."""
    import torch

    from buffers.memory import MemoryStore
    from buffers.mooncake import MooncakeSettings, MooncakeStore
    from buffers.mooncake import MooncakeStoreSpec as MooncakeSpec
    from buffers.ray_store import RayStoreSpec
    from buffers.replay import ReplayBuffer
    from pipeline.dsl import Pipeline
    from pipeline.watchdog import WatchdogSettings
    from policies import MaxStaleness
    from policies.correction import Correction
    from policies.selection import make_selection
    from stages.engines.sglang import SGLangEngine
    from stages.engines.torch import TorchEngine
    from stages.learner import GRPOLearner
    from stages.model import make_tiny_model
    from stages.rollout import Rollout
    from stages.tasks import Addition, ReverseDigits
    from stages.weights.broadcast import BroadcastTransport
    from stages.weights.disk import DiskTransport
    from stages.weights.mooncake_p2p import MooncakeP2PTransport

    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    m = cfg.model
    model = (
        make_tiny_model(
            m.path, hidden_size=m.hidden_size, layers=m.layers, heads=m.heads, kv_heads=m.kv_heads, seed=m.seed
        )
        if m.create
        else Path(m.path)
    )

    def mooncake(s: MooncakeStoreSpec) -> Any:
        settings = MooncakeSettings(
            protocol=s.protocol, device=s.device, global_segment_size=int(s.global_segment_size),
            local_buffer_size=int(s.local_buffer_size), chunk_bytes=int(s.chunk_bytes), replicas=s.replicas,
        )
        if cfg.runtime == "ray":  # each process opens its own client; the buffer's holds the segment
            return MooncakeSpec(settings, master=s.master)
        return MooncakeStore.open(settings, master=s.master)

    def build(spec: Any, builtin: dict[str, Any], **extra: Any) -> Any:
        if isinstance(spec, PluginSpec):
            return spec.build(**extra)
        return builtin[spec.kind](spec, **extra)

    task = build(cfg.task, {
        "reverse-digits": lambda s: ReverseDigits(digits=s.digits),
        "addition": lambda s: Addition(),
    })
    store = build(cfg.store, {
        "memory": lambda s: MemoryStore(capacity_bytes=s.capacity),
        "mooncake": lambda s: mooncake(s),
        "ray": lambda s: RayStoreSpec(  # one index per run, so runs sharing a cluster never mix keys
            name=f"ray-{cfg.name}-{uuid.uuid4().hex[:8]}", capacity_bytes=int(s.capacity) if s.capacity else None
        ),
    })
    engine_count = getattr(cfg.engine, "count", 1)
    def sglang(s: SGLangEngineSpec, i: int) -> SGLangEngine:
        return SGLangEngine(
            model, name=f"sglang-{i}", url=s.urls[i] if s.urls else None, python=s.python, dtype=s.dtype,
            device=s.device, threads=s.threads, max_total_tokens=s.max_total_tokens, extra_args=tuple(s.extra_args),
            update=s.update, pause_mode=s.pause_mode, max_restarts=s.max_restarts,
            gpu_id=s.base_gpu_id + i if s.device == "cuda" else None,
        )

    def weights(w: WeightsSpec) -> Any:
        if w.transport == "mooncake_p2p":
            return MooncakeP2PTransport(
                protocol=w.protocol, device=w.device, bucket_bytes=int(w.bucket_bytes),
                pace_bytes_per_s=float(w.pace) if w.pace else None, retries=w.retries,
            )
        if w.transport == "disk":
            return DiskTransport(root=w.root, retries=w.retries)
        if w.transport == "broadcast":
            return BroadcastTransport(retries=w.retries)
        return w.transport

    engines = [
        build(cfg.engine, {
            "torch": lambda s, i=i: TorchEngine(model, name=f"torch-{i}", seed=cfg.seed + i),
            "sglang": lambda s, i=i: sglang(s, i),
        })
        for i in range(engine_count)
    ]
    learner = build(cfg.learner, {
        "grpo": lambda s: GRPOLearner(
            model, lr=s.lr, groups_per_step=s.groups_per_step, clip_eps=s.clip_eps,
            max_grad_norm=s.max_grad_norm, weight_decay=s.weight_decay, epochs=s.epochs,
            temperature=getattr(cfg.engine, "temperature", 1.0), weights=weights(cfg.weights),
            device=s.device, snapshot_every=cfg.weights.snapshot_every,
            correction=Correction(
                kind=cfg.correction.kind, tis_cap=cfg.correction.tis_cap, decoupled_cap=cfg.correction.decoupled_cap
            ),
            selection=make_selection(
                cfg.replay.selection, max_reuse=cfg.replay.max_reuse, drop_zero_signal=cfg.replay.drop_zero_signal,
                max_filtered_batches=cfg.replay.max_filtered_batches, seed=cfg.seed,
            ),
        )
    })
    staleness = build(cfg.staleness, {
        "max-staleness": lambda s: MaxStaleness(k=s.k, on_stale=s.on_stale, max_span=s.max_span, admission=s.admission)
    })
    e = cfg.engine
    return Pipeline(
        name=cfg.name,
        seed=cfg.seed,
        steps=cfg.steps,
        runtime=cfg.runtime,
        run_root=cfg.run_root,
        producer=Rollout(
            task, engines, tokenizer=model, group_size=cfg.rollout.group_size,
            batch_groups=getattr(e, "batch_groups", 16), temperature=getattr(e, "temperature", 1.0),
            top_p=getattr(e, "top_p", 1.0), request_timeout_s=cfg.rollout.request_timeout_s,
        ),
        buffer=ReplayBuffer(store, max_refs=cfg.buffer.max_refs, max_bytes=int(cfg.buffer.max_bytes)),
        consumer=learner,
        staleness=staleness,
        produced_channel=(cfg.buffer.produced_channel, int(cfg.buffer.produced_bytes)),
        ready_channel=(cfg.buffer.ready_channel, int(cfg.buffer.ready_bytes)),
        progress=cfg.telemetry.progress,
        ray_address=cfg.ray.address,
        checkpoint_every=cfg.checkpoint.every,
        checkpoint_keep=cfg.checkpoint.keep,
        watchdog=WatchdogSettings(cfg.watchdog.warn_after_s, cfg.watchdog.fail_after_s, cfg.watchdog.poll_s),
        faults=[FaultSpec(f.kind, tuple(f.at), f.probability, f.seed, f.delay_s) for f in cfg.faults] or None,
        config_text=cfg.resolved_toml(),
    )


__all__ = ["ConfigError", "RunConfig", "build_pipeline"]
