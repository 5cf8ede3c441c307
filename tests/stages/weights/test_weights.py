"""Weight layout (pure), packed versions and snapshots, and what the byte-moving transports do beyond the
transport contract (tests/contracts/test_transport_contract.py): the engine running on its receive slot,
engines killed after their session began, disk's kept files, delta's bytes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from stages.data.model import make_tiny_model
from stages.weights.layout import LayoutError, bad_buckets, decode_layout, encode_layout, fill, plan, views
from tests.helpers.p2p_peer import PeerProcess, digest, learner_version

ROOT = Path(__file__).resolve().parents[3]


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(3, 5, generator=g),
        "b": torch.randn(1000, generator=g).to(torch.bfloat16),
        "c": torch.randint(0, 9, (7,), generator=g),
        "d": torch.randn(64, 64, generator=g),
    }


# ---------------------------------------------------------------- layout (no I/O)


@pytest.mark.parametrize("bucket_bytes", [1, 100, 4096, 1 << 30])
def test_layout_round_trip_is_bit_exact(bucket_bytes: int) -> None:
    src = tensors()
    layout = plan(7, src, bucket_bytes)
    buffer = np.full(layout.total, 0xAB, dtype=np.uint8)
    layout = fill(buffer, src, layout)
    assert all(e.offset % 64 == 0 for e in layout.tensors)
    assert bad_buckets(buffer, layout) == []
    out = views(buffer, decode_layout(encode_layout(layout)))
    for name, t in src.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t)
    if bucket_bytes == 1:
        assert len(layout.buckets) == len(src)  # every tensor its own bucket when they exceed the size


def test_a_flipped_byte_is_found_in_its_bucket() -> None:
    src = tensors()
    layout = plan(1, src, bucket_bytes=4096)
    buffer = np.zeros(layout.total, dtype=np.uint8)
    layout = fill(buffer, src, layout)
    target = layout.tensors[3]  # "d", 16 KiB: a bucket of its own
    buffer[target.offset + 100] ^= 0x01
    bad = bad_buckets(buffer, layout)
    assert len(bad) == 1
    b = layout.buckets[bad[0]]
    assert b.offset <= target.offset + 100 < b.offset + b.nbytes


@pytest.mark.parametrize(
    "damage",
    [
        lambda lay: msgspec.structs.replace(lay, total=lay.total - 64),  # an entry past the end
        lambda lay: msgspec.structs.replace(lay, buckets=lay.buckets[:-1]),  # a tensor no bucket covers
        lambda lay: msgspec.structs.replace(lay, tensors=(msgspec.structs.replace(lay.tensors[0], dtype="object"),)),
        lambda lay: msgspec.structs.replace(lay, tensors=(msgspec.structs.replace(lay.tensors[0], shape=(4, 5)),)),
    ],
)
def test_a_layout_from_another_process_is_validated(damage) -> None:
    layout = plan(1, tensors(), bucket_bytes=4096)
    with pytest.raises(LayoutError):
        decode_layout(encode_layout(damage(layout)))
    with pytest.raises(LayoutError):
        decode_layout(b"\x93not a layout")


def test_packed_weights_round_trip_and_refuse_damage() -> None:
    from stages.weights.packed import WeightPayloadError, pack, unpack

    src = tensors()
    header, blob = pack(4, src, bucket_bytes=4096)
    version, out = unpack(header, blob)
    assert version == 4 and all(torch.equal(out[n], t) for n, t in src.items())
    blob[-1] ^= 0x10
    with pytest.raises(WeightPayloadError, match="checksum"):
        unpack(header, blob)
    with pytest.raises(WeightPayloadError, match="bytes"):
        unpack(header, blob[:-64])


# ---------------------------------------------------------------- across processes


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("p2p") / "tiny")


@pytest.fixture
def peers(model):
    started = [PeerProcess(model, f"engine-{i}") for i in range(2)]
    yield started
    for p in started:
        p.stop()


@pytest.mark.anyio
async def test_the_engine_runs_on_the_slot_and_the_live_slot_is_never_written(model) -> None:
    """Zero-copy apply: the committed slot becomes the engine's weights; the next version goes to
    the other slot, also after the learner had to say hello again (e.g. after a failed write) and
    after a re-send the engine answered with "already applied"."""
    from stages.engines.torch import TorchEngine
    from stages.weights.mooncake_p2p import MooncakeP2PTransport

    engine = TorchEngine(model, name="local")
    await engine.start()
    transport = MooncakeP2PTransport(bucket_bytes=64 << 10)
    transport.subscribe(engine)
    receiver = transport._targets[0].asker.receiver
    live_slots = []
    try:
        for version in (1, 2, 3):
            if version == 2:
                transport._targets[0].slots = ()  # forget the slots: hello again
            if version == 3:  # the version it holds, re-sent (as after a restart was suspected)
                await transport.resend(transport._targets[0].asker)
            state = learner_version(model, seed=version)
            await transport.publish(version, state)
            live = receiver.slots.slots[receiver.slots.live]
            lo, hi = live.data_ptr(), live.data_ptr() + live.nbytes
            assert all(lo <= p.data_ptr() < hi for p in engine._model.parameters())  # the slot is the weights
            assert digest(engine._model.state_dict()) == digest(state)
            live_slots.append(receiver.slots.live)
    finally:
        await transport.close()
    assert live_slots == [0, 1, 0] and receiver.rejected == 0 and transport.stats["copied"] == 0


@pytest.mark.anyio
@pytest.mark.long  # CI time: in the long suite
async def test_a_dead_engine_is_skipped_and_the_others_still_get_every_version(model, peers) -> None:
    from stages.weights.mooncake_p2p import MooncakeP2PTransport

    transport = MooncakeP2PTransport(bucket_bytes=64 << 10)
    for peer in peers:
        transport.subscribe(peer)
    await transport.publish(1, learner_version(model, seed=1))
    peers[0].stop()  # SIGKILL: its process and its receive slots are gone
    state = learner_version(model, seed=2)
    await transport.publish(2, state)  # does not raise: one engine down must not stop the run
    assert transport.stats["unreachable"] == 1
    version, _, got = await peers[1].state()
    assert version == 2 and got == digest(state)
    await transport.close()


# ---------------------------------------------------------------- disk


@pytest.mark.anyio
async def test_disk_keeps_only_the_newest_files(model, tmp_path) -> None:
    """(Delivery, damage, dead engines: tests/contracts/test_transport_contract.py.)"""
    from stages.engines.torch import TorchEngine
    from stages.weights.disk import DiskTransport

    engine = TorchEngine(model, name="local")
    await engine.start()
    transport = DiskTransport(root=tmp_path / "weights", keep=2)
    transport.subscribe(engine)
    for version in (1, 2, 3):
        await transport.publish(version, learner_version(model, seed=version))
        assert engine.version == version
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v00000002", "v00000003"]


def test_transports_are_made_by_name_with_their_options() -> None:
    """(Each one's type, name and stats: tests/contracts/test_transport_contract.py.)"""
    from stages.weights import make_transport

    assert make_transport("disk", keep=5).keep == 5
    with pytest.raises(ValueError, match="known: inproc, mooncake_p2p, disk, delta, broadcast"):
        make_transport("carrier-pigeon")
    lazy = "import sys, stages.weights; assert 'torch' not in sys.modules, 'importing stages.weights imported torch'"
    subprocess.run([sys.executable, "-c", lazy], cwd=ROOT, check=True)


# ---------------------------------------------------------------- delta


@pytest.mark.anyio
async def test_delta_sends_only_what_changed_and_rebuilds_the_exact_state(model, peers) -> None:
    from stages.weights.delta import DeltaTransport

    transport = DeltaTransport()
    transport.subscribe(peers[0])
    state = learner_version(model, seed=1)
    await transport.publish(1, state)  # the first version: the whole state
    full = transport.stats["bytes"]
    frozen = {n: t.clone() for n, t in state.items()}
    trained = [n for n in frozen if ".self_attn.q_proj." in n]  # only these move (a frozen rest)
    for n in trained:
        frozen[n] += 0.5
    await transport.publish(2, frozen)
    assert 0 < transport.stats["bytes"] - full < full / 2
    version, rejected, got = await peers[0].state()
    assert (version, rejected) == (2, 0) and got == digest(frozen)

    transport.subscribe(peers[1])  # a new engine holds no base: refuses the delta, gets the whole state
    frozen[trained[0]] -= 0.25
    await transport.publish(3, frozen)
    assert transport.stats["full_sends"] == 1
    for peer in peers:
        version, _, got = await peer.state()
        assert version == 3 and got == digest(frozen)


@pytest.mark.anyio
async def test_a_restarted_delta_receiver_is_caught_up_with_the_whole_state_at_once() -> None:
    from stages.weights.base import LocalAsker
    from stages.weights.delta import DeltaReceiver, DeltaTransport

    class Sink:
        name, got = "sink", None

        async def receive_weights(self, version, state) -> None:
            self.got = version, state

    transport, sink = DeltaTransport(retries=0), Sink()
    asker = LocalAsker(DeltaReceiver([sink]), "engine-0")
    transport.subscribe(asker)
    await transport.publish(1, tensors(1))
    await transport.publish(2, tensors(2))
    asker.receiver = DeltaReceiver([sink])  # its process restarted: it holds no base
    await transport.resend(asker)  # one attempt, and it must not be a delta it would refuse
    assert sink.got[0] == 2 and all(torch.equal(sink.got[1][n], t) for n, t in tensors(2).items())
    assert (transport.stats["resent"], transport.stats["full_sends"], transport.stats["refused"]) == (1, 1, 0)


@pytest.mark.anyio
async def test_producer_processes_that_join_and_leave_are_subscribed_and_unsubscribed() -> None:
    """`subscribe_producers` (the learner on Ray): a producer process added to the roster gets every later
    version, one removed gets none after its removal, and the receivers by name follow (a restart's resend)."""
    from pipeline.roster import Roster
    from stages.weights.base import LocalAsker, subscribe_producers
    from stages.weights.delta import DeltaReceiver, DeltaTransport

    class Sink:
        def __init__(self) -> None:
            self.name, self.versions = "sink", []

        async def receive_weights(self, version, state) -> None:
            self.versions.append(version)

    sinks = [Sink(), Sink()]
    peers = [LocalAsker(DeltaReceiver([sink]), f"producer-{i}") for i, sink in enumerate(sinks)]
    roster, transport = Roster([peers[0]]), DeltaTransport(retries=0)
    receivers = subscribe_producers(transport, roster)
    await transport.publish(1, tensors(1))
    roster.add(peers[1])  # a producer process joins
    assert sorted(receivers) == ["producer-0", "producer-1"]
    await transport.publish(2, tensors(2))
    roster.remove(peers[0])  # one leaves: nothing more is sent to it
    await transport.publish(3, tensors(3))
    assert sinks[0].versions == [1, 2] and sinks[1].versions == [2, 3]
    assert list(receivers) == ["producer-1"]


# ---------------------------------------------------------------- broadcast


@pytest.mark.anyio
@pytest.mark.long  # CI time: in the long suite
async def test_broadcast_skips_an_engine_that_died_in_its_group(model, peers) -> None:
    """An engine process killed after its group formed breaks only its own group. (Delivery, damage and
    an engine that never answers: tests/contracts/test_transport_contract.py.)"""
    from stages.weights.broadcast import BroadcastTransport

    transport = BroadcastTransport(retries=1, timeout_s=30)
    for peer in peers:
        transport.subscribe(peer)
    await transport.publish(1, learner_version(model, seed=1))
    peers[0].stop()  # its group breaks; the run goes on with the other engine
    state = learner_version(model, seed=2)
    await transport.publish(2, state)
    assert transport.stats["unreachable"] >= 1
    version, _, got = await peers[1].state()
    assert version == 2 and got == digest(state)
    await transport.close()


# ---------------------------------------------------------------- snapshots


def test_a_snapshot_round_trips_and_refuses_damage() -> None:
    from stages.weights.packed import WeightPayloadError
    from stages.weights.snapshot import decode_snapshot, encode_snapshot

    src = tensors()
    data = encode_snapshot(9, src)
    version, out = decode_snapshot(data)
    assert version == 9 and all(torch.equal(out[n], t) for n, t in src.items())
    for damaged in (data[:5], data[:-64], np.concatenate([np.full(8, 255, np.uint8), data[8:]])):
        with pytest.raises(WeightPayloadError):
            decode_snapshot(damaged)
    flipped = data.copy()
    flipped[-1] ^= 1
    with pytest.raises(WeightPayloadError, match="checksum"):
        decode_snapshot(flipped)


@pytest.mark.anyio
async def test_a_restarted_engine_catches_up_from_the_snapshot_in_mooncake(model, mooncake_master, tmp_path) -> None:
    """No learner push: the new engine's worker reads the latest version from Mooncake Store on start."""
    from types import SimpleNamespace

    from buffers.mooncake import MooncakeSettings, MooncakeStore
    from pipeline.telemetry import get_logger
    from stages.data.tasks import ReverseDigits
    from stages.engines.torch import TorchEngine
    from stages.rollout import Rollout, RolloutWorker
    from stages.weights.snapshot import load_snapshot, save_snapshot, snapshot_key

    store = MooncakeStore(MooncakeSettings(master_server_address=mooncake_master.address, global_segment_size=64 << 20))
    run_folder = SimpleNamespace(path=tmp_path / "snap-run-20261129-000000")
    key = snapshot_key("snap-run", run_folder.path.name)
    try:
        assert await load_snapshot(store, key) is None  # nothing saved yet: the engine keeps its checkpoint
        state = learner_version(model, seed=7)
        await save_snapshot(store, key, 12, state)
        from pipeline.context import LocalClock
        from pipeline.contracts import Services
        from pipeline.versions import VersionClock

        def worker_at(clock_version: int, name: str) -> tuple[TorchEngine, RolloutWorker]:
            engine = TorchEngine(model, name=name)
            ctx = SimpleNamespace(
                run="snap-run", folder=run_folder, rng=lambda name: np.random.default_rng(0),
                log=lambda name: get_logger(name), services=Services(), resume=None,
                clock=LocalClock(VersionClock(clock_version)),
            )
            return engine, Rollout(ReverseDigits(), [engine], tokenizer=model).worker(engine, store, ctx, None)

        engine, worker = worker_at(12, "restarted")
        await worker.start()
        engine._apply_staged()
        assert engine.version == 12
        assert digest(engine._model.state_dict()) == digest(state)
        await worker.stop()
        # a resumed run's clock is behind a snapshot the crashed attempt wrote: that version was rolled back
        engine, worker = worker_at(8, "resumed")
        await worker.start()
        assert engine.version == 0, "a snapshot newer than the clock is never adopted"
        await worker.stop()
    finally:
        await store.remove(key)
        await store.close()
