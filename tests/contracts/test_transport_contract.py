"""The weight-transport contract: what every transport in `stages.weights.TRANSPORTS` does (and a user's,
by its path: `tests/contracts/plugin_transport.py`), checked
with real receivers: TorchEngines in this process (subscribed as themselves, or behind the mailboxes
an engine process registers, reached through `remote_receiver` as the learner reaches producer
processes) and engine processes (`tests/helpers/p2p_peer.py`).

A new transport passes by adding a `TransportCase` to `TRANSPORTS`: its name (or path), its options, which
receivers it reaches, and (if it moves bytes) how to damage them in flight. The cases that reach engines in
the receiving process run against a real vLLM server too (`test_transport_contract_vllm.py`).

The contract (`stages.weights.base`):
- made by name, a `WeightTransport` with the common `stats`;
- `publish(v, tensors)` returns once every subscribed receiver holds the whole version: each engine's
  weights are exactly the published tensors, and stay so while the learner trains on in place;
- versions must increase: an older or equal one raises `WeightPushError` and publishes nothing;
- a version a receiver refuses (its bytes arrived damaged, or its engine will not take it) is never
  applied there: the receiver keeps its version and weights, and `publish` raises `WeightPushError`
  after its retries (each refusal counted in `stats["refused"]`); a push the run's fault plan refuses
  (`weights.push_fail`) is retried, then surfaced, the same way;
- `resend(receiver)` catches up a receiver that lost or missed versions (its process restarted, or it
  did not answer) with the latest one;
- a receiver whose process does not answer is counted (`stats["unreachable"]`), never stops the others;
- a LoRA run's version (the adapter alone and its descriptor, `stages.weights.adapter`) moves like any
  other: every engine ends up with its base and exactly that adapter merged.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

import anyio  # noqa: E402
import pytest  # noqa: E402

from pipeline.faults import FaultPlan, FaultSpec  # noqa: E402
from stages.data.model import load_model, make_tiny_model  # noqa: E402
from stages.engines.torch import TorchEngine  # noqa: E402
from stages.weights import TRANSPORTS as BUILT_IN  # noqa: E402
from stages.weights import engine_mailboxes, make_transport  # noqa: E402
from stages.weights.adapter import adapter_pairs, merged_weights, unpack_adapter  # noqa: E402
from stages.weights.base import STATS, WeightPushError, WeightTransport, state_bytes  # noqa: E402
from stages.weights.faulty import with_weight_faults  # noqa: E402
from tests.helpers.lora import adapter_version, peft_policy  # noqa: E402
from tests.helpers.p2p_peer import PeerProcess, digest, learner_version  # noqa: E402
from tests.helpers.runs import baton_run  # noqa: E402

pytestmark = pytest.mark.anyio

Damage = Callable[[Any, Callable[[int], bool]], None]  # (transport, which sends) -> installs the damage


def every_send(n: int) -> bool:  # which sends (counted from 0 since the damage was installed) arrive damaged
    return True


def first_send(n: int) -> bool:
    return n == 0


def no_send(n: int) -> bool:
    return False


HELD_UP_S = 10  # a publish held up this long by a dead receiver is waiting out a timeout (broadcast's: 20 s here)


def damage_slots(transport, damaged: Callable[[int], bool]) -> None:
    """mooncake_p2p: 8 bytes of the last bucket's first tensor arrive wrong in the receiver's slot."""
    sends = itertools.count()

    def hit(layout, attempt):
        if not damaged(next(sends)):
            return None
        entry = layout.tensors[layout.buckets[-1].first]
        return entry.offset + 5, bytes([0xDE, 0xAD, 0xBE, 0xEF]) * 2

    transport.damage = hit


def damage_file(transport, damaged: Callable[[int], bool]) -> None:
    """disk: one byte near the end of the version's file (inside the tensor data) is flipped."""
    from stages.weights.disk import DiskTransport

    writes = itertools.count()

    def write_then_damage(version, tensors):
        notice = DiskTransport._write(transport, version, tensors)
        if damaged(next(writes)):
            with open(notice.path, "r+b") as f:
                f.seek(-100, 2)
                byte = f.read(1)
                f.seek(-100, 2)
                f.write(bytes([byte[0] ^ 0xFF]))
        return notice

    transport._write = write_then_damage


