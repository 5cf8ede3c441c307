"""`baton simulate`: a config's pipeline in virtual time, with cost models instead of engines and a learner.

What is real and what is modelled:

* **Real** (the runtimes' own objects, instantiated here): the staleness policy (`policies.staleness.
  MaxStaleness`, or a plug-in's class) for admit / accept / interrupt, the `AdmissionGate` and
  `VersionClock` of `pipeline`, the bounded `Channel`s (produced, ready) with the config's item and
  byte bounds, and the learner's `ReplayWindow` with the config's selection policy
  (`policies.selection`). The event loop (`pipeline.discrete_events`) drives them in virtual time.
* **Modelled**: the work each stage does, as a `Costs` object (declared from published figures in a
  `[simulate]` table, or measured from a real run with `--calibrate`).

The stage models follow stages/rollout.py, buffers/replay.py and stages/learner.py step by step:

* **Engine** (one producer per engine): acquire up to `engine.batch_groups` slots at the gate (waiting
  for a version change or a discarded slot when closed); pay the call's overhead (taking prompts, a
  channel hop for the gate); generate for the call's generation time; when a new version reaches the
  engine meanwhile, pay `engine_load_s` and ask `policy.interrupt`: `restart` begins the call again on
  the new weights, `continue` keeps the group's oldest version. Then store each group (put time by
  bytes), and send its ref to the produced channel (waiting while it is full).
  Assumes: engines do not slow each other down (each has its own accelerator), and a call's groups
  finish together (the batch ends with its longest sample).
* **Buffer**: takes refs from the produced channel into an index bounded by `buffer.max_refs` /
  `max_bytes`, forwards them FIFO to the ready channel in batches of up to its capacity, and, whenever the
  version moves, refuses the refs the policy no longer accepts (their slots go back to the gate).
  Assumes: the buffer's own work is free (it handles refs, not payloads); each channel call crossing
  processes costs `hop_s`.
* **Learner**: collects `groups_per_step` groups into the replay window (loading each from the store:
  get time by bytes; refusing what the policy does not accept), trains for the step time while a
  prefetch receives and loads the next step's groups, pushes the weights (push time), advances the clock,
  and pays its per-version bookkeeping (`learner_overhead_s`). `--learners M` divides the step time by M
  (assumes data-parallel learners scale linearly; no extra all-reduce cost is modelled).

Figures (steady state: versions after `warmup`, the same window `benchmarks/async_vs_sync.py` uses):
samples/s trained, learner busy fraction (step time / wall time), engine idle fraction (time not
generating, storing or loading weights / wall time), mean staleness of trained groups, dropped fraction
(groups refused / groups judged), and queue depths at every version.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from pydantic import BaseModel, ByteSize, ConfigDict, Field, model_validator

from pipeline.admission import AdmissionGate
from pipeline.channel import Channel
from pipeline.config import ConfigError, load_toml, validate
from pipeline.discrete_events import TIMEOUT, EventLoop, Process, Wait, channel_receive_many, channel_send
from pipeline.versions import VersionClock
from policies.selection import ReplayWindow, make_selection
from policies.staleness import MaxStaleness

SIMULATE_TABLE = "simulate"
SWEEP_KEYS = ("engines", "k", "learners")
# bytes of payload per token in the codec: int32 token + float32 logprob + uint8 mask + int32 version
CODEC_BYTES_PER_TOKEN = 13
# one call to an actor in another process (a Ray channel, the gate, the ledger): about 1 ms measured on
# this project's CPU box (shared/notes/async-ceiling.md, "An actor call round trip is about 1 ms")
RAY_HOP_S = 1e-3
# weight-push bandwidth per transport when [simulate] does not set push_bytes_per_s: assumed figures
# (inproc shares memory; mooncake_p2p over one 100 Gb/s RDMA NIC at ~80 % efficiency; broadcast: NCCL
# over the same NIC; disk: a local NVMe write + read)
PUSH_BYTES_PER_S = {"inproc": 1e12, "mooncake_p2p": 10e9, "broadcast": 10e9, "delta": 10e9, "disk": 2e9}


# ---------------------------------------------------------------------------------------------- config


class SimulateSpec(BaseModel):
    """The `[simulate]` table: cluster shape and declared costs (ignored by `baton run`).

    Declared generation cost of one engine call of n groups (group_size samples each, response lengths
    drawn from a lognormal with the given mean and shape, capped at max_response_tokens):
    `engine_call_overhead_s + max(response tokens / decode_tokens_per_s, longest response /
    sequence_tokens_per_s)`: throughput-bound for big batches, bound by the longest sample otherwise.
    Training: `step_overhead_s + tokens / (train_tokens_per_s * learners)` per step (prompt + response
    tokens). Weights: `push_latency_s + weight_bytes * copies / push_bytes_per_s` (copies: the engine count
    with `push_per_engine`, else 1). Store put/get per group:
    `store_latency_s + bytes / store_bytes_per_s`.
    """

    model_config = ConfigDict(extra="forbid")

    engines: int | None = Field(None, ge=1, description="engines (producers); default: engine.count")
    learners: int = Field(1, ge=1, description="data-parallel learner replicas (step time / learners)")
    steps: int | None = Field(None, ge=1, description="versions to simulate; default: steps")
    warmup: int = Field(10, ge=0, description="versions left out of the steady-state figures")
    seed: int = 0
    prompt_tokens: int = Field(16, ge=1)
    response_tokens_mean: float = Field(8.0, gt=0)
    response_tokens_sigma: float = Field(0.5, ge=0, description="lognormal shape of response lengths")
    max_response_tokens: int = Field(16, ge=1)
    decode_tokens_per_s: float = Field(5_000.0, gt=0, description="one engine's decode throughput at batch")
    sequence_tokens_per_s: float = Field(500.0, gt=0, description="one sequence's decode speed")
    engine_call_overhead_s: float = Field(0.0, ge=0)
    engine_load_s: float = Field(0.0, ge=0, description="an engine's pause to load a new version")
    train_tokens_per_s: float = Field(20_000.0, gt=0, description="one learner replica's training throughput")
    step_overhead_s: float = Field(0.0, ge=0)
    learner_overhead_s: float = Field(0.0, ge=0, description="per-version bookkeeping besides the step")
    weight_bytes: ByteSize = Field(ByteSize(1 << 20))
    push_bytes_per_s: float | None = Field(None, gt=0, description="learner egress; default: by weights.transport")
    push_per_engine: bool = Field(False, description="each engine gets its own copy from the learner (P2P "
                                  "without relays): push time grows with engines; false: one broadcast")
    push_latency_s: float = Field(0.0, ge=0)
    store_bytes_per_s: float = Field(1e9, gt=0)
    store_latency_s: float = Field(1e-4, ge=0)
    hop_s: float | None = Field(None, ge=0, description="per cross-process channel call; default 1 ms on ray")
    zero_signal_fraction: float = Field(0.0, ge=0, lt=1, description="groups whose rewards are all equal")

    @model_validator(mode="after")
    def _lengths_fit(self) -> SimulateSpec:
        if self.response_tokens_mean > self.max_response_tokens:
            raise ValueError(
                f"simulate.response_tokens_mean = {self.response_tokens_mean:g} is above simulate.max_response_tokens"
                f" = {self.max_response_tokens}; lower the mean or raise max_response_tokens"
            )
        return self


def load_simulation_config(path: str | Path, overrides: Sequence[str] = ()) -> tuple[Any, SimulateSpec]:
    """The run config (stages.config.RunConfig) and the `[simulate]` table of the TOML at `path`."""
    from stages.config import RunConfig

    data = load_toml(path, overrides)
    if data.get("runtime") == "ray":  # a run folder's resolved config.toml lists their defaults; not simulated
        for section in ("checkpoint", "watchdog"):
            data.pop(section, None)
    table = data.pop(SIMULATE_TABLE, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [simulate] must be a table, e.g. [simulate] decode_tokens_per_s = 2000")
    spec = validate(SimulateSpec, table, source=f"{path} [simulate]")
    return validate(RunConfig, data, source=str(path)), spec


# ----------------------------------------------------------------------------------------------- costs


@dataclass
class EngineCall:
    """The cost of one engine call: seconds generating, storing and in overheads; per group its tokens
    (prompt + response, what training pays for) and payload bytes."""

    generate_s: float
    put_s: float
    overhead_s: float
    group_tokens: list[int]
    group_nbytes: list[int]


class Costs(Protocol):
    """What each modelled stage pays. `rng` is the simulation's seeded random stream."""

    hop_s: float
    engine_load_s: float

    def engine_call(self, rng: random.Random, groups: int) -> EngineCall: ...
    def load_s(self, rng: random.Random, nbytes: int) -> float: ...
    def step_s(self, rng: random.Random, tokens: int) -> float: ...
    def push_s(self, rng: random.Random, engines: int = 1) -> float: ...
    def learner_overhead_s(self, rng: random.Random) -> float: ...


