"""A learner of several ranks: rank 0 is the stage the run talks to, the others follow its step.

`RankGroup.spawn` starts `world_size - 1` follower processes through the runtime (local: on this host,
each on its own device; Ray: actors in a placement group, a GPU each on CUDA) and joins them in one
`torch.distributed` group (gloo on CPU, NCCL on CUDA, plus a
gloo group for control messages). `RankedTrainer` is rank 0's trainer: the same methods as a
`PolicyTrainer`, each first telling the followers what to do (a command) and then doing its own part
of the collective. Followers run `follow` until told to stop.

Protocol, all over the control group, no pickle: a command is an int64 tensor [op, version, n] then n
bytes (a path, or msgpack); a step sends every rank its share of the groups as codec-encoded batches
(`buffers.codec`) and the `StepPlan` every rank must agree on. A step's groups are split across ranks
by tokens (`policies.balance.balance_groups`: whole groups, the most tokens first to the least loaded rank).

Names: rank r is `learner-rank-{r}` (`rank_name`) everywhere: rank 0 is the learner actor's process, a
follower's helper process is named by its rank, in the start-up log, errors and reports alike.

Failure: a follower that exits is seen by `RankGroup.check` (the learner actor polls it, `watch`) and
raises `LearnerRankFailed`, naming the rank and its exit code (and the signal that killed it); a
collective that a dead rank never joins fails after `timeout_s` at the latest. The learner actor then
restarts the whole group from the latest checkpoint while `[learner] max_restarts` allow
(`stages.learner.restart`), else the run ends with it. Followers die with rank 0 (`die_with_parent`).

The training service (`baton serve --world-size N`, `stages.service.ranked`) starts the same group with its
own follower loop (`RankGroup(follower=...)`): the same channel and commands, its own ops (16..), STOP alike.
"""

from __future__ import annotations

import signal
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import msgspec
import torch
import torch.distributed as dist

from buffers.codec import RolloutBatch, decode, encode
from pipeline.contracts import Helper, HelperStarter, Resources
from pipeline.faults import Schedule
from pipeline.net import free_port
from pipeline.runtime.local import start_local_helpers
from pipeline.telemetry import get_logger
from policies.balance import balance_groups
from stages.learner.step import PolicyTrainer, StepPlan, group_figures, plan_step, row_lengths
from stages.weights.layout import Layout
from stages.weights.mooncake_shards import PushSettings, ShardWriter
from stages.weights.reshard import BucketCheck

STEP, WEIGHTS, SAVE, LOAD, SCHEDULE, PUSH, STOP = range(7)
# ops 16.. are the training service's (`stages.service.ranked`): its followers keep a trainer per client model


class LearnerRankFailed(RuntimeError):
    """A rank of the learner died or left its group; the message names the rank and how."""


def rank_name(rank: int) -> str:
    """The one name of learner rank `rank` (0: the learner actor's own process)."""
    return f"learner-rank-{rank}"


def how_it_ended(code: int) -> str:
    """An exit code as said to a user: `code -9 (killed by SIGKILL)` for a signal, else `code N`."""
    if code < 0:
        try:
            return f"code {code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"code {code}"


def _pack(batches: list[RolloutBatch]) -> bytes:
    """Codec-encoded batches, each prefixed with its length."""
    parts = [bytes(encode(b)) for b in batches]
    return b"".join(struct.pack("<Q", len(p)) + p for p in parts)


def _unpack(blob: bytes) -> list[RolloutBatch]:
    batches, at = [], 0
    while at < len(blob):
        (n,) = struct.unpack_from("<Q", blob, at)
        batches.append(decode(memoryview(blob)[at + 8 : at + 8 + n]))
        at += 8 + n
    return batches


@dataclass
class Channel:
    """Control messages from rank 0 to the followers, over the control group (no pickle)."""

    group: Any = None  # the gloo group (None: the default group, itself gloo)

    def command(self, op: int, version: int = 0, data: bytes = b"") -> None:
        header = torch.tensor([op, version, len(data)], dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.group)
        if data:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=self.group)

    def receive_command(self) -> tuple[int, int, bytes]:
        header = torch.zeros(3, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.group)
        op, version, n = (int(x) for x in header)
        data = torch.zeros(n, dtype=torch.uint8)
        if n:
            dist.broadcast(data, src=0, group=self.group)
        return op, version, data.numpy().tobytes()

    def scatter(self, parts: list[bytes]) -> None:
        """Rank 0 sends `parts[r]` to rank r (r >= 1)."""
        sizes = torch.tensor([len(p) for p in parts], dtype=torch.int64)
        dist.broadcast(sizes, src=0, group=self.group)
        for rank, part in enumerate(parts[1:], start=1):
            if part:
                dist.send(torch.frombuffer(bytearray(part), dtype=torch.uint8), dst=rank, group=self.group)

    def gather(self, data: bytes, rank: int, world_size: int) -> list[bytes]:
        """Every rank's `data`, at rank 0 (in rank order; the others get [])."""
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.group)
        if rank != 0:
            if data:
                dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=0, group=self.group)
            return []
        parts = [data]
        for source in range(1, world_size):
            part = torch.zeros(int(sizes[source]), dtype=torch.uint8)
            if len(part):
                dist.recv(part, src=source, group=self.group)
            parts.append(part.numpy().tobytes())
        return parts

    def receive_part(self, rank: int, world_size: int) -> bytes:
        sizes = torch.zeros(world_size, dtype=torch.int64)
        dist.broadcast(sizes, src=0, group=self.group)
        data = torch.zeros(int(sizes[rank]), dtype=torch.uint8)
        if len(data):
            dist.recv(data, src=0, group=self.group)
        return data.numpy().tobytes()


