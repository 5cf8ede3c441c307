"""Training models over N ranks: `baton serve MODEL_DIR --world-size N`.

The service starts the learner's rank group (`stages.learner.ranks.RankGroup`, its channel and STOP) with its
own follower loop, `follow_models`: each follower keeps one `TrainingModel` (one rank's FSDP2 shard) per client
model id, and rank 0's `RankedModel` tells it, per call, what to do with which model (the ops below: a command
[op, version, n] then n bytes of msgpack `Order`, no pickle). Every call of every model holds one lock on rank
0 (`ServiceRanks.command`) from its command to its end: the models' collectives never interleave, so several
client models coexist on one group, their calls run one at a time across all of them.

A forward(_backward) splits its datums over the ranks by tokens (whole datums, `policies.balance`): each rank
computes its share's sum-loss and, for backward, the gradient of that sum times the world size (FSDP2 averages
over ranks; Tinker's losses are sums), so the ranks' gradients add up to the one-rank gradient of the whole
batch. A rank without datums runs one masked dummy row. Rank 0 gathers every share's logprobs and puts them
back in the request's order; `loss:sum` is summed over ranks, each stat averaged over every rank's tokens.

`optim_step` steps every rank's shard; a sampler's weights (the adapter with its probe, or every weight for a
full fine-tune) and `save_state`'s export are gathered whole to rank 0 (`PolicyTrainer.weights`, a collective);
the checkpoint is written by every rank (DCP: it loads at any world size).

Failure: a call that fails part-way leaves the ranks out of step; the group is then marked broken and every
later training call is refused naming the first failure (restart `baton serve`). A follower that exits is seen
at the next call (`RankGroup.check`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import numpy as np
import torch.distributed as dist

from policies.balance import balance_groups
from stages.learner import GRPOLearner
from stages.learner.lora import LoraSpec
from stages.learner.ranks import STOP, Channel, RankGroup, join_group
from stages.service.training import AdamSettings, Part, TrainingModel, metrics_of
from stages.service.wire import Datum
from stages.weights.adapter import AdapterVersion
from stages.weights.disk import DiskNotice

MODEL_NEW, MODEL_LOAD, MODEL_PASS, MODEL_STEP, MODEL_WEIGHTS, MODEL_SAVE = range(16, 22)


class Order(msgspec.Struct, frozen=True, omit_defaults=True):
    """Rank 0 to every rank: the model a command is about, and what that op needs."""

    model: str
    lora: LoraSpec | None = None  # MODEL_NEW, MODEL_LOAD: the model's kind (None: full fine-tuning)
    path: str = ""  # MODEL_LOAD, MODEL_SAVE: the checkpoint's state folder
    optimizer: bool = False  # MODEL_LOAD: with the checkpoint's AdamW moments
    loss_fn: str = ""  # MODEL_PASS
    settings: dict[str, float] = {}
    backward: bool = False
    adam: AdamSettings | None = None  # MODEL_STEP


class Share(msgspec.Struct, frozen=True):
    """A follower's `Part`, back to rank 0: its datums' logprobs (float32 bytes, in its share's order)."""

    rows: list[bytes]
    loss: float
    stats: dict[str, float]
    tokens: float

    @classmethod
    def of(cls, part: Part) -> Share:
        return cls([np.asarray(r, np.float32).tobytes() for r in part.rows], part.loss, part.stats, part.tokens)

    def part(self) -> Part:
        return Part([np.frombuffer(r, np.float32) for r in self.rows], self.loss, self.stats, self.tokens)


def pack_datums(data: list[Datum]) -> bytes:
    """Datums as msgpack: per datum its tokens and each input as raw bytes (int64 tokens and target_tokens,
    float32 the rest, as `stages.service.wire` decodes them)."""
    return msgspec.msgpack.encode([(d.tokens.astype(np.int64).tobytes(), {k: v.tobytes() for k, v in d.inputs.items()})
                                   for d in data])


def unpack_datums(blob: bytes) -> list[Datum]:
    if not blob:
        return []
    return [Datum(np.frombuffer(tokens, np.int64).copy(),  # writable: torch.from_numpy takes them as they are
                  {k: np.frombuffer(v, np.int64 if k == "target_tokens" else np.float32).copy()
                   for k, v in inputs.items()})
            for tokens, inputs in msgspec.msgpack.decode(blob)]


def follow_models(rank: int, world_size: int, address: str, port: int, spec: GRPOLearner, steps: int) -> None:
    """A follower rank of the service: join the group, then do what rank 0 says to whichever model it names,
    until STOP. `spec` names the base folder and the device; `steps` is unused (each model counts its own)."""
    import torch

    torch.set_num_threads(1)
    channel = join_group(rank, world_size, address, port, spec.device, spec.rank_timeout_s)
    models: dict[str, TrainingModel] = {}
    while True:
        op, version, data = channel.receive_command()
        if op == STOP:
            break
        order = msgspec.msgpack.decode(data, type=Order)
        if op in (MODEL_NEW, MODEL_LOAD):
            models[order.model] = TrainingModel(spec.model_path, order.lora, spec.device, world_size)
            if op == MODEL_LOAD:
                models[order.model].read_state(Path(order.path), order.optimizer)
            continue
        model = models[order.model]
        if op == MODEL_PASS:
            datums = unpack_datums(channel.receive_part(rank, world_size))
            part = model.part(datums, order.loss_fn, order.settings, order.backward)
            channel.gather(msgspec.msgpack.encode(Share.of(part)), rank, world_size)
        elif op == MODEL_STEP:
            assert order.adam is not None
            model.optim_step(order.adam)
        elif op == MODEL_WEIGHTS:
            model.trainer.weights(version)
        elif op == MODEL_SAVE:
            model.write_state(Path(order.path))
    dist.destroy_process_group()


class ServiceRanks:
    """Rank 0's handle on the service's rank group (see the module docstring): start, one call at a time, close."""

    def __init__(self, model_path: Path, world_size: int, device: str = "cpu", timeout_s: float = 300.0) -> None:
        self.model_path, self.world_size, self.device = model_path, world_size, device
        spec = GRPOLearner(model_path, device=device, world_size=world_size, rank_timeout_s=timeout_s)
        self.group = RankGroup(spec, 1, follower=follow_models)
        self.lock = threading.Lock()
        self.broken = ""  # the first failure of a call, once one failed

    def start(self) -> None:
        """Start the followers and join them (from a thread that lives as long as the service)."""
        self.group.spawn()
        self.group.join()

    @contextmanager
    def command(self, op: int, order: Order, version: int = 0) -> Iterator[Channel]:
        """Hold the group for one call: tell every follower `op` on `order`, then yield the channel for rank 0's
        part. A failure inside marks the group broken (the ranks may be out of step)."""
        with self.lock:
            if self.broken:
                raise RuntimeError(f"the service's rank group is broken since a call failed ({self.broken}); "
                                   "restart baton serve")
            self.group.check()
            channel = self.group.channel
            assert channel is not None, "ServiceRanks.start was not called"
            try:
                channel.command(op, version, msgspec.msgpack.encode(order))
                yield channel
            except BaseException as exc:
                self.broken = f"{type(exc).__name__}: {exc}"
                raise

    def close(self) -> None:
        """Stop the followers: after the call in progress, or, when one holds the group for over 10 s (a
        collective a rank never joins), without it (the followers are then ended by their pids)."""
        held = self.lock.acquire(timeout=10)
        try:
            self.group.close()
        finally:
            if held:
                self.lock.release()


class RankedModel:
    """Rank 0's side of one client model over every rank: `TrainingModel`'s calls, each run on every rank."""

    def __init__(self, ranks: ServiceRanks, model_id: str, local: TrainingModel) -> None:
        self.ranks, self.model_id, self.local = ranks, model_id, local
        self.lora, self.trainer = local.lora, local.trainer

    @classmethod
    def create(cls, ranks: ServiceRanks, model_id: str, lora: LoraSpec | None,
               state: Path | None = None, optimizer: bool = False) -> RankedModel:
        """A new model on every rank; from the checkpoint in `state` (its AdamW moments with `optimizer`)."""
        order = Order(model_id, lora=lora, path=str(state or ""), optimizer=optimizer)
        with ranks.command(MODEL_NEW if state is None else MODEL_LOAD, order):
            local = TrainingModel(ranks.model_path, lora, ranks.device, ranks.world_size)
            if state is not None:
                local.read_state(state, optimizer)
        return cls(ranks, model_id, local)

    @property
    def steps(self) -> int:
        return self.local.steps

    def forward_backward(self, data: list[Datum], loss_fn: str, settings: dict[str, float],
                         backward: bool) -> tuple[list[np.ndarray], dict[str, float]]:
        """Each datum's target logprobs, in `data`'s order, and the metrics over every rank's share."""
        shares = balance_groups([d.tokens.size for d in data], self.ranks.world_size)
        order = Order(self.model_id, loss_fn=loss_fn, settings=settings, backward=backward)
        with self.ranks.command(MODEL_PASS, order) as channel:
            channel.scatter([b"", *(pack_datums([data[i] for i in share]) for share in shares[1:])])
            mine = self.local.part([data[i] for i in shares[0]], loss_fn, settings, backward)
            theirs = channel.gather(b"", 0, self.ranks.world_size)[1:]
        parts = [mine, *(msgspec.msgpack.decode(blob, type=Share).part() for blob in theirs)]
        rows: list[np.ndarray] = [np.zeros(0, np.float32)] * len(data)
        for share, part in zip(shares, parts, strict=True):
            for i, row in zip(share, part.rows, strict=True):
                rows[i] = row
        return rows, metrics_of(parts)

    def optim_step(self, adam: AdamSettings) -> dict[str, float]:
        with self.ranks.command(MODEL_STEP, Order(self.model_id, adam=adam)):
            return self.local.optim_step(adam)

    def adapter(self) -> AdapterVersion:
        with self.ranks.command(MODEL_WEIGHTS, Order(self.model_id), self.steps):
            return self.local.adapter()

    def load_into(self, model) -> int:
        with self.ranks.command(MODEL_WEIGHTS, Order(self.model_id), self.steps):
            return self.local.load_into(model)

    def sampler_weights(self, folder: Path) -> AdapterVersion | DiskNotice:
        with self.ranks.command(MODEL_WEIGHTS, Order(self.model_id), self.steps):
            return self.local.sampler_weights(folder)

    def write_state(self, folder: Path) -> None:
        with self.ranks.command(MODEL_SAVE, Order(self.model_id, path=str(folder))):
            self.local.write_state(folder)