@dataclass
class DeclaredCosts:
    """Costs from the `[simulate]` table (see SimulateSpec for the formulas)."""

    spec: SimulateSpec
    group_size: int
    transport: str
    runtime: str

    def __post_init__(self) -> None:
        s = self.spec
        self.hop_s = s.hop_s if s.hop_s is not None else (RAY_HOP_S if self.runtime == "ray" else 0.0)
        self.engine_load_s = s.engine_load_s
        self._push_bps = s.push_bytes_per_s or PUSH_BYTES_PER_S.get(self.transport, PUSH_BYTES_PER_S["mooncake_p2p"])
        # lognormal with the declared mean: mu = ln(mean) - sigma^2 / 2
        self._mu = math.log(s.response_tokens_mean) - s.response_tokens_sigma**2 / 2

    def engine_call(self, rng: random.Random, groups: int) -> EngineCall:
        s = self.spec
        lengths_rng = np.random.default_rng(rng.getrandbits(64))
        drawn = lengths_rng.lognormal(self._mu, s.response_tokens_sigma, size=(groups, self.group_size))
        lengths = np.clip(np.rint(drawn), 1, s.max_response_tokens)
        response = float(lengths.sum())
        longest = float(lengths.max())
        generate = max(response / s.decode_tokens_per_s, longest / s.sequence_tokens_per_s)
        tokens = (lengths.sum(axis=1) + s.prompt_tokens * self.group_size).astype(int).tolist()
        nbytes = [t * CODEC_BYTES_PER_TOKEN for t in tokens]
        put = sum(s.store_latency_s + b / s.store_bytes_per_s for b in nbytes)
        return EngineCall(generate, put, s.engine_call_overhead_s + self.hop_s, tokens, nbytes)

    def load_s(self, rng: random.Random, nbytes: int) -> float:
        return self.spec.store_latency_s + nbytes / self.spec.store_bytes_per_s

    def step_s(self, rng: random.Random, tokens: int) -> float:
        return self.spec.step_overhead_s + tokens / (self.spec.train_tokens_per_s * self.spec.learners)

    def push_s(self, rng: random.Random, engines: int = 1) -> float:
        copies = engines if self.spec.push_per_engine else 1
        return self.spec.push_latency_s + int(self.spec.weight_bytes) * copies / self._push_bps

    def learner_overhead_s(self, rng: random.Random) -> float:
        return self.spec.learner_overhead_s