def uses_cuda(device: str) -> bool:
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def join_group(rank: int, world_size: int, address: str, port: int, device: str, timeout_s: float) -> Channel:
    """Join the learner's process group (rank 0 hosts the rendezvous on address:port)."""
    backend = "nccl" if uses_cuda(device) else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return Channel(dist.new_group(backend="gloo") if backend == "nccl" else None)


class PushOrder(msgspec.Struct, frozen=True):
    """Rank 0 to every rank: write your pieces of `version` into the slot at `address` of `peer`."""

    peer: str
    address: int
    version: int
    settings: PushSettings


class PushResult(msgspec.Struct, frozen=True):
    checks: list[BucketCheck] = []
    error: str = ""


class ShardPusher:
    """One rank's part of a push from the shards (`stages.weights.mooncake_shards`); its writer is made on
    the first push (the transport's settings come with it)."""

    def __init__(self, trainer: PolicyTrainer, rank: int) -> None:
        self.trainer, self.rank = trainer, rank
        self.writer: ShardWriter | None = None

    def ready(self, settings: PushSettings) -> ShardWriter:
        if self.writer is None or self.writer.settings != settings:
            self.writer = ShardWriter(dict(self.trainer.model.named_parameters()), self.rank,
                                      self.trainer.world_size, settings)
        return self.writer

    def push(self, order: PushOrder) -> bytes:
        try:
            checks = self.ready(order.settings).write(order.peer, order.address, order.version)
        except ConnectionError as exc:
            return msgspec.msgpack.encode(PushResult(error=str(exc)))
        return msgspec.msgpack.encode(PushResult(checks))


def follow(rank: int, world_size: int, address: str, port: int, spec: Any, steps: int) -> None:
    """A follower rank's process: join the group, make the trainer, then do what rank 0 says."""
    torch.set_num_threads(1)
    channel = join_group(rank, world_size, address, port, spec.device, spec.rank_timeout_s)
    trainer = PolicyTrainer(spec, steps, world_size)
    pusher = ShardPusher(trainer, rank)
    while True:
        op, version, data = channel.receive_command()
        if op == STEP:
            blob = channel.receive_part(rank, world_size)
            plan = msgspec.msgpack.decode(data, type=StepPlan)
            trainer.step(_unpack(blob), plan)
        elif op == WEIGHTS:
            trainer.weights(version)
        elif op == SAVE:
            trainer.write_state(Path(data.decode()), version)
        elif op == LOAD:
            trainer.read_state(Path(data.decode()))
        elif op == SCHEDULE:
            trainer.schedule(version)
        elif op == PUSH:
            channel.gather(pusher.push(msgspec.msgpack.decode(data, type=PushOrder)), rank, world_size)
        elif op == STOP:
            break
    dist.destroy_process_group()


