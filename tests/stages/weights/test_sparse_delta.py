"""Element-level weight deltas (`stages.weights.sparse`): bit-exact rebuilds in both receive slots,
the form chosen per bucket, and the whole state for a receiver whose base is lost, new or damaged;
through `delta` (mailbox messages) and `mooncake_p2p` (TransferEngine writes, sparse=True)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from stages.weights.base import LocalAsker, WeightPushError
from stages.weights.layout import LayoutError, plan
from stages.weights.sparse import BITMASK, FULL, INDEX, Patch, Slots, Versions, diff

ROOT = Path(__file__).resolve().parents[3]


def learner_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 master weights (what a learner holds), values of a random-init model."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(300, 64, generator=g) * 0.02,
        "norm.weight": torch.ones(64),
        "proj.bias": torch.zeros(64),
        "step": torch.tensor([seed], dtype=torch.int64),
    }


def train(state: dict[str, torch.Tensor], seed: int, lr: float = 1e-5) -> dict[str, torch.Tensor]:
    """One AdamW-like step: every floating value moves by about `lr`."""
    g = torch.Generator().manual_seed(100 + seed)
    return {n: t + lr * torch.randn(t.shape, generator=g).sign() if t.is_floating_point() else t + 1
            for n, t in state.items()}


def as_engine(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in state.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]) for n in a)


class Sink:
    """An engine in this process: runs on what it was handed (views over a receive slot)."""

    name = "sink"

    def __init__(self) -> None:
        self.version, self.tensors = -1, {}

    async def receive_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self.version, self.tensors = version, tensors


class Switch:
    """An `Asker` whose process can be made unreachable (None replies) and back."""

    def __init__(self, asker) -> None:
        self.asker, self.name, self.down = asker, asker.name, False

    async def ask(self, box: str, header: bytes) -> bytes | None:
        return None if self.down else await self.asker.ask(box, header)


# ---------------------------------------------------------------- forms (no transport)


def packed(tensors: dict[str, torch.Tensor], bucket_bytes: int = 1 << 20) -> tuple:
    versions = Versions()
    layout = plan(1, tensors, bucket_bytes)
    buffer = versions.add(1, tensors, layout).copy()
    return versions.layout, buffer


@pytest.mark.parametrize(("changed", "form"), [(3, INDEX), (9000, BITMASK), (32768, FULL)])
def test_the_cheapest_form_is_chosen_and_rebuilds_bit_exact(changed: int, form: str) -> None:
    g = torch.Generator().manual_seed(0)
    old = {"w": torch.randn(32768, generator=g).to(torch.bfloat16)}
    new = {"w": old["w"].clone()}
    where = torch.randperm(32768, generator=g)[:changed]
    new["w"][where] += 1.0
    layout, base = packed(old)
    layout_new, target = packed(new)
    patch, pieces = diff(layout_new, target, base, base_version=1, source=0)
    (part,) = patch.parts
    assert part.form == form and part.changed == int((new["w"] != old["w"]).sum())
    nbytes = sum(p.nbytes for p in pieces)
    assert nbytes <= layout.total and (form != INDEX or nbytes <= changed * 3 + 32768 // 255)  # gaps: 1 byte per 255
    slots = Slots([base.copy(), np.zeros_like(base)])
    slots.holds = [1, -1]
    rebuilt = slots.rebuild(0, layout_new, patch, np.concatenate(pieces))
    assert np.array_equal(rebuilt, target) and slots.holds == [layout_new.version, -1]


@pytest.mark.parametrize("cut", ["index", "bitmask"])
def test_a_damaged_patch_is_refused_and_the_slot_holds_nothing_known(cut: str) -> None:
    g = torch.Generator().manual_seed(1)
    old = {"w": torch.randn(4096, generator=g).to(torch.bfloat16)}
    new = {"w": old["w"] + (0.5 if cut == "bitmask" else 0.0)}
    new["w"][:2] += 1.0
    layout, base = packed(old)
    _, target = packed(new)
    patch, pieces = diff(layout, target, base, base_version=1, source=0)
    payload = np.concatenate(pieces)
    payload[0] ^= 0x5A  # the first index gap, or the first bitmask byte
    slots = Slots([base.copy(), np.zeros_like(base)])
    slots.holds = [1, -1]
    with pytest.raises(LayoutError):
        slots.rebuild(0, layout, patch, payload)
    assert slots.holds == [-1, -1]
    with pytest.raises(LayoutError, match="holds -1"):  # and no delta applies to it any more
        slots.rebuild(0, layout, patch, np.concatenate(pieces))


# ---------------------------------------------------------------- delta (mailbox)


def delta_pair(**options):
    from stages.weights.delta import DeltaReceiver, DeltaTransport

    transport, sink = DeltaTransport(engine_dtype="bfloat16", bucket_bytes=16 << 10, **options), Sink()
    asker = LocalAsker(DeltaReceiver([sink]), "engine-0")
    transport.subscribe(asker)
    return transport, sink, asker


@pytest.mark.anyio
async def test_delta_rebuilds_every_version_bit_exact_in_both_slots() -> None:
    transport, sink, asker = delta_pair()
    state, live, sent = learner_state(), [], []
    for version in range(1, 7):
        state = train(state, version, lr=1e-6 if version < 4 else 1e-3)
        before = transport.stats["bytes"]
        await transport.publish(version, state)
        assert sink.version == version and same(sink.tensors, as_engine(state))
        live.append(asker.receiver.slots.live)
        sent.append(transport.stats["bytes"] - before)
    s = transport.stats
    assert live == [0, 1, 0, 1, 0, 1]
    assert s["full_sends"] == 0 and s["refused"] == 0  # one whole state (the first version), then deltas
    assert 0 < s["changed"] < s["elements"] and s["bytes"] < s["full_bytes"]
    assert max(sent[1:3]) < sent[0] / 4  # at lr 1e-6 most bf16 values do not move
    assert s["buckets_index"] > 0 and s["buckets_full"] > 0


@pytest.mark.anyio
async def test_a_receiver_that_lost_its_base_refuses_and_gets_the_whole_state() -> None:
    transport, sink, asker = delta_pair(retries=0)
    state = learner_state()
    for version in (1, 2, 3):
        state = train(state, version)
        await transport.publish(version, state)
    asker.receiver.slots.holds = [-1, -1]  # its slots' bytes are no longer a known version
    with pytest.raises(WeightPushError, match="holds -1"):
        await transport.publish(4, train(state, 4))
    assert sink.version == 3 and same(sink.tensors, as_engine(state))  # it keeps its version
    transport.retries = 1
    state = train(state, 5)
    await transport.publish(5, state)  # its refusal said it holds nothing: the whole state at once
    assert sink.version == 5 and same(sink.tensors, as_engine(state))
    s = transport.stats
    assert (s["refused"], s["full_sends"], s["fallback_new"], asker.receiver.rejected) == (1, 1, 1, 1)


@pytest.mark.anyio
async def test_a_restarted_delta_receiver_gets_the_whole_state_then_deltas() -> None:
    from stages.weights.delta import DeltaReceiver

    transport, sink, asker = delta_pair()
    state = learner_state()
    for version in (1, 2):
        state = train(state, version)
        await transport.publish(version, state)
    asker.receiver = DeltaReceiver([sink])  # its process restarted: it holds nothing
    await transport.resend(asker)
    assert same(sink.tensors, as_engine(state))
    bytes_before = transport.stats["bytes"]
    state = train(state, 3)
    await transport.publish(3, state)
    s = transport.stats
    assert (s["resent"], s["full_sends"], s["fallback_new"], s["refused"]) == (1, 1, 1, 0)
    assert s["bytes"] - bytes_before < s["full_bytes"] / s["versions"] / 2  # a delta again
    assert same(sink.tensors, as_engine(state))


# ---------------------------------------------------------------- mooncake_p2p (TransferEngine)


def p2p_pair(**options):
    from stages.weights.mooncake_p2p import MooncakeP2PTransport, SlotReceiver

    transport = MooncakeP2PTransport(engine_dtype="bfloat16", sparse=True, bucket_bytes=16 << 10, **options)
    sink = Sink()
    switch = Switch(LocalAsker(SlotReceiver([sink]), "engine-0"))
    transport.subscribe(switch)
    return transport, sink, switch


@pytest.mark.anyio
async def test_p2p_sparse_pushes_are_bit_exact_and_a_lost_base_gets_the_whole_state() -> None:
    transport, sink, switch = p2p_pair()
    state = learner_state()
    try:
        for version in (1, 2, 3):
            state = train(state, version, lr=1e-6)
            await transport.publish(version, state)
            assert sink.version == version and same(sink.tensors, as_engine(state))
        assert transport.stats["bytes"] < transport.stats["full_bytes"] * 0.6
        switch.down = True  # unreachable while the learner moves on past what its slots hold
        for version in (4, 5, 6):
            state = train(state, version, lr=1e-6)
            await transport.publish(version, state)
        switch.down = False
        state = train(state, 7, lr=1e-6)
        await transport.publish(7, state)  # its hello says it holds 3 and 2: no longer kept
        assert sink.version == 7 and same(sink.tensors, as_engine(state))
        s = transport.stats
        assert (s["unreachable"], s["full_sends"], s["fallback_lost"], s["refused"]) == (3, 1, 1, 0)
    finally:
        await transport.close()


@pytest.mark.anyio
async def test_p2p_a_damaged_delta_is_refused_then_the_whole_state_is_sent() -> None:
    transport, sink, switch = p2p_pair(retries=0)
    state = learner_state()
    try:
        for version in (1, 2):
            state = train(state, version)
            await transport.publish(version, state)
        transport.damage = lambda layout, attempt: (0, b"\xff" * 8)  # the delta's payload arrives wrong
        with pytest.raises(WeightPushError):
            await transport.publish(3, train(state, 3))
        assert sink.version == 2 and same(sink.tensors, as_engine(state))  # it keeps its version
        transport.retries = 1
        transport.damage = lambda layout, attempt: (0, b"\xff" * 8) if attempt == 0 else None
        state = train(state, 4)
        await transport.publish(4, state)
        assert sink.version == 4 and same(sink.tensors, as_engine(state))
        s = transport.stats
        assert (s["refused"], s["full_sends"], s["fallback_refused"]) == (2, 1, 1)
    finally:
        await transport.close()


def test_a_patch_crosses_processes_as_msgpack() -> None:
    layout, base = packed({"w": torch.zeros(1000, dtype=torch.bfloat16)})
    patch, _ = diff(layout, base, base, base_version=4, source=1)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(patch), type=Patch) == patch


# ---------------------------------------------------------------- the quickstart


@pytest.mark.nightly  # two runs of the quickstart: 42 s
def test_the_quickstart_learns_with_sparse_deltas_as_with_full_pushes(tmp_path: Path) -> None:
    def run(transport: str) -> dict:
        out = tmp_path / transport
        # seed 1: seed 0's sync run happens to learn little in its first 60 versions with these defaults
        sets = [f"run_root='{out}'", f"model.path='{tmp_path / 'model'}'", "steps=60", "seed=1"]
        sets.append(f"weights.transport='{transport}'")
        proc = subprocess.run(
            [sys.executable, "-m", "baton.cli", "run", str(ROOT / "configs" / "quickstart-sync.toml"),
             *[x for s in sets for x in ("--set", s)]],
            capture_output=True, text=True, cwd=ROOT, timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    full, sparse = run("inproc"), run("delta")
    assert sparse["reward_end"] >= sparse["reward_start"] + 0.15, sparse
    assert sparse["reward_end"] == pytest.approx(full["reward_end"], abs=0.05), (full, sparse)
    metrics = [json.loads(line) for line in (Path(sparse["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:  # each version's counters (lr 3e-3 on fp32 engines: most elements move)
        w = m["weights"]
        assert w["versions"] == 1 and 0 <= w["bytes"] <= w["full_bytes"] > 0 and w["changed"] <= w["elements"]


@pytest.mark.anyio
async def test_a_torch_engine_runs_on_slots_rebuilt_from_sparse_deltas(tmp_path: Path) -> None:
    """The engine's parameters are views over the slot each delta rebuilt, bit-exact with the learner's."""
    from stages.data.model import load_model, make_tiny_model
    from stages.engines.torch import TorchEngine
    from stages.weights.mooncake_p2p import MooncakeP2PTransport

    path = make_tiny_model(tmp_path / "tiny")
    engine = TorchEngine(path, name="local")
    await engine.start()
    transport = MooncakeP2PTransport(sparse=True, bucket_bytes=64 << 10)
    transport.subscribe(engine)
    receiver = transport._targets[0].asker.receiver
    learner = load_model(path)
    try:
        for version in (1, 2, 3, 4):
            with torch.no_grad():
                for i, p in enumerate(learner.parameters()):
                    if i % 3 == version % 3:  # a third of the tensors move each version
                        p.add_(torch.randn_like(p) * 1e-3)
            state = learner.state_dict()
            await transport.publish(version, state)
            live = receiver.slots.slots[receiver.slots.live]
            lo, hi = live.data_ptr(), live.data_ptr() + live.nbytes
            assert all(lo <= p.data_ptr() < hi for p in engine._model.parameters())
            got = engine._model.state_dict()
            assert all(torch.equal(got[n], t) for n, t in state.items() if n in got)
    finally:
        await transport.close()
    s = transport.stats
    assert s["full_sends"] == 0 and s["bytes"] < s["full_bytes"] * 0.8 and receiver.rejected == 0