@dataclass
class MeasuredCosts:
    """Costs resampled from a real run's records (`calibrate`): each engine call draws one measured call
    (of the same group count when there are such, else scaled by groups), each step one measured step, push
    and bookkeeping time. Assumes costs are independent draws (no autocorrelation) and that an engine added
    beyond the measured ones costs what a measured one did."""

    calls: list[dict]  # generation.jsonl records
    steps: list[dict]  # metrics.jsonl records
    learners: int = 1
    hop_s: float = 0.0
    engine_load_s: float = 0.0
    get_s_per_group: float = 0.0

    def engine_call(self, rng: random.Random, groups: int) -> EngineCall:
        same = [c for c in self.calls if c["groups"] == groups]
        call = rng.choice(same or self.calls)
        scale = groups / call["groups"]
        tokens = _group_tokens(call)
        tokens = [tokens[i % len(tokens)] for i in range(groups)]
        per_group_bytes = call["nbytes"] // max(1, call["groups"])
        # taking prompts is per group; recording and sending is one call; plus the gate's call
        overhead = call.get("prompts_s", 0.0) * scale + call.get("send_s", 0.0) + self.hop_s
        return EngineCall(call["gen_s"] * scale, call["put_s"] * scale, overhead, tokens, [per_group_bytes] * groups)

    def load_s(self, rng: random.Random, nbytes: int) -> float:
        return self.get_s_per_group

    def step_s(self, rng: random.Random, tokens: int) -> float:
        return rng.choice(self.steps)["step_s"] / self.learners

    def push_s(self, rng: random.Random, engines: int = 1) -> float:
        return rng.choice(self.steps).get("push_s", 0.0)

    def learner_overhead_s(self, rng: random.Random) -> float:
        r = rng.choice(self.steps)
        return max(0.0, r["version_s"] - r["collect_s"] - r["step_s"] - r.get("push_s", 0.0))