class RankGroup:
    """Rank 0's handle on the follower processes (see the module docstring). `start_helpers` is the run's
    (`Services.start_helpers`); `address` is where the followers reach this process."""

    def __init__(self, spec: Any, steps: int, start_helpers: HelperStarter | None = None,
                 address: str = "127.0.0.1", follower: Callable[..., None] | None = None) -> None:
        self.spec, self.steps, self.world_size = spec, steps, spec.world_size
        self.follower = follower or follow  # a follower's loop: (rank, world_size, address, port, spec, steps)
        self.start_helpers = start_helpers or start_local_helpers
        self.address, self.port = address, free_port(address)  # rank 0's node: the followers dial it there
        self.helpers: list[Helper] = []
        self.channel: Channel | None = None
        self.stopping = False
        self.crash: Schedule | None = None  # the planned fault learner.rank_crash (pipeline.faults), if any

    def spawn(self) -> None:
        """Start the followers (locally: from the event loop's thread, so they die with this process)."""
        follower = replace(self.spec, weights="inproc")  # a follower publishes nothing itself
        args = [(rank, self.world_size, self.address, self.port, follower, self.steps)
                for rank in range(1, self.world_size)]
        needs = Resources(cpus=1, gpus=1 if uses_cuda(self.spec.device) else 0)
        self.helpers = self.start_helpers("learner-rank", self.follower, args, needs)
        for rank, helper in enumerate(self.helpers, start=1):  # the starter counts from 0, the ranks from 1
            helper.name = rank_name(rank)

    @property
    def names(self) -> list[str]:
        """Every rank's name, rank 0 (this process) first."""
        return [rank_name(rank) for rank in range(self.world_size)]

    def join(self) -> None:
        """Join the group as rank 0 (blocks until every follower joined)."""
        get_logger("learner").info("rank rendezvous", address=f"{self.address}:{self.port}",
                                   ranks=self.world_size)
        self.channel = join_group(0, self.world_size, self.address, self.port, self.spec.device,
                                  self.spec.rank_timeout_s)

    def check(self) -> None:
        """Raise `LearnerRankFailed` when a follower has exited while the learner still runs."""
        for rank, helper in enumerate(self.helpers, start=1):
            code = helper.exitcode()
            if code is not None and not self.stopping:
                raise LearnerRankFailed(f"learner rank {rank} ({helper.name}) exited with {how_it_ended(code)}; "
                                        "the learner's other ranks cannot step without it")

    def crash_if_planned(self, version: int) -> None:
        """The fault learner.rank_crash: SIGKILL (locally; Ray: kill) the last rank once `version` is trained
        when the plan says so; the watch then sees it exit, as any rank's death."""
        if self.crash is not None and self.helpers and self.crash.hit(occurrence=version):
            self.helpers[-1].stop(timeout_s=0)

    async def watch(self) -> None:
        """Raise `LearnerRankFailed` as soon as a follower has exited (polled every quarter second)."""
        while True:
            self.check()
            await anyio.sleep(0.25)

    def close(self) -> None:
        """Tell the followers to stop, leave the group, and end any follower that does not exit."""
        self.stopping = True
        if self.channel is not None and all(h.exitcode() is None for h in self.helpers):
            try:
                self.channel.command(STOP)
            except RuntimeError:  # a follower already gone: the kill below ends the others
                pass
        if dist.is_initialized():
            dist.destroy_process_group()
        for helper in self.helpers:
            helper.stop(timeout_s=10)


class RankedTrainer:
    """Rank 0's trainer over the group: every call tells the followers, then does rank 0's part."""

    def __init__(self, trainer: PolicyTrainer, group: RankGroup) -> None:
        self.trainer, self.group = trainer, group
        self.spec, self.device, self.model = trainer.spec, trainer.device, trainer.model
        self.pusher = ShardPusher(trainer, 0)

    # -- a `stages.weights.mooncake_shards.ShardSource`: pushes from every rank's shard ----------------
    def receive_layout(self, version: int, settings: PushSettings) -> Layout:
        return self.pusher.ready(settings).receive_layout(version)

    def write(self, peer: str, address: int, version: int, settings: PushSettings) -> list[BucketCheck]:
        order = PushOrder(peer, address, version, settings)
        self.channel.command(PUSH, version, msgspec.msgpack.encode(order))
        mine = self.pusher.push(order)
        results = [msgspec.msgpack.decode(r, type=PushResult)
                   for r in self.channel.gather(mine, 0, self.group.world_size)]
        for rank, result in enumerate(results):
            if result.error:
                raise ConnectionError(f"learner rank {rank}: {result.error}")
        return [check for result in results for check in result.checks]

    @property
    def channel(self) -> Channel:
        assert self.group.channel is not None
        return self.group.channel

    def schedule(self, version: int) -> None:
        self.channel.command(SCHEDULE, version)
        self.trainer.schedule(version)

    def weights(self, version: int = 0) -> dict[str, torch.Tensor]:
        self.channel.command(WEIGHTS, version)
        return self.trainer.weights(version)

    def write_state(self, folder: Path, version: int) -> None:
        self.channel.command(SAVE, version, str(folder).encode())
        self.trainer.write_state(folder, version)

    def read_state(self, folder: Path) -> int:
        self.channel.command(LOAD, 0, str(folder).encode())
        return self.trainer.read_state(folder)

    def train(self, batches: list[RolloutBatch], mean_staleness: float = 0.0) -> dict[str, float]:
        """Split the step's groups over the ranks by tokens, send each follower its share, step rank 0's;
        the metrics are over every rank's rows (reward and group figures over all `batches`)."""
        tokens = [sum(row_lengths([b])) for b in batches]
        shares = [[batches[i] for i in share] for share in balance_groups(tokens, self.group.world_size)]
        plan = plan_step(shares, mean_staleness, self.spec.micro_batch_tokens)
        self.channel.command(STEP, 0, msgspec.msgpack.encode(plan))
        self.channel.scatter([b"", *(_pack(share) for share in shares[1:])])
        return {**self.trainer.step(shares[0], plan), **group_figures(batches)}
