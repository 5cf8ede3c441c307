"""How the run runs: [buffer], [checkpoint], [watchdog], [ray], [telemetry], [[faults]] and [simulate]."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import ByteSize, Field, model_validator

from baton.sections.base import Section, declared_defaults, default_of
from pipeline.faults import FAULT_KINDS, FaultSpec
from pipeline.placement import Placement

if TYPE_CHECKING:
    from buffers import RefBuffer
    from pipeline.watchdog import WatchdogSettings

REF_BUFFER = declared_defaults("buffers:RefBuffer")
PIPELINE = declared_defaults("pipeline.dsl:Pipeline")
WATCHDOG = declared_defaults("pipeline.watchdog:WatchdogSettings")
GRPO_LEARNER = declared_defaults("stages.learner:GRPOLearner")


class BufferSpec(Section):
    max_refs: int = Field(REF_BUFFER("max_refs", 256), ge=1,
        description="refs the buffer stage holds at once; when full it stops receiving (backpressure)")
    max_bytes: ByteSize = Field(ByteSize(REF_BUFFER("max_bytes", 268435456)),
        description="payload bytes the refs the buffer holds may point at")
    produced_channel: int = Field(64, ge=1, description="refs in flight producer -> buffer")
    produced_bytes: ByteSize = Field(ByteSize(64 << 20), description="payload bytes in flight producer -> buffer")
    ready_channel: int = Field(16, ge=1, description="refs in flight buffer -> learner")
    ready_bytes: ByteSize = Field(ByteSize(64 << 20), description="payload bytes in flight buffer -> learner")

    @property
    def bytes_in_flight(self) -> int:
        """The most payload bytes the pipeline lets exist at once (channels + replay index)."""
        return int(self.produced_bytes) + int(self.max_bytes) + int(self.ready_bytes)

    def make(self, store: Any) -> RefBuffer:
        from buffers import RefBuffer

        return RefBuffer(store, max_refs=self.max_refs, max_bytes=int(self.max_bytes))


class FaultConfig(Section):
    """One `[[faults]]` entry (pipeline.faults): a named injection point and when it fires."""

    kind: Literal[FAULT_KINDS] = Field(description="the injection point, e.g. 'store.get_fail'")  # type: ignore[valid-type]
    at: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=list,
        description="occurrences (1-based) at which it fires; learner.crash, learner.rank_crash: learner versions",
    )
    probability: float = Field(default_of(FaultSpec, "probability"), ge=0, le=1,
                               description="instead of `at`: the chance it fires at each occurrence")
    seed: int = Field(default_of(FaultSpec, "seed"), description="seeds the `probability` draws")
    delay_s: float = Field(default_of(FaultSpec, "delay_s"), gt=0, description="engine.hang / channel.stall: how "
                           "long it lasts")

    @model_validator(mode="after")
    def _one_schedule(self) -> FaultConfig:
        if bool(self.at) == bool(self.probability):
            both = "both `at` and" if self.at else "neither `at` nor"
            raise ValueError(
                f"fault {self.kind!r} has {both} `probability`: give exactly one, e.g. at = [3] "
                "(fire at the 3rd occurrence) or probability = 0.01"
            )
        return self

    def make(self) -> FaultSpec:
        return FaultSpec(self.kind, tuple(self.at), self.probability, self.seed, self.delay_s)


class CheckpointSpec(Section):
    """Checkpoints into the run folder, for `baton run --resume RUN_DIR` (pipeline.checkpoint)."""

    every: int = Field(20, ge=0, description="write a checkpoint every this many versions; 0: never")
    keep: int = Field(PIPELINE("checkpoint_keep", 2), ge=1,
                      description="complete checkpoints kept in the run folder (older ones are removed)")
    export_every: int = Field(GRPO_LEARNER("export_every", 0), ge=0, description="export every this many "
                              "versions' checkpoint as a Hugging Face folder, RUN_DIR/exports/v{version:08d}/ "
                              "(`baton export`), while the run goes on; a multiple of every; 0: never")

    @model_validator(mode="after")
    def _exports_checkpoints(self) -> CheckpointSpec:
        if self.export_every and (not self.every or self.export_every % self.every):
            fix = (f"set checkpoint.export_every to a multiple of {self.every}" if self.every else
                   "set checkpoint.every (e.g. to checkpoint.export_every)")
            raise ValueError(
                f"checkpoint.export_every = {self.export_every} exports checkpoints, but checkpoint.every = "
                f"{self.every} writes none at those versions; {fix}, or checkpoint.export_every = 0"
            )
        return self


class WatchdogSpec(Section):
    """Hang diagnosis (pipeline.watchdog): progress is the version or the ledger moving."""

    warn_after_s: float = Field(WATCHDOG("warn_after_s", 60.0), ge=0,
                                description="log where every stage waits after this long without "
                                "progress (and again each time as long again passes); 0: never")
    fail_after_s: float = Field(WATCHDOG("fail_after_s", 300.0), ge=0,
                                description="fail the run with PipelineHung after this long without progress; 0: never")
    poll_s: float = Field(WATCHDOG("poll_s", 1.0), gt=0, description="how often the watchdog looks")

    def make(self) -> WatchdogSettings:
        from pipeline.watchdog import WatchdogSettings

        return WatchdogSettings(**self.model_dump())

    @model_validator(mode="after")
    def _warn_before_failing(self) -> WatchdogSpec:
        if self.fail_after_s and self.warn_after_s and self.warn_after_s >= self.fail_after_s:
            raise ValueError(
                f"watchdog.warn_after_s = {self.warn_after_s:g} must be below watchdog.fail_after_s = "
                f"{self.fail_after_s:g} (or 0), so a hang is reported before the run fails; lower warn_after_s"
            )
        return self


class RaySpec(Section):
    address: str | None = Field(None, description="attach to this Ray cluster (\"auto\" inside `ray job submit`: the "
                                "cluster the job runs on); default: start one on 127.0.0.1")
    placement_timeout_s: float = Field(120.0, gt=0, description="an actor (or a learner's other ranks) the cluster "
                                       "has not placed by then fails the run, naming what it asked for")
    resources: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="which nodes a role's processes go to: {role: {custom resource: amount}}, "
        "roles engine, buffer, learner, learner_ranks; resources a node got from `ray start --resources` "
        "(docs/guides/multi-node.md), e.g. {learner = {gpu_node = 0.01}}")

    @model_validator(mode="after")
    def _placement_is_valid(self) -> RaySpec:
        Placement(self.resources)  # raises naming the bad key
        return self


class TelemetrySpec(Section):
    log_format: Literal["console", "json"] = Field("console",
        description="console: readable lines; json: one JSON object per line")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="the lowest level logged")
    progress: bool = Field(PIPELINE("progress", True),
        description="the progress line on stderr (version, reward, staleness, samples/s, channel depths)")
    sinks: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["jsonl"], description="where metrics go: metrics.jsonl always, plus tensorboard, "
        "wandb (offline in the run folder unless WANDB_MODE=online), mlflow (the run folder, or MLFLOW_TRACKING_URI)",
    )


class SimulateSpec(Section):
    """The `[simulate]` table: cluster shape and declared costs (ignored by `baton run`).

    Declared generation cost of one engine call of n groups (group_size samples each, response lengths
    drawn from a lognormal with the given mean and shape, capped at max_response_tokens):
    `engine_call_overhead_s + max(response tokens / decode_tokens_per_s, longest response /
    sequence_tokens_per_s)`: throughput-bound for big batches, bound by the longest sample otherwise.
    Training on N learner ranks: `step_overhead_s + tokens / (train_tokens_per_s * N)` per step (prompt +
    response tokens), plus, when N > 1, FSDP's traffic: each rank gathers the parameters it lacks twice
    (forward, backward) and scatters the gradients once, `3 * weight_bytes * (N - 1) / N /
    shard_bytes_per_s`. Weights: `push_latency_s + weight_bytes * copies / push_bytes_per_s` (copies: the
    engine count with `push_per_engine`, else 1); from N ranks with `mooncake_p2p` every rank writes its
    own 1/N at once (the time / N), with another transport rank 0 first gathers the other ranks' parts
    (`+ weight_bytes * (N - 1) / N / shard_bytes_per_s`). Store put/get per group:
    `store_latency_s + bytes / store_bytes_per_s`.

    From parameter counts instead (an MoE above all): with `params` (every expert counted) `weight_bytes`
    defaults to `params * param_bytes`, so the push and FSDP's traffic follow the TOTAL parameters, while
    compute follows the ACTIVE ones (`active_params`: the dense parts plus top_k / experts of the expert
    parameters; default `params`): `train_flops_per_s / (6 * active_params)` replaces train_tokens_per_s
    and `decode_flops_per_s / (2 * active_params)` replaces decode_tokens_per_s, each when set.
    """

    engines: int | None = Field(None, ge=1, description="engines (producers); default: engine.count")
    learners: int | None = Field(None, ge=1, description="learner ranks (FSDP: step time / learners, plus the "
                                 "sharding traffic); default: learner.world_size")
    shard_bytes_per_s: float = Field(100e9, gt=0, description="one learner rank's collective bandwidth (NVLink-class "
                                     "by default): FSDP's gathers and scatters, and gathers before a push")
    steps: int | None = Field(None, ge=1, description="versions to simulate; default: steps")
    warmup: int = Field(10, ge=0, description="versions left out of the steady-state figures")
    seed: int = Field(0, description="seeds the simulated response lengths and cost draws")
    prompt_tokens: int = Field(16, ge=1, description="tokens per prompt")
    response_tokens_mean: float = Field(8.0, gt=0, description="mean response length in tokens")
    response_tokens_sigma: float = Field(0.5, ge=0, description="lognormal shape of response lengths")
    max_response_tokens: int = Field(16, ge=1, description="responses are capped at this many tokens")
    decode_tokens_per_s: float = Field(5_000.0, gt=0, description="one engine's decode throughput at batch")
    sequence_tokens_per_s: float = Field(500.0, gt=0, description="one sequence's decode speed")
    engine_call_overhead_s: float = Field(0.0, ge=0, description="fixed cost of one engine call")
    engine_load_s: float = Field(0.0, ge=0, description="an engine's pause to load a new version")
    train_tokens_per_s: float = Field(20_000.0, gt=0, description="one learner replica's training throughput")
    step_overhead_s: float = Field(0.0, ge=0, description="fixed cost of one learner step")
    learner_overhead_s: float = Field(0.0, ge=0, description="per-version bookkeeping besides the step")
    weight_bytes: ByteSize = Field(ByteSize(1 << 20), description="bytes of one version of the weights")
    push_bytes_per_s: float | None = Field(None, gt=0, description="learner egress; default: by weights.transport")
    push_per_engine: bool = Field(False, description="each engine gets its own copy from the learner (P2P "
                                  "without relays): push time grows with engines; false: one broadcast")
    push_latency_s: float = Field(0.0, ge=0, description="fixed cost of one weight push")
    store_bytes_per_s: float = Field(1e9, gt=0, description="store put/get throughput")
    store_latency_s: float = Field(1e-4, ge=0, description="fixed cost of one store put or get")
    hop_s: float | None = Field(None, ge=0, description="per cross-process channel call; default 1 ms on ray")
    zero_signal_fraction: float = Field(0.0, ge=0, lt=1, description="groups whose rewards are all equal")
    params: float | None = Field(None, gt=0, description="the model's TOTAL parameters (every expert of an MoE "
                                 "counted): weight_bytes defaults to params x param_bytes (push, FSDP traffic)")
    active_params: float | None = Field(None, gt=0, description="parameters one token computes with (an MoE: the dense "
                                        "parts + top_k / experts of the expert parameters); default: params")
    param_bytes: float = Field(2.0, gt=0, description="bytes per pushed parameter with params (2: bf16)")
    train_flops_per_s: float | None = Field(None, gt=0, description="one learner replica's achieved FLOP/s; with "
                                            "params: train_tokens_per_s = it / (6 x active_params)")
    decode_flops_per_s: float | None = Field(None, gt=0, description="one engine's achieved decode FLOP/s at batch; "
                                             "with params: decode_tokens_per_s = it / (2 x active_params)")
    engine_schedule: list[tuple[float, int]] = Field(default_factory=list, description="the engine count over "
        "virtual time, [[time_s, engines], ...]: at time_s the fleet grows (a joiner pays engine_join_s, then takes "
        "requests) or shrinks (the newest engines drain: their calls in flight finish, no new ones); a step at 0 "
        "sets the starting count. Figures come per phase as well")
    engine_join_s: float = Field(0.0, ge=0, description="a joining engine's seconds before its first request: model "
                                 "load, weight snapshot and version fence (engine.joined's load_s + fence_s)")
    learner_restarts: list[float] = Field(default_factory=list, description="virtual times (s) at which the learner "
        "group fails and restarts itself: the step in progress is lost, nothing trains for learner_restart_s "
        "while the engines keep generating")
    learner_restart_s: float = Field(10.0, ge=0, description="seconds one learner restart trains nothing (the "
                                     "learner.restart event's seconds)")

    @model_validator(mode="after")
    def _lengths_fit(self) -> SimulateSpec:
        if self.response_tokens_mean > self.max_response_tokens:
            raise ValueError(
                f"simulate.response_tokens_mean = {self.response_tokens_mean:g} is above simulate.max_response_tokens"
                f" = {self.max_response_tokens}; lower the mean or raise max_response_tokens"
            )
        return self

    @model_validator(mode="after")
    def _schedule_fits(self) -> SimulateSpec:
        times = [t for t, _ in self.engine_schedule]
        if any(t < 0 for t in times) or any(b <= a for a, b in zip(times, times[1:], strict=False)):
            raise ValueError(f"simulate.engine_schedule times {times} must be >= 0 and increasing, e.g. "
                             "[[0, 1], [60, 2], [120, 1]]")
        if any(n < 1 for _, n in self.engine_schedule):
            raise ValueError("simulate.engine_schedule counts must be >= 1 (a run keeps one engine at least)")
        if any(t < 0 for t in self.learner_restarts) or sorted(self.learner_restarts) != self.learner_restarts:
            raise ValueError(f"simulate.learner_restarts {self.learner_restarts} must be times >= 0 in order, e.g. "
                             "[40.0, 90.0]")
        return self

    @model_validator(mode="after")
    def _params_fit(self) -> SimulateSpec:
        flops = self.train_flops_per_s is not None or self.decode_flops_per_s is not None
        if (self.active_params is not None or flops) and self.params is None:
            raise ValueError("simulate.active_params and the *_flops_per_s keys need simulate.params (the total)")
        if self.active_params is not None and self.active_params > self.params:  # type: ignore[operator]
            raise ValueError(f"simulate.active_params = {self.active_params:g} is above simulate.params = "
                             f"{self.params:g}; active parameters are a part of the total")
        if self.active_params is not None and not flops:
            raise ValueError("simulate.active_params changes nothing without simulate.train_flops_per_s or "
                             "decode_flops_per_s (compute follows active parameters through them)")
        return self