def _group_tokens(call: dict) -> list[int]:
    """Response tokens per group of a measured call (prompt tokens are not recorded per call: the codec
    payload size stands in for them in `nbytes`)."""
    lengths, size = call.get("lengths") or [], call.get("group_size", 1)
    if not lengths:
        return [call.get("tokens", 0) // max(1, call["groups"])]
    return [sum(lengths[i : i + size]) for i in range(0, len(lengths), size)]


# ----------------------------------------------------------------------------------------- calibration


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steady_window(records: list[dict], warmup: int) -> tuple[list[dict], dict | None]:
    """The records after version `warmup` (clamped to a quarter of the run) and the record they start from."""
    warmup = min(warmup, len(records) // 4)
    if warmup < 1 or len(records) < 2:
        return records, None
    return [r for r in records if r["version"] > warmup], next(r for r in records if r["version"] == warmup)


def steady_figures(records: list[dict], samples_per_version: int, warmup: int, engines: int = 1) -> dict[str, float]:
    """Steady-state figures of per-version records (real or simulated), as benchmarks/async_vs_sync.py
    computes them: samples/s, learner busy fraction, mean staleness, per-version times; engine idle
    fraction when the records carry `engine_busy_s` (cumulative, all engines)."""
    window, start = steady_window(records, warmup)
    t0 = start["t"] if start is not None else 0.0
    wall = window[-1]["t"] - t0
    busy = sum(r["step_s"] for r in window)
    figures = {
        "samples_per_s": round(samples_per_version * len(window) / wall, 2),
        "learner_busy": round(busy / wall, 4),
        "mean_staleness": round(sum(r["staleness_mean"] for r in window) / len(window), 4),
        "step_ms": round(1e3 * busy / len(window), 2),
        "version_ms": round(1e3 * wall / len(window), 2),
    }
    if "engine_busy_s" in window[-1]:
        engine_busy = window[-1]["engine_busy_s"] - (start["engine_busy_s"] if start is not None else 0.0)
        figures["engine_idle"] = round(max(0.0, 1 - engine_busy / (wall * engines)), 4)
    return figures


@dataclass
class Calibration:
    """A real run's measured costs and its own steady-state figures."""

    run_dir: Path
    costs: MeasuredCosts
    measured: dict[str, float]
    engines: int
    config_path: Path


def calibrate(run_dir: str | Path, warmup: int = 10, learners: int = 1) -> Calibration:
    """Read a run folder (metrics.jsonl from the learner, generation.jsonl from the rollout workers,
    config.toml) and return its per-stage costs over the steady-state window.

    Store gets: the learner's `load_s` / `loads` when recorded, else assumed equal to a put per group."""
    run = Path(run_dir)
    records = _read_jsonl(run / "metrics.jsonl")
    if len(records) < 4:
        raise ConfigError(f"--calibrate {run}: needs a run folder with metrics.jsonl of at least 4 versions "
                          f"(found {len(records)}); run `baton run CONFIG` first")
    calls = _read_jsonl(run / "generation.jsonl")
    if not calls:
        raise ConfigError(f"--calibrate {run}: no generation.jsonl (engine-call timings): it is written by runs "
                          "of this version of baton; run the config again")
    if "push_s" not in records[0]:
        raise ConfigError(f"--calibrate {run}: metrics.jsonl has no push_s: run the config again with this baton")
    window, start = steady_window(records, warmup)
    t0 = start["t"] if start is not None else 0.0
    steady_calls = [c for c in calls if c["t"] >= t0] or calls
    loads = sum(r.get("loads", 0) for r in window)
    get_s = (sum(r.get("load_s", 0.0) for r in window) / loads if loads
             else sum(c["put_s"] for c in steady_calls) / sum(c["groups"] for c in steady_calls))
    config_text = (run / "config.toml").read_text()
    runtime = "ray" if 'runtime = "ray"' in config_text else "local"
    engines = len({c["engine"] for c in calls})
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    gps = _groups_per_step(config_text)
    group_size = steady_calls[0].get("group_size", 1)
    samples = summary.get("samples", {}).get("trained", 0) / len(records) if summary else gps * group_size
    costs = MeasuredCosts(steady_calls, window, learners=learners, hop_s=RAY_HOP_S if runtime == "ray" else 0.0,
                          get_s_per_group=get_s)
    measured = steady_figures(records, round(samples), warmup, engines)
    return Calibration(run, costs, measured, engines, run / "config.toml")


def _groups_per_step(config_text: str) -> int:
    import tomllib

    return int(tomllib.loads(config_text).get("learner", {}).get("groups_per_step", 16))


# ---------------------------------------------------------------------------------------- the simulation


@dataclass(slots=True)
class SimGroup:
    """What a ref says of a group: its oldest token version, payload bytes, tokens, and (instead of rewards)
    whether its rewards differ."""

    id: int
    version: int
    nbytes: int
    tokens: int
    signal: bool


@dataclass
class SimResult:
    records: list[dict]  # one per version, metrics.jsonl-like
    figures: dict[str, float]
    staleness_hist: dict[int, int]
    counts: dict[str, int]
    events: int
    wall_s: float
    engines: int
    k: int


def build_staleness_policy(cfg: Any) -> Any:
    """The staleness policy object `baton run` builds for this config (stages.config.build_pipeline)."""
    from stages.config import MaxStalenessSpec

    s = cfg.staleness
    if isinstance(s, MaxStalenessSpec):
        return MaxStaleness(k=s.k, on_stale=s.on_stale, max_span=s.max_span, admission=s.admission)
    return s.build()


class Simulation:
    """One simulated run: the real policy, gate, clock, channels and replay window, cost-modelled stages."""

    def __init__(self, cfg: Any, spec: SimulateSpec, costs: Costs, engines: int | None = None,
                 steps: int | None = None) -> None:
        self.cfg, self.spec, self.costs = cfg, spec, costs
        self.engines = engines or spec.engines or getattr(cfg.engine, "count", 1)
        self.steps = steps or spec.steps or cfg.steps
        self.rng = random.Random(spec.seed)
        self.groups_per_step = cfg.learner.groups_per_step
        self.group_size = cfg.rollout.group_size
        self.batch_groups = getattr(cfg.engine, "batch_groups", 16)
        self.policy = build_staleness_policy(cfg)
        self.selection = make_selection(
            cfg.replay.selection, max_reuse=cfg.replay.max_reuse, drop_zero_signal=cfg.replay.drop_zero_signal,
            max_filtered_batches=cfg.replay.max_filtered_batches, seed=cfg.seed,
        )
        self.clock = VersionClock()
        self.gate = AdmissionGate(self.clock, self.policy, self.groups_per_step)
        b = cfg.buffer
        self.produced: Channel[SimGroup] = Channel("produced", b.produced_channel, int(b.produced_bytes))
        self.ready: Channel[SimGroup] = Channel("ready", b.ready_channel, int(b.ready_bytes))
        self.window: ReplayWindow[SimGroup] = ReplayWindow(self.selection, self.policy)
        self.loop = EventLoop()
        self.index: deque[SimGroup] = deque()  # the buffer's index
        self.index_bytes = 0
        self.fetched: list[SimGroup] = []
        self.records: list[dict] = []
        self.trained_staleness: list[int] = []
        self.counts: Counter[str] = Counter()
        self.engine_busy_s = 0.0
        self._ids = 0
        self._prefetch_loading = False

    # -- shared -------------------------------------------------------------------------------------
    def _discard(self, units: int = 1) -> None:
        self.gate.discard(units)
        self.loop.notify((self.gate, "discard"))

    def _acquire_many(self, max_units: int) -> Process:
        """AdmissionGate.acquire_many: wait (for a version change or a discard) until the policy admits one
        unit, then take as many more as it admits now."""
        while not self.gate.try_acquire():
            yield Wait((self.clock, "changed"), (self.gate, "discard"))
        taken = 1
        while taken < max_units and self.gate.try_acquire():
            taken += 1
        return taken

    # -- producers ------------------------------------------------------------------------------------
    def _engine(self, index: int) -> Process:
        # each engine draws from its own stream, so adding engines leaves the others' costs as they were
        costs, rng, loop = self.costs, random.Random(f"{self.spec.seed}/engine/{index}"), self.loop
        loaded = self.clock.version
        while True:
            n = yield from self._acquire_many(self.batch_groups)
            call = costs.engine_call(rng, n)
            yield call.overhead_s
            busy_from = loop.now
            if loaded < self.clock.version:  # weights that arrived while idle
                loaded = self.clock.version
                yield costs.engine_load_s
            oldest = self.clock.version
            end = loop.now + call.generate_s
            while True:
                woke = yield Wait((self.clock, "changed"), timeout=max(0.0, end - loop.now))
                if woke == TIMEOUT:
                    break
                loaded = self.clock.version  # a new version reached this engine mid-call: pause, load
                end += costs.engine_load_s
                if self.policy.interrupt(oldest, self.clock.version) == "restart":
                    self.counts["restarted"] += n
                    oldest = self.clock.version
                    end = loop.now + costs.engine_load_s + costs.engine_call(rng, n).generate_s
            yield call.put_s
            self.engine_busy_s += loop.now - busy_from
            for tokens, nbytes in zip(call.group_tokens, call.group_nbytes, strict=True):
                self._ids += 1
                signal = rng.random() >= self.spec.zero_signal_fraction
                group = SimGroup(self._ids, oldest, nbytes, tokens, signal)
                self.counts["produced"] += 1
                yield from channel_send(loop, self.produced, group)

    # -- buffer -----------------------------------------------------------------------------------------
    def _index_full(self, group: SimGroup) -> bool:
        if len(self.index) >= self.cfg.buffer.max_refs:
            return True
        return bool(self.index) and self.index_bytes + group.nbytes > int(self.cfg.buffer.max_bytes)

    def _buffer_intake(self) -> Process:
        while True:
            groups = yield from channel_receive_many(self.loop, self.produced, self.cfg.buffer.max_refs)
            yield self.costs.hop_s
            for group in groups:
                while self._index_full(group):
                    yield Wait(("index", "changed"))
                self.index.append(group)
                self.index_bytes += group.nbytes
                self.loop.notify(("index", "changed"))

    def _buffer_forward(self) -> Process:
        while True:
            while not self.index:
                yield Wait(("index", "changed"))
            batch = [self.index.popleft() for _ in range(min(len(self.index), self.ready.max_items))]
            self.index_bytes -= sum(g.nbytes for g in batch)
            self.loop.notify(("index", "changed"))
            yield self.costs.hop_s
            for group in batch:
                yield from channel_send(self.loop, self.ready, group)

    def _buffer_evict(self, version: int) -> None:
        """ReplayActor._evict_on_version: refuse the indexed refs the policy no longer accepts."""
        expired = [g for g in self.index if self.policy.accept(version, g.version) != "train"]
        if not expired:
            return
        gone = {g.id for g in expired}
        self.index = deque(g for g in self.index if g.id not in gone)
        self.index_bytes = sum(g.nbytes for g in self.index)
        self.loop.notify(("index", "changed"))
        for group in expired:
            self._refuse(group, version)

    def _refuse(self, group: SimGroup, version: int) -> None:
        verdict = self.policy.accept(version, group.version)
        self.counts["requeued" if verdict == "requeue" else "dropped"] += 1
        self._discard(1)

    # -- learner ----------------------------------------------------------------------------------------
    def _load(self, groups: list[SimGroup]) -> Process:
        for group in groups:
            yield self.costs.load_s(self.rng, group.nbytes)
            self.fetched.append(group)

    def _admit_fetched(self) -> None:
        fetched, self.fetched = self.fetched, []
        for group in fetched:
            if self.selection.admit([1.0, 0.0] if group.signal else [0.5, 0.5]):
                self.window.add(group, group.version)
            else:
                self.counts["filtered"] += 1
                self._discard(1)

    def _collect(self, version: int) -> Process:
        wanted = self.groups_per_step
        while True:
            self._admit_fetched()
            for entry in self.window.expire(version):
                if not entry.reused:
                    self._refuse(entry.item, version)
            if len(self.window) >= wanted:
                break
            groups = yield from channel_receive_many(self.loop, self.ready, wanted - len(self.window))
            yield self.costs.hop_s
            yield from self._load(groups)
        taken = self.window.take(version, wanted)
        replays = sum(t.reused for t in taken)
        if replays:
            self.gate.replayed(replays)
        return taken

    def _prefetch(self) -> Process:
        room = self.groups_per_step - len(self.fetched) - len(self.window)
        groups = yield from channel_receive_many(self.loop, self.ready, max(room, 1))
        self._prefetch_loading = True  # holding refs now: the step waits for their loads (shielded)
        yield self.costs.hop_s
        yield from self._load(groups)
        self._prefetch_loading = False
        self.loop.notify(("prefetch", "done"))

    def _learner(self) -> Process:
        costs, rng, loop = self.costs, self.rng, self.loop
        version = 0
        last = loop.now
        samples = 0
        while version < self.steps:
            taken = yield from self._collect(version)
            t0 = loop.now
            prefetch = loop.spawn(self._prefetch()) if version + 1 < self.steps else None
            yield costs.step_s(rng, sum(t.item.tokens for t in taken))
            step_s = loop.now - t0
            if prefetch is not None and loop.alive(prefetch):
                if self._prefetch_loading:
                    while self._prefetch_loading:
                        yield Wait(("prefetch", "done"))
                else:
                    loop.cancel(prefetch)
            t_push = loop.now
            yield costs.push_s(rng, self.engines)
            push_s = loop.now - t_push
            self.clock.advance(version + 1)
            loop.notify((self.clock, "changed"))
            self._buffer_evict(version + 1)
            stale = [version - t.item.version for t in taken]
            self.trained_staleness.extend(stale)
            self.counts["trained"] += len(taken)
            self.window.returned(taken, version)
            samples += len(taken) * self.group_size
            version += 1
            yield costs.learner_overhead_s(rng)
            self.records.append({
                "version": version, "t": round(loop.now, 6),
                "staleness_mean": sum(stale) / len(stale), "staleness_max": max(stale),
                "samples_per_s": round(samples / loop.now, 2) if loop.now > 0 else 0.0,
                "step_s": step_s, "collect_s": t0 - last, "push_s": push_s, "version_s": loop.now - last,
                "engine_busy_s": self.engine_busy_s,
                "depth_produced": self.produced.depth, "depth_buffer": len(self.index),
                "depth_ready": self.ready.depth, "window": len(self.window),
                "live_groups": self.gate.started - self.gate.discarded - self.counts["trained"],
            })
            last = loop.now

    # -- running ------------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        started = time.perf_counter()
        learner = self.loop.spawn(self._learner())
        for i in range(self.engines):
            self.loop.spawn(self._engine(i))
        self.loop.spawn(self._buffer_intake())
        self.loop.spawn(self._buffer_forward())
        self.loop.run(stop=lambda: not self.loop.alive(learner))
        if len(self.records) < self.steps:
            raise RuntimeError(
                f"the simulation stalled at version {len(self.records)} of {self.steps} (virtual t = "
                f"{self.loop.now:.3f} s): no stage can move; check the config's channel and buffer bounds"
            )
        samples_per_version = self.groups_per_step * self.group_size
        figures = steady_figures(self.records, samples_per_version, self.spec.warmup, self.engines)
        judged = self.counts["trained"] + self.counts["dropped"] + self.counts["requeued"]
        figures["dropped_frac"] = round((self.counts["dropped"] + self.counts["requeued"]) / max(1, judged), 4)
        figures["max_staleness"] = max(self.trained_staleness, default=0)
        return SimResult(
            records=self.records, figures=figures, staleness_hist=dict(sorted(Counter(self.trained_staleness).items())),
            counts=dict(self.counts), events=self.loop.events, wall_s=round(time.perf_counter() - started, 3),
            engines=self.engines, k=getattr(self.policy, "bound", -1),
        )


def simulate(cfg: Any, spec: SimulateSpec, costs: Costs | None = None, engines: int | None = None,
             steps: int | None = None) -> SimResult:
    """Run one simulation of `cfg`; declared costs from `spec` unless `costs` is given."""
    if costs is None:
        costs = DeclaredCosts(spec, cfg.rollout.group_size, cfg.weights.transport, cfg.runtime)
    return Simulation(cfg, spec, costs, engines=engines, steps=steps).run()


# ----------------------------------------------------------------------------------------------- outputs


def write_run(root: str | Path, name: str, result: SimResult, extra: dict | None = None) -> Path:
    """A run folder with metrics.jsonl (one record per simulated version), summary.json and report.png."""
    from pipeline.telemetry import Panel, RunFolder, render_report

    with RunFolder.create(root, f"{name}-simulate") as folder:
        for record in result.records:
            folder.log_metrics(record)
        summary = {"figures": result.figures, "staleness_hist": result.staleness_hist, "counts": result.counts,
                   "engines": result.engines, "k": result.k, "events": result.events, "sim_wall_s": result.wall_s,
                   **(extra or {})}
        folder.write_json("summary.json", summary)
        trained = [s for s, n in result.staleness_hist.items() for _ in range(n)]
        panels = [
            Panel("throughput (trained samples/s, cumulative)", "line", x="t", y=["samples_per_s"]),
            Panel("staleness of trained groups", "hist", values=trained, bins=max(trained, default=0) + 1),
            Panel("queue depths (groups)", "line", x="t",
                  y=["depth_produced", "depth_buffer", "depth_ready", "window", "live_groups"]),
            Panel("learner time per version (s)", "line", x="version", y=["version_s", "step_s", "collect_s"]),
        ]
        render_report(folder.path / "report.png", result.records, panels, title=f"{name}: simulated")
    return folder.path


def print_result(result: SimResult, measured: dict | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"simulated: {result.engines} engines, k = {result.k} ({result.events} events, "
                        f"{result.wall_s:.2f} s)")
    table.add_column("figure")
    table.add_column("simulated", justify="right")
    if measured:
        table.add_column("measured", justify="right")
        table.add_column("error", justify="right")
    for key, value in result.figures.items():
        row = [key, f"{value:g}"]
        if measured:
            m = measured.get(key)
            row += ["" if m is None else f"{m:g}", "" if not m else f"{(value - m) / m:+.1%}"]
        table.add_row(*row)
    table.add_row("staleness histogram", str(result.staleness_hist))
    Console(stderr=True, width=120).print(table)


@dataclass
class SweepPoint:
    engines: int
    k: int
    learners: int
    figures: dict[str, float]


@dataclass
class Sweep:
    points: list[SweepPoint] = field(default_factory=list)


def parse_sweep(items: Sequence[str]) -> dict[str, list[int]]:
    """`["engines=1,2,4", "k=0,1"]` -> {"engines": [1, 2, 4], "k": [0, 1]}."""
    axes: dict[str, list[int]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or key not in SWEEP_KEYS:
            raise ConfigError(f"--sweep {item!r}: expected KEY=V1,V2,... with KEY one of {', '.join(SWEEP_KEYS)}, "
                              "e.g. --sweep engines=1,2,4,8 k=0,1,2,4")
        try:
            parsed = [int(v) for v in values.split(",") if v.strip()]
        except ValueError:
            raise ConfigError(f"--sweep {item!r}: values must be integers, e.g. {key}=1,2,4") from None
        if not parsed or min(parsed) < (0 if key == "k" else 1):
            raise ConfigError(f"--sweep {item!r}: give at least one value, each >= {0 if key == 'k' else 1}")
        axes[key] = parsed
    return axes


def run_sweep(config: str, overrides: Sequence[str], axes: dict[str, list[int]], steps: int | None,
              costs: Costs | None = None, engines: int | None = None, learners: int | None = None) -> Sweep:
    """Simulate every combination of the sweep's axes (k = 0 is mode 'sync')."""
    import itertools

    sweep = Sweep()
    ks = axes.get("k", [None])
    for e, k, m in itertools.product(axes.get("engines", [engines]), ks, axes.get("learners", [learners])):
        extra = [] if k is None else ([f"mode='{'sync' if k == 0 else 'async'}'", f"staleness.k={k}"])
        if m is not None:
            extra.append(f"simulate.learners={m}")
        cfg, spec = load_simulation_config(config, [*overrides, *extra])
        point_costs = costs
        if isinstance(costs, MeasuredCosts) and m is not None:
            point_costs = MeasuredCosts(costs.calls, costs.steps, m, costs.hop_s, costs.engine_load_s,
                                        costs.get_s_per_group)
        result = simulate(cfg, spec, point_costs, engines=e, steps=steps)
        sweep.points.append(SweepPoint(result.engines, result.k, spec.learners,
                                       {**result.figures, "sim_wall_s": result.wall_s}))
    return sweep


def print_sweep(sweep: Sweep) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="baton simulate --sweep (steady state)")
    for col in ("engines", "k", "learners", "samples/s", "x fewest engines", "learner busy", "engine idle",
                "mean staleness", "dropped"):
        table.add_column(col, justify="right")
    first: dict[tuple[int, int], float] = {}
    for p in sweep.points:
        f = p.figures
        base = first.setdefault((p.k, p.learners), f["samples_per_s"])
        table.add_row(str(p.engines), str(p.k), str(p.learners), f"{f['samples_per_s']:.1f}",
                      f"{f['samples_per_s'] / base:.2f}", f"{f['learner_busy']:.3f}", f"{f.get('engine_idle', 0):.3f}",
                      f"{f['mean_staleness']:.2f}", f"{f['dropped_frac']:.3f}")
    Console(stderr=True, width=120).print(table)


def write_sweep(root: str | Path, name: str, sweep: Sweep) -> Path:
    """sweep.json and sweep.png (samples/s and learner busy fraction against engines, one line per k) in a
    new run folder."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from pipeline.telemetry import RunFolder

    folder = RunFolder.create(root, f"{name}-sweep")
    folder.write_json("sweep.json", [p.__dict__ for p in sweep.points])
    fig = Figure(figsize=(12, 4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    lines = sorted({(p.k, p.learners) for p in sweep.points})
    for k, m in lines:
        pts = sorted((p for p in sweep.points if p.k == k and p.learners == m), key=lambda p: p.engines)
        label = f"k={k}" + (f", learners={m}" if len({q.learners for q in sweep.points}) > 1 else "")
        xs = [p.engines for p in pts]
        axes[0].plot(xs, [p.figures["samples_per_s"] for p in pts], marker="o", label=label)
        axes[1].plot(xs, [p.figures["learner_busy"] for p in pts], marker="o", label=label)
        axes[2].plot(xs, [p.figures.get("engine_idle", 0) for p in pts], marker="o", label=label)
    for ax, title in zip(axes, ("trained samples/s", "learner busy fraction", "engine idle fraction"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("engines")
        if len({p.engines for p in sweep.points}) > 1 and min(p.engines for p in sweep.points) > 0:
            ax.set_xscale("log", base=2)
        ax.legend(fontsize="small")
    fig.suptitle(f"{name}: where more engines stop paying, and what k buys")
    fig.savefig(folder.path / "sweep.png", dpi=100)
    folder.close()
    return folder.path


# ------------------------------------------------------------------------------------------------ the CLI


def main(config: str | None, calibrate_dir: str | None, engines: int | None, learners: int | None,
         steps: int | None, overrides: Sequence[str], sweep: Sequence[str] | None) -> int:
    """`baton simulate`: prints a table (stderr) and one JSON line (stdout); writes a run folder."""
    import sys

    try:
        costs: Costs | None = None
        measured = None
        if calibrate_dir is not None:
            cal = calibrate(calibrate_dir, learners=learners or 1)
            config = config or str(cal.config_path)
            costs, measured = cal.costs, cal.measured
            engines = engines or cal.engines
        if config is None:
            raise ConfigError("simulate needs a CONFIG, or --calibrate RUN_DIR")
        sets = [*overrides, *([f"simulate.learners={learners}"] if learners else [])]
        cfg, spec = load_simulation_config(config, sets)
        if sweep:
            axes = parse_sweep(sweep)
            result = run_sweep(config, sets, axes, steps, costs, engines, learners)
            print_sweep(result)
            folder = write_sweep(cfg.run_root, cfg.name, result)
            print(json.dumps({"sweep_dir": str(folder), "points": [p.__dict__ for p in result.points]}), flush=True)
            return 0
        result = simulate(cfg, spec, costs, engines=engines, steps=steps)
    except ConfigError as exc:
        print(f"baton: {exc}", file=sys.stderr)
        return 2
    extra = {"calibrated_from": str(calibrate_dir), "measured": measured} if calibrate_dir else {}
    folder = write_run(cfg.run_root, cfg.name, result, extra)
    print_result(result, measured)
    print(json.dumps({"run_dir": str(folder), "figures": result.figures, "staleness_hist": result.staleness_hist,
                      "counts": result.counts, **extra}), flush=True)
    return 0
