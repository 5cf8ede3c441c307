"""What each modelled stage of `baton simulate` pays: the `Costs` protocol, declared from the `[simulate]`
table (`DeclaredCosts`, formulas in baton.schema.SimulateSpec) or resampled from a real run's records
(`MeasuredCosts`, made by baton.simulate.calibrate)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from baton.schema import SimulateSpec
from stages.environments.tokens import EpisodeTokens

# bytes of payload per token in the store: int32 token + float32 logprob + uint8 mask + int32 version
CODEC_BYTES_PER_TOKEN = EpisodeTokens.ROW_BYTES_PER_TOKEN
# one call to an actor in another process (a Ray channel, the gate, the ledger): about 1 ms measured on
# this project's CPU box (shared/notes/async-ceiling.md, "An actor call round trip is about 1 ms")
RAY_HOP_S = 1e-3
# weight-push bandwidth per transport when [simulate] does not set push_bytes_per_s: assumed figures
# (inproc shares memory; mooncake_p2p over one 100 Gb/s RDMA NIC at ~80 % efficiency; broadcast: NCCL
# over the same NIC; disk: a local NVMe write + read)
PUSH_BYTES_PER_S = {"inproc": 1e12, "mooncake_p2p": 10e9, "broadcast": 10e9, "delta": 10e9, "disk": 2e9}


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
    ranks: int = 1  # learner ranks (SimulateSpec.learners, else learner.world_size)

    def __post_init__(self) -> None:
        s = self.spec
        self.hop_s = s.hop_s if s.hop_s is not None else (RAY_HOP_S if self.runtime == "ray" else 0.0)
        self.engine_load_s = s.engine_load_s
        self._push_bps = s.push_bytes_per_s or PUSH_BYTES_PER_S.get(self.transport, PUSH_BYTES_PER_S["mooncake_p2p"])
        # an MoE's compute follows its active parameters, its weights (push, FSDP traffic) the total
        active = s.active_params or s.params
        self.weight_bytes = int(s.params * s.param_bytes) if s.params and "weight_bytes" not in s.model_fields_set \
            else int(s.weight_bytes)
        self.decode_tokens_per_s = (s.decode_flops_per_s / (2 * active) if s.decode_flops_per_s
                                    else s.decode_tokens_per_s)
        self.train_tokens_per_s = s.train_flops_per_s / (6 * active) if s.train_flops_per_s else s.train_tokens_per_s
        # lognormal with the declared mean: mu = ln(mean) - sigma^2 / 2
        self._mu = math.log(s.response_tokens_mean) - s.response_tokens_sigma**2 / 2

    def engine_call(self, rng: random.Random, groups: int) -> EngineCall:
        s = self.spec
        lengths_rng = np.random.default_rng(rng.getrandbits(64))
        drawn = lengths_rng.lognormal(self._mu, s.response_tokens_sigma, size=(groups, self.group_size))
        lengths = np.clip(np.rint(drawn), 1, s.max_response_tokens)
        response = float(lengths.sum())
        longest = float(lengths.max())
        generate = max(response / self.decode_tokens_per_s, longest / s.sequence_tokens_per_s)
        tokens = (lengths.sum(axis=1) + s.prompt_tokens * self.group_size).astype(int).tolist()
        nbytes = [t * CODEC_BYTES_PER_TOKEN for t in tokens]
        put = sum(s.store_latency_s + b / s.store_bytes_per_s for b in nbytes)
        return EngineCall(generate, put, s.engine_call_overhead_s + self.hop_s, tokens, nbytes)

    def load_s(self, rng: random.Random, nbytes: int) -> float:
        return self.spec.store_latency_s + nbytes / self.spec.store_bytes_per_s

    def _sharded_bytes(self) -> float:
        """Bytes of the weights a rank gets from (or sends to) the other ranks, once."""
        return self.weight_bytes * (self.ranks - 1) / self.ranks

    def step_s(self, rng: random.Random, tokens: int) -> float:
        s = self.spec
        return s.step_overhead_s + tokens / (self.train_tokens_per_s * self.ranks) + \
            3 * self._sharded_bytes() / s.shard_bytes_per_s

    def push_s(self, rng: random.Random, engines: int = 1) -> float:
        s = self.spec
        sent = self.weight_bytes * (engines if s.push_per_engine else 1) / self._push_bps
        if self.transport == "mooncake_p2p":  # every rank writes its own part at once
            return s.push_latency_s + sent / self.ranks
        return s.push_latency_s + self._sharded_bytes() / s.shard_bytes_per_s + sent

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
