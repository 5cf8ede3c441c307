"""A `Service` over a tiny model whose journal is compacted after every call, then a second one recovered over
its state folder (no HTTP, no SDK: what `baton serve` does before it serves): the session, the model at its
committed step, the results still kept and the seq_ids already taken all come back. Every step commits here
(`commit_every_s=0`); the kill test (`test_kill_and_restart`) runs the default interval, where a restart runs the
steps after the last commit again."""

from __future__ import annotations

import pytest

from stages.data.model import make_tiny_model
from stages.service.futures import call_id
from stages.service.journal import CallRecord, read_journal
from stages.service.recovery import recover
from stages.service.refusals import Refused
from stages.service.service import Service

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_compacted_journal_brings_the_service_back(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("stages.service.service.COMPACT_BYTES", 0)  # compact after every call
    model = make_tiny_model(tmp_path / "tiny")
    state = tmp_path / "state"
    first = Service(model, tmp_path / "checkpoints", state, commit_every_s=0)
    first._compact_at = 0
    session = first.create_session()
    model_id = f"{session}:train:0"
    await first.futures.result(first.create_model({"session_id": session, "model_seq_id": 0, "base_model": str(
        model), "lora_config": {"rank": 2}}))
    for seq in (1, 2, 3):
        step = first.optim_step({"model_id": model_id, "seq_id": seq, "adam_params": {"learning_rate": 1e-3}})
        assert (await first.futures.result(step))["metrics"]["learning_rate:mean"] == 1e-3
    assert first.models[model_id].steps == 3
    # compacted: no committed call's body is left, only the call that made the model
    assert [r.seq for r in read_journal(state) if isinstance(r, CallRecord)] == [0]
    await first.close()

    second = Service(model, tmp_path / "checkpoints", state, commit_every_s=0)
    back = await recover(second)
    assert back == {"sessions": 1, "samplers": 0, "models": 1, "results": 3, "rerun": 0}
    assert (await second.info(model_id))["lora_rank"] == 2  # waits for the model to be made again
    assert (await second.futures.result(call_id(model_id, 0)))["model_id"] == model_id
    assert second.models[model_id].steps == 3
    assert (await second.futures.result(call_id(model_id, 2)))["metrics"]["learning_rate:mean"] == 1e-3
    retried = {"model_id": model_id, "seq_id": 3, "adam_params": {"learning_rate": 1e-3}}
    assert second.optim_step(retried) == call_id(model_id, 3)  # a retry across the restart: not applied again
    second.futures._tasks.pop(call_id(model_id, 3))  # as if its result were forgotten: still refused
    with pytest.raises(Refused, match="seq_id 3 .* was accepted before"):
        second.optim_step(retried)
    assert second.create_session() == "session-2"
    await second.close()


@pytest.mark.parametrize("lora", [{"rank": 2}, None], ids=["lora", "full"])
async def test_a_model_and_its_sampler_come_back_with_the_weights_they_had(tmp_path, lora) -> None:
    """A model (LoRA, or fully fine-tuned) after two steps, and a sampler saved from it: after a restart the
    model's every weight is the one it had, and the sampler's path is served again."""
    import torch

    model = make_tiny_model(tmp_path / "tiny")
    first = Service(model, tmp_path / "checkpoints", tmp_path / "state", commit_every_s=0)
    session = first.create_session()
    model_id = f"{session}:train:0"
    body = {"session_id": session, "model_seq_id": 0, "base_model": str(model)}
    await first.futures.result(first.create_model(body if lora is None else {**body, "lora_config": lora}))
    trained = first.models[model_id].trainer.model
    for seq in (1, 2):
        for p in trained.parameters():  # a gradient for the step to apply (no forward_backward here)
            p.grad = torch.ones_like(p) if p.requires_grad else None
        await first.futures.result(first.optim_step({"model_id": model_id, "seq_id": seq,
                                                     "adam_params": {"learning_rate": 1e-3}}))
    saved = await first.futures.result(first.save_for_sampler({"model_id": model_id, "seq_id": 3, "path": "s"}))
    weights = {n: p.detach().clone() for n, p in trained.named_parameters()}
    await first.close()

    second = Service(model, tmp_path / "checkpoints", tmp_path / "state", commit_every_s=0)
    await recover(second)
    await second.futures.result(call_id(model_id, 0))
    assert second.models[model_id].steps == 2 and second.samplers.knows(saved["path"])
    again = dict(second.models[model_id].trainer.model.named_parameters())
    assert all(torch.equal(again[n].detach(), w) for n, w in weights.items())
    await second.close()
