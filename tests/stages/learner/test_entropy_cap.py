"""The entropy bonus's cap (`learner.entropy_cap`): each token's entropy counts in the bonus only up to the
cap, so a token above it gets no gradient from the bonus, and a step whose rewards are flat no longer
pushes the policy towards uniform."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from baton.builder import grpo_learner
from baton.config import validate
from baton.schema import RunConfig
from stages.data.model import make_tiny_model
from stages.learner import GRPOLearner
from stages.learner.losses import entropy_bonus_term, token_entropy
from stages.learner.step import PolicyTrainer
from tests.stages.learner.test_ranks import groups

torch.set_num_threads(1)


def test_tokens_above_the_cap_get_no_gradient_from_the_bonus() -> None:
    # one near-certain token (entropy ~0.06) and one uniform over 4 (entropy log 4 = 1.39)
    logits = torch.tensor([[[6.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]], requires_grad=True)
    entropy = token_entropy(torch.log_softmax(logits, -1))
    capped = entropy_bonus_term(entropy, cap=0.5)
    assert capped.tolist()[0] == pytest.approx([entropy[0, 0].item(), 0.5])
    capped.sum().backward()
    assert logits.grad[0, 1].abs().sum() == 0  # above the cap: no push
    assert logits.grad[0, 0, 0] < 0  # below it: the bonus lowers the certain token's logit (more entropy)
    assert torch.equal(entropy_bonus_term(entropy, None), entropy)  # uncapped: the entropy itself


def test_the_key_reaches_the_learner_and_a_bad_cap_is_refused(tmp_path: Path) -> None:
    cfg = validate(RunConfig, {"model": {"path": str(tmp_path / "m")}, "learner": {"entropy_cap": 0.3}})
    assert grpo_learner(cfg.learner, cfg, model=tmp_path / "m").entropy_cap == 0.3
    with pytest.raises(ValueError, match="entropy_cap"):
        GRPOLearner(tmp_path / "m", entropy_cap=0.0)
    with pytest.raises(Exception, match="entropy_cap"):
        validate(RunConfig, {"learner": {"entropy_cap": "first"}})
    with pytest.raises(Exception, match="entropy_cap"):
        validate(RunConfig, {"learner": {"entropy_cap": -1.0}})


@pytest.mark.parametrize(("k", "given", "learner_gets"), [
    (2, None, None), (0, None, None), (4, None, "initial"), (32, None, "initial"),  # auto: off up to k = 2
    (8, "off", None), (2, 0.5, 0.5), (8, 0.3, 0.3), (2, "initial", "initial"),  # what a user names is kept
])
def test_auto_caps_above_k2_and_the_resolved_config_says_so(tmp_path: Path, k: int, given: object,
                                                             learner_gets: float | str | None) -> None:
    learner = {} if given is None else {"entropy_cap": given}
    cfg = validate(RunConfig, {"model": {"path": str(tmp_path / "m")}, "staleness": {"k": k}, "learner": learner})
    assert grpo_learner(cfg.learner, cfg, model=tmp_path / "m").entropy_cap == learner_gets
    assert cfg.learner.entropy_cap == (learner_gets or "off")  # resolved: the run's config.toml names it
    again = validate(RunConfig, {"model": {"path": str(tmp_path / "m")}, "staleness": {"k": k},
                                 "learner": {"entropy_cap": cfg.learner.entropy_cap}})
    assert again.learner.entropy_cap == cfg.learner.entropy_cap  # a resumed run reads back what it ran with


def test_on_flat_rewards_a_capped_bonus_leaves_high_entropy_weights_alone(tmp_path: Path) -> None:
    """Every group's rewards equal: the policy gradient is zero and the bonus is the whole loss. A random
    model's entropy is several nats, far above a cap of 0.1, so the capped learner's step changes nothing,
    where the uncapped one moves the weights (towards uniform)."""
    folder = make_tiny_model(tmp_path / "tiny")
    flat = groups(0)
    for batch in flat:
        batch.row_fields["rewards"][:] = 1.0
    spec = GRPOLearner(folder, lr=1e-2, device="cpu", entropy_coef=0.01)

    def moved(cap: float | None) -> float:
        trainer = PolicyTrainer(replace(spec, entropy_cap=cap), 10)
        trainer.schedule(0)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train(flat, 0.0)
        return sum(float((p.detach() - before[n]).abs().sum()) for n, p in trainer.model.named_parameters())

    assert moved(0.1) == 0.0
    assert moved(None) > 0.0


def test_an_initial_cap_is_the_first_steps_entropy_and_survives_a_checkpoint(tmp_path: Path) -> None:
    """`entropy_cap = "initial"`: the first step is uncapped and measures the policy's mean token entropy;
    from the second step on the cap is that figure, the metrics name it, and a resumed trainer gets it
    back from the checkpoint instead of measuring its own (by then sharper) policy."""
    folder = make_tiny_model(tmp_path / "tiny")
    spec = GRPOLearner(folder, lr=1e-2, device="cpu", entropy_cap="initial")
    trainer = PolicyTrainer(spec, 10)
    trainer.schedule(0)
    assert trainer.entropy_cap is None
    first = trainer.train(groups(0), 0.0)
    assert trainer.entropy_cap == first["entropy"] > 1.0  # a random model: several nats a token
    assert first["entropy_cap"] == pytest.approx(first["entropy"], abs=1e-4)
    second = trainer.train(groups(1), 0.0)
    assert second["entropy_cap"] == first["entropy_cap"]  # measured once, not each step
    trainer.write_state(tmp_path / "ckpt", 2)
    resumed = PolicyTrainer(spec, 10)
    assert resumed.read_state(tmp_path / "ckpt") == 2
    assert resumed.entropy_cap == trainer.entropy_cap
    fixed = PolicyTrainer(replace(spec, entropy_cap=0.5), 10)  # a number is the cap from the first step
    fixed.read_state(tmp_path / "ckpt")
    assert fixed.entropy_cap == 0.5