def damage_patch(transport, damaged: Callable[[int], bool]) -> None:
    """delta: one byte in the middle of the patch's payload is flipped."""
    from stages.weights.delta import DeltaTransport

    sends = itertools.count()

    def message(slot, patch, blob):
        if damaged(next(sends)) and blob:
            flipped = bytearray(blob)
            flipped[len(flipped) // 2] ^= 0xFF
            blob = bytes(flipped)
        return DeltaTransport._message(transport, slot, patch, blob)

    transport._message = message


def damage_blob(transport, damaged: Callable[[int], bool]) -> None:
    """the plug-in: one byte in the middle of the safetensors blob is flipped."""
    sends = itertools.count()

    def flip(data: bytes) -> bytes:
        if not damaged(next(sends)):
            return data
        flipped = bytearray(data)
        flipped[len(flipped) // 2] ^= 0xFF
        return bytes(flipped)

    transport.damage = flip


def damage_broadcast(transport, damaged: Callable[[int], bool]) -> None:
    """broadcast: one value of the first tensor is changed in flight."""
    sends = itertools.count()

    def before_send(outgoing, attempt):
        if not damaged(next(sends)):
            return outgoing
        outgoing = dict(outgoing)
        name = next(iter(outgoing))
        outgoing[name] = outgoing[name].clone()
        outgoing[name].view(-1)[0] += 1.0
        return outgoing

    transport.before_send = before_send


@dataclass(frozen=True)
class TransportCase:
    kind: str  # its name in stages.weights.TRANSPORTS, or a plug-in's "pkg.module:Class"
    options: dict = field(default_factory=dict)  # constructor options; a `root` of None gets a fresh folder
    local: bool = True  # reaches engines in this process
    processes: bool = True  # reaches engine processes (tests/helpers/p2p_peer.py) through their mailboxes
    askers: bool = True  # subscribes `Asker`s: one that does not answer is counted unreachable and skipped
    damage: Damage | None = None  # None: it moves no bytes (nothing can arrive damaged)
    resends_bytes: bool = True  # a retry sends the bytes again (damage to one send is repaired by the next)
    name: str = ""  # its `name`, where that is not `kind` (a plug-in's)

    def make(self, folder: Path):
        options = dict(self.options)
        if "root" in options:
            options["root"] = folder / "weights"
        return make_transport(self.kind, **options)


PLUGIN = "tests.contracts.plugin_transport:SafetensorsTransport"  # a user's transport, outside the package
TRANSPORTS = [
    TransportCase("inproc", processes=False, askers=False),
    TransportCase("disk", {"root": None, "retries": 1}, damage=damage_file, resends_bytes=False),
    TransportCase("delta", {"retries": 1}, damage=damage_patch),
    TransportCase("mooncake_p2p", {"bucket_bytes": 64 << 10, "retries": 1}, damage=damage_slots),
    TransportCase("broadcast", {"retries": 1, "timeout_s": 20}, local=False, damage=damage_broadcast),
    # engine processes: tests/helpers/p2p_peer.py registers the built-ins' mailboxes; a quickstart run carries it
    TransportCase(PLUGIN, {"retries": 1}, processes=False, damage=damage_blob, name="safetensors"),
]


def case_id(case: TransportCase) -> str:
    return case.kind.rpartition(":")[2]


CASES = [pytest.param(case, id=case_id(case)) for case in TRANSPORTS]
MOVES_BYTES = [pytest.param(case, id=case_id(case)) for case in TRANSPORTS if case.damage is not None]
LOCAL = [pytest.param(case, id=case_id(case)) for case in TRANSPORTS if case.local]
ASKERS = [pytest.param(case, id=case_id(case)) for case in TRANSPORTS if case.askers]


# ---------------------------------------------------------------- receivers


class Engine:
    """An engine in the learner's process, subscribed as itself."""

    def __init__(self, model: Path, name: str) -> None:
        self.engine, self.name = TorchEngine(model, name=name), name

    async def start(self) -> Engine:
        await self.engine.start()
        return self

    def subscribe(self, transport) -> None:
        transport.subscribe(self.engine)

    async def held(self) -> tuple[int, dict[str, int]]:
        return self.engine.version, digest(self.engine._model.state_dict())


class Mailboxes(Engine):
    """The mailboxes an engine process registers (`engine_mailboxes`), served in this process and
    reached through `transport.remote_receiver`, as the learner reaches a producer process. `up`
    False: the process does not answer; `restart()`: it is a new process (a fresh engine, nothing held)."""

    def __init__(self, model: Path, name: str, transport: str) -> None:
        super().__init__(model, name)
        self.model, self.up, self.handle, self.transport = model, True, None, transport

    async def start(self) -> Mailboxes:
        await super().start()
        self.boxes = engine_mailboxes([self.engine], self.transport)
        return self

    def subscribe(self, transport) -> None:
        self.handle = transport.remote_receiver(self, self.name)
        transport.subscribe(self.handle)

    async def ask(self, box: str, header: bytes) -> bytes | None:
        return await self.boxes[box](header, None) if self.up else None

    async def deliver(self, box: str, header: bytes, blob) -> None:
        if not self.up:
            raise ConnectionError(f"{self.name} is down")
        await self.boxes[box](header, blob)

    def receivers(self) -> list[Any]:
        return list({id(h.__self__): h.__self__ for h in self.boxes.values() if hasattr(h, "__self__")}.values())

    async def rejected(self) -> int:
        return sum(r.rejected for r in self.receivers())

    async def restart(self) -> None:
        for receiver in self.receivers():
            if hasattr(receiver, "close"):
                receiver.close()  # its TransferEngine memory goes with the old process
        await self.engine.stop()
        self.engine = TorchEngine(self.model, name=self.name)
        await self.start()


class Peer:
    """An engine process (tests/helpers/p2p_peer.py), reached through `transport.remote_receiver`."""

    def __init__(self, process: PeerProcess) -> None:
        self.process, self.name, self.handle = process, process.name, None

    def subscribe(self, transport) -> None:
        self.handle = transport.remote_receiver(self.process, self.name)
        transport.subscribe(self.handle)

    async def held(self) -> tuple[int, dict[str, int]]:
        version, _, got = await self.process.state()
        return version, got

    async def rejected(self) -> int:
        return (await self.process.state())[1]

    async def restart(self) -> None:
        await self.process.restart()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("transport-contract") / "tiny")


@pytest.fixture(scope="module")
def checkpoint(model) -> dict[str, int]:
    return digest(load_model(model).state_dict())


@pytest.fixture(scope="module")
def processes(model):
    """Two engine processes for the module (starting one takes seconds); each check restarts them."""
    started = [PeerProcess(model, f"engine-process-{i}") for i in range(2)]
    yield started
    for process in started:
        process.stop()


async def receivers(request, case: TransportCase, model: Path, local: int = 0, processes: int = 0,
                    direct: int = 0) -> list[Any]:
    """`direct` engines subscribed as themselves and `local` engine processes' mailboxes in this
    process (where the transport reaches engines here), and `processes` engine processes (where it
    reaches them: up to two, freshly restarted). A transport that reaches one kind only gets that kind."""
    if not case.local:
        processes, local, direct = processes + local + direct, 0, 0
    if not case.processes:
        local, processes = local + processes, 0
    made: list[Any] = [await Engine(model, f"engine-{i}").start() for i in range(direct)]
    made += [await Mailboxes(model, f"mailboxes-{i}", case.kind).start() for i in range(local)]
    if processes:
        for process in request.getfixturevalue("processes")[:processes]:
            await process.restart()
            made.append(Peer(process))
    return made


async def all_hold(receivers: list[Any], version: int, state: dict[str, int]) -> None:
    for receiver in receivers:
        assert await receiver.held() == (version, state), receiver.name


# ---------------------------------------------------------------- the checks


def test_every_built_in_transport_is_checked() -> None:
    assert sorted(case.kind for case in TRANSPORTS if case.kind != PLUGIN) == sorted(BUILT_IN)


@pytest.mark.parametrize("case", CASES)
def test_made_by_name_with_the_common_stats(case: TransportCase, tmp_path) -> None:
    transport = case.make(tmp_path)
    assert isinstance(transport, WeightTransport) and transport.name == (case.name or case.kind)
    assert transport.stats == dict.fromkeys(STATS, 0)


def test_every_engine_process_answers_every_built_in_transport_and_the_runs_own() -> None:
    """An engine process registers the receiver each transport declares: the built-ins', and a plug-in's
    when the run's transport is one (it reaches the process with the producer stage)."""
    built_in = engine_mailboxes([])
    with_plugin = engine_mailboxes([], PLUGIN)
    assert set(with_plugin) - set(built_in) == {"weights.plugin.safetensors"}
    with pytest.raises(ValueError, match="weights.transport.*known: inproc, mooncake_p2p, disk, delta, broadcast"):
        make_transport("no_such_transport")


@pytest.mark.slow
def test_a_plugin_transport_by_its_path_carries_a_quickstart_run(tmp_path) -> None:
    summary = baton_run(tmp_path, "quickstart.toml", "steps=20", "telemetry.progress=false",
                        f'weights.transport="{PLUGIN}"')
    assert summary["version"] == 20 and summary["ledger_balanced"]
    metrics = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    pushed = [m["weights"] for m in metrics if "weights" in m]
    assert sum(p["versions"] for p in pushed) == 20 and sum(p["refused"] for p in pushed) == 0
    assert all(p["bytes"] > p["state_bytes"] for p in pushed)  # a safetensors blob each: the tensors and a header


@pytest.mark.parametrize("case", ASKERS)
async def test_an_unreachable_receiver_is_counted_and_the_others_get_every_version(case, model, request,
                                                                                   tmp_path) -> None:
    """(Early in the module: what a transport started for the dead receiver, e.g. broadcast's
    rendezvous, may wait out its timeout in the background while the other checks run.)"""
    dead = PeerProcess(model, "dead")
    dead.stop()  # an engine process that is gone: its mailbox does not answer
    transport = case.make(tmp_path)
    transport.subscribe(transport.remote_receiver(dead, dead.name))  # first: it must not hold up the others
    live = await receivers(request, case, model, local=1, processes=1)
    for receiver in live:
        receiver.subscribe(transport)
    try:
        for version in (1, 2):
            state = learner_version(model, seed=version)
            with anyio.fail_after(HELD_UP_S):  # nor wait out a timeout of the transport's on its account
                await transport.publish(version, state)  # does not raise: one engine down must not stop the run
            await all_hold(live, version, digest(state))
        assert transport.stats["unreachable"] == 2 and transport.stats["versions"] == 2
    finally:
        await transport.close()


@pytest.mark.parametrize("case", CASES)
async def test_publish_delivers_each_version_whole_to_every_receiver(case, model, request, tmp_path) -> None:
    subscribed = await receivers(request, case, model, direct=2, local=1, processes=2)
    transport = case.make(tmp_path)
    for receiver in subscribed:
        receiver.subscribe(transport)
    try:
        for version in (1, 2, 3):  # a double-buffered receiver uses both of its slots, then the first again
            state = learner_version(model, seed=version)
            published = digest(state)
            await transport.publish(version, state)
            with torch.no_grad():  # the learner trains on, in place: what was published stays
                for tensor in state.values():
                    tensor.add_(1.0)
            await all_hold(subscribed, version, published)
    finally:
        await transport.close()
    stats = transport.stats
    assert stats["versions"] == 3 and stats["state_bytes"] == 3 * state_bytes(state)
    assert stats["bytes"] > 0 and stats["refused"] == stats["unreachable"] == 0


@pytest.mark.parametrize("case", CASES)
async def test_versions_must_increase(case, model, request, tmp_path) -> None:
    subscribed = await receivers(request, case, model, direct=1)
    transport = case.make(tmp_path)
    subscribed[0].subscribe(transport)
    first, second = learner_version(model, seed=1), learner_version(model, seed=2)
    try:
        await transport.publish(1, first)
        for bad in (1, 0):
            with pytest.raises(WeightPushError, match="must increase"):
                await transport.publish(bad, second)
        await all_hold(subscribed, 1, digest(first))
        assert transport.stats["versions"] == 1
        await transport.publish(2, second)  # a publish that raised published nothing: the next one goes
        await all_hold(subscribed, 2, digest(second))
    finally:
        await transport.close()


@pytest.mark.parametrize("case", CASES)
async def test_an_adapter_version_moves_like_any_other(case, model, request, tmp_path) -> None:
    subscribed = await receivers(request, case, model, direct=1, local=1, processes=1)
    transport = case.make(tmp_path)
    for receiver in subscribed:
        receiver.subscribe(transport)
    base = load_model(model).state_dict()
    try:
        for version in (1, 2):  # each merged into the base, not on top of the previous one
            published = adapter_version(peft_policy(model, seed=version), model)
            spec, tensors = unpack_adapter(published)
            merged = {**base, **merged_weights(base, spec, adapter_pairs(spec, tensors, {n: tuple(t.shape)
                                                                                         for n, t in base.items()}))}
            await transport.publish(version, published)
            await all_hold(subscribed, version, digest(merged))
    finally:
        await transport.close()
    assert transport.stats["state_bytes"] < 0.25 * 2 * state_bytes(base)  # the adapters' bytes, not the model's


@pytest.mark.parametrize("case", MOVES_BYTES)
async def test_bytes_damaged_in_flight_are_refused_and_receivers_keep_their_version(case, model, request,
                                                                                    tmp_path) -> None:
    subscribed = (await receivers(request, case, model, local=1, processes=1))[::-1]  # an engine process first
    transport = case.make(tmp_path)
    for receiver in subscribed:
        receiver.subscribe(transport)
    attempts = transport.retries + 1
    first = learner_version(model, seed=1)
    try:
        await transport.publish(1, first)
        case.damage(transport, every_send)
        with pytest.raises(WeightPushError, match="checksum"):
            await transport.publish(2, learner_version(model, seed=2))
        await all_hold(subscribed, 1, digest(first))  # untouched by the damaged version
        assert transport.stats["refused"] == attempts and await subscribed[0].rejected() == attempts
        if case.resends_bytes:
            case.damage(transport, first_send)
            third = learner_version(model, seed=3)
            await transport.publish(3, third)  # damaged once, refused, sent again: applied
            await all_hold(subscribed, 3, digest(third))
            assert transport.stats["refused"] == attempts + 1 and await subscribed[0].rejected() == attempts + 1
    finally:
        await transport.close()


@pytest.mark.parametrize("case", LOCAL)
async def test_a_version_an_engine_will_not_take_is_refused_and_it_keeps_its_own(case, model, tmp_path) -> None:
    """A version that does not fit the engine (a tensor missing) is refused by it (EngineError): the engine
    keeps the version it runs on (also while the next versions arrive), the push fails, counted, and a
    version that fits goes through."""
    engine = await Engine(model, "engine").start()
    transport = case.make(tmp_path)
    engine.subscribe(transport)
    first, third = learner_version(model, seed=1), learner_version(model, seed=3)
    misfit = learner_version(model, seed=2)
    del misfit["model.layers.0.mlp.up_proj.weight"]
    try:
        await transport.publish(1, first)
        with pytest.raises(WeightPushError, match="do not fit"):
            await transport.publish(2, misfit)
        assert await engine.held() == (1, digest(first))
        assert transport.stats["refused"] >= 1 and transport.stats["versions"] == 1
        if case.damage is not None:  # and what arrives next never lands in the weights it runs on
            case.damage(transport, every_send)
            with pytest.raises(WeightPushError):
                await transport.publish(3, learner_version(model, seed=4))
            assert await engine.held() == (1, digest(first))
            case.damage(transport, no_send)
        await transport.publish(4, third)
        assert await engine.held() == (4, digest(third))
    finally:
        await transport.close()


@pytest.mark.parametrize("case", CASES)
async def test_a_push_the_fault_plan_refuses_is_retried_then_surfaced(case, model, request, tmp_path) -> None:
    subscribed = await receivers(request, case, model, direct=1)
    first = learner_version(model, seed=1)
    once = with_weight_faults(case.make(tmp_path / "once"), FaultPlan([FaultSpec("weights.push_fail", at=(1,))]))
    always = with_weight_faults(case.make(tmp_path / "always"),
                                FaultPlan([FaultSpec("weights.push_fail", at=(1, 2, 3))]), retries=2)
    for transport in (once, always):
        subscribed[0].subscribe(transport)
    try:
        await once.publish(1, first)  # refused once, retried: delivered
        await all_hold(subscribed, 1, digest(first))
        with pytest.raises(WeightPushError, match="refused"):
            await always.publish(2, learner_version(model, seed=2))
        await all_hold(subscribed, 1, digest(first))  # nothing delivered, and the push did not claim it was
        assert always.stats["versions"] == 0
    finally:
        await once.close()
        await always.close()


@pytest.mark.parametrize("case", CASES)
async def test_resend_catches_up_a_receiver_that_lost_or_missed_versions(case, model, checkpoint, request,
                                                                         tmp_path) -> None:
    stays, back = await receivers(request, case, model, local=2)
    transport = case.make(tmp_path)
    for receiver in (stays, back):
        receiver.subscribe(transport)
    states = {v: learner_version(model, seed=v) for v in (1, 2, 3, 4)}
    try:
        for version in (1, 2):
            await transport.publish(version, states[version])
        await back.restart()  # a new process: it holds its checkpoint again
        assert await back.held() == (0, checkpoint)
        await transport.resend(back.handle)
        await all_hold([stays, back], 2, digest(states[2]))
        assert (transport.stats["resent"], transport.stats["deferred"]) == (1, 0)
        await transport.publish(3, states[3])  # and it is in the flow again
        await all_hold([stays, back], 3, digest(states[3]))
        if isinstance(back, Mailboxes) and case.askers:  # a receiver that did not answer for a while
            back.up = False
            await transport.publish(4, states[4])
            assert transport.stats["unreachable"] == 1 and await back.held() == (3, digest(states[3]))
            back.up = True
            await transport.resend(back.handle)
            await all_hold([stays, back], 4, digest(states[4]))
            assert transport.stats["resent"] == 2
    finally:
        await transport.close()
