"""The learner's loss options (stages.learner.losses, policies.correction), each against a hand-computed example."""

from __future__ import annotations

import math

import pytest
import torch

from baton.builder import grpo_learner
from baton.config import validate
from baton.schema import RunConfig
from policies.correction import Correction
from stages.learner.losses import (
    aggregate,
    entropy_bonus_rows,
    group_advantages,
    kl_k3,
    lr_factor,
    lr_scheduler,
    ppo_clip_loss,
    staleness_lr_factor,
    token_entropy,
    zero_variance_fraction,
)


def _ratios(values: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """logprobs (with gradient) and zero behaviour logprobs whose ratio is `values`, one row."""
    return torch.tensor([values]).log().requires_grad_(True), torch.zeros(1, len(values))


def test_clip_higher_clips_each_side_at_its_own_bound() -> None:
    # ratios 0.5 (A < 0: clipped at 1 - 0.2), 1.25 (inside 1 + 0.28), 1.5 (A > 0: clipped at 1 + 0.28)
    logprobs, behaviour = _ratios([0.5, 1.25, 1.5])
    adv = torch.tensor([[-1.0, 1.0, 1.0]])
    loss, stats = ppo_clip_loss(logprobs, behaviour, adv, torch.ones(1, 3), clip_eps=0.2, clip_high=0.28)
    # per token: -min(-0.5, -0.8) = 0.8; -1.25; -min(1.5, 1.28) = -1.28
    assert loss.item() == pytest.approx((0.8 - 1.25 - 1.28) / 3)
    assert stats["clip_frac_low"] == pytest.approx(1 / 3) and stats["clip_frac_high"] == pytest.approx(1 / 3)
    assert stats["clip_frac"] == pytest.approx(2 / 3)
    loss.backward()  # only the unclipped middle token carries a gradient: d(-r)/d(log r) = -r
    assert logprobs.grad[0].tolist() == pytest.approx([0.0, -1.25 / 3, 0.0])


def test_symmetric_clip_is_the_default() -> None:
    logprobs, behaviour = _ratios([1.25])
    loss, stats = ppo_clip_loss(logprobs, behaviour, torch.ones(1, 1), torch.ones(1, 1), clip_eps=0.2)
    assert loss.item() == pytest.approx(-1.2)  # 1.25 clipped at 1 + 0.2 without clip_high
    assert stats["clip_frac_high"] == 1.0 and stats["clip_frac_low"] == 0.0


PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # row 3: no tokens


@pytest.mark.parametrize(("mode", "max_tokens", "expected"), [
    ("token-mean", None, (1 + 2 + 3 + 4) / 4),  # every token of the batch weighs the same
    ("seq-mean-token-mean", None, (2 + 4) / 2),  # each row's mean, then the mean over rows with tokens
    ("seq-mean-token-sum-norm", 4, (6 / 4 + 4 / 4) / 2),  # each row's sum / a constant, no length norm
    ("seq-mean-token-sum-norm", None, (6 / 4 + 4 / 4) / 2),  # unset: the batch's width (4)
    ("seq-mean-token-sum-norm", 8, (6 / 8 + 4 / 8) / 2),
])
def test_aggregation_modes(mode: str, max_tokens: int | None, expected: float) -> None:
    assert aggregate(PER_TOKEN, MASK, mode, max_tokens).item() == pytest.approx(expected)


def test_aggregation_reads_multi_turn_rows_through_the_mask_only() -> None:
    # two masked spans (model turns) around an environment reply that must not count
    per_token = torch.tensor([[1.0, 3.0, 100.0, 100.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]])
    assert aggregate(per_token, mask, "token-mean").item() == pytest.approx(3.0)
    assert aggregate(per_token, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)
    assert aggregate(per_token, mask, "seq-mean-token-sum-norm", 10).item() == pytest.approx(0.9)


def test_unknown_aggregation_is_refused() -> None:
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(PER_TOKEN, MASK, "sum")  # type: ignore[arg-type]


def test_a_correction_aggregates_as_the_learner_asks() -> None:
    # on-policy, no clipping: the loss is -A aggregated; rows of 3 and 1 tokens with A = 1 and 2
    logprobs = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([[1.0], [2.0]])
    token, _ = Correction().loss(logprobs, logprobs, logprobs, adv, mask)
    seq, _ = Correction("decoupled").loss(logprobs, logprobs, logprobs, adv, mask,
                                          reduce=lambda v, m: aggregate(v, m, "seq-mean-token-mean"))
    assert token.item() == pytest.approx(-(1 + 1 + 1 + 2) / 4)
    assert seq.item() == pytest.approx(-(1 + 2) / 2)


def test_dr_grpo_advantages_are_not_scaled_by_the_std() -> None:
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5]), torch.tensor([0, 0, 0, 0, 1, 1])
    assert group_advantages(rewards, groups, scale_by_std=False).tolist() == pytest.approx(
        [0.75, -0.25, -0.25, -0.25, 0.0, 0.0])
    scaled = group_advantages(rewards, groups)  # std of (1, 0, 0, 0) with Bessel's correction: 0.5
    assert scaled[:4].tolist() == pytest.approx([0.75 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001])


def test_zero_variance_fraction_counts_groups_of_equal_rewards() -> None:
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert zero_variance_fraction(rewards, torch.tensor([0, 0, 1, 1, 2, 2])) == pytest.approx(2 / 3)


def test_the_entropy_bonus_counts_all_rows_or_only_groups_without_signal() -> None:
    rewards, groups = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.0, 0.0]), torch.tensor([0, 0, 1, 1, 2, 2])
    assert entropy_bonus_rows(rewards, groups).tolist() == [1.0] * 6
    assert entropy_bonus_rows(rewards, groups, "zero-variance").tolist() == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    # the learner's term: rows of the signal group weigh nothing, every token still counts in the divisor
    entropy, mask = torch.tensor([[2.0], [4.0], [1.0], [1.0], [3.0], [3.0]]), torch.ones(6, 1)
    rows = entropy_bonus_rows(rewards, groups, "zero-variance")[:, None]
    assert float(aggregate(entropy * rows, mask)) == pytest.approx((1 + 1 + 3 + 3) / 6)
    with pytest.raises(ValueError, match="entropy scope"):
        entropy_bonus_rows(rewards, groups, "some")  # type: ignore[arg-type]


def test_entropy_of_uniform_and_certain_distributions() -> None:
    logp = torch.tensor([[[0.25] * 4, [1.0, 1e-30, 1e-30, 1e-30]]]).log()
    assert token_entropy(logp)[0].tolist() == pytest.approx([math.log(4), 0.0], abs=1e-6)


def test_kl_k3_by_hand() -> None:
    logp, ref = torch.tensor([[math.log(0.5), math.log(0.3)]]), torch.tensor([[math.log(0.25), math.log(0.3)]])
    # exp(ref - logp) - (ref - logp) - 1 = 0.5 - ln 0.5 - 1 for the first token, 0 where they agree
    assert kl_k3(logp, ref)[0].tolist() == pytest.approx([0.5 + math.log(2) - 1, 0.0])
    assert bool((kl_k3(torch.randn(3, 5), torch.randn(3, 5)) >= 0).all())


def test_lr_warmup_then_decay() -> None:
    assert [lr_factor(s, 4, 14) for s in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])
    assert lr_factor(9, 4, 14, "linear") == pytest.approx(0.5)  # halfway through the 10 decay steps
    assert lr_factor(9, 4, 14, "cosine") == pytest.approx(0.5)
    assert lr_factor(14, 4, 14, "cosine", min_ratio=0.1) == pytest.approx(0.1)
    assert lr_factor(6, 4, 14, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.2)))
    assert lr_factor(20, 0, 14, "linear") == pytest.approx(0.0)  # past the last step it stays at the floor


def test_staler_steps_take_smaller_steps() -> None:
    assert staleness_lr_factor(2, tuned_at=2) == 1.0
    assert staleness_lr_factor(0.5, tuned_at=2) == 1.0  # fresher than tuned: never above the lr
    assert staleness_lr_factor(4, tuned_at=2) == pytest.approx((3 / 5) ** 2)
    assert staleness_lr_factor(8, tuned_at=2, power=1) == pytest.approx(1 / 3)
    assert staleness_lr_factor(8, tuned_at=2, power=0) == 1.0
    with pytest.raises(ValueError, match="staleness"):
        staleness_lr_factor(-1, tuned_at=2)


def test_the_floor_keeps_a_large_bound_learning() -> None:
    assert staleness_lr_factor(32, tuned_at=5) == pytest.approx((6 / 33) ** 2)  # 0.033: k = 32 barely moves
    assert staleness_lr_factor(32, tuned_at=5, floor=0.4) == 0.4
    assert staleness_lr_factor(8, tuned_at=5, floor=0.4) == pytest.approx((6 / 9) ** 2)  # 0.44: above the floor
    assert staleness_lr_factor(2, tuned_at=5, floor=0.4) == 1.0
    with pytest.raises(ValueError, match="floor"):
        staleness_lr_factor(8, tuned_at=5, floor=1.5)


def test_lr_scheduler_steps_the_optimizer_and_resumes_from_a_version() -> None:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = lr_scheduler(opt, warmup_steps=2, total_steps=6, decay="linear")
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([1 / 3, 2 / 3, 1.0, 0.75, 0.5, 0.25])
    resumed = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    lr_scheduler(resumed, warmup_steps=2, total_steps=6, decay="linear", start=4)
    assert resumed.param_groups[0]["lr"] == pytest.approx(0.5)


def test_learner_keys_reach_the_learner(tmp_path) -> None:
    learner = {"clip_eps_high": 0.28, "loss_agg_mode": "seq-mean-token-sum-norm", "loss_max_tokens": 8,
               "norm_adv_by_std": False, "entropy_coef": 0.01, "entropy_scope": "zero-variance", "kl_coef": 0.05,
               "lr_warmup_steps": 10, "lr_decay": "cosine", "min_lr_ratio": 0.1, "warn_entropy_below": 0.2,
               "lr_tuned_staleness": 1.0, "lr_staleness_power": 1.5}
    cfg = validate(RunConfig, {"model": {"path": str(tmp_path / "m")}, "learner": learner})
    made = grpo_learner(cfg.learner, cfg, model=tmp_path / "m")
    assert {key: getattr(made, key) for key in learner} == learner
    with pytest.raises(Exception, match="loss_agg_mode"):
        validate(RunConfig, {"learner": {"loss_agg_mode": "sum"}})


def test_a_run_warns_once_when_entropy_collapses_while_reward_is_low(tmp_path) -> None:
    """The learner's metrics carry the collapse diagnostics, and `learner.entropy_collapse` is reported once
    (a floor above any entropy makes it fire at the first version; a reward threshold of 0 never does)."""
    import json
    from pathlib import Path

    from baton.builder import build_pipeline

    def run(name: str, reward_below: float) -> Path:
        cfg = validate(RunConfig, {
            "name": name, "steps": 4, "run_root": str(tmp_path / "runs"), "model": {"path": str(tmp_path / "m")},
            "telemetry": {"progress": False, "log_level": "error"}, "checkpoint": {"every": 0},
            "engine": {"kind": "torch", "batch_groups": 4}, "learner": {
                "lr": 3e-3, "groups_per_step": 4, "warn_entropy_below": 100.0, "warn_reward_below": reward_below,
                "clip_eps_high": 0.28, "entropy_coef": 0.01, "kl_coef": 0.1, "lr_warmup_steps": 2}})
        return Path(build_pipeline(cfg).run()["run_dir"])

    warned = run("warned", 2.0)
    metrics = [json.loads(line) for line in (warned / "metrics.jsonl").read_text().splitlines()]
    for key in ("entropy", "zero_var_frac", "clip_frac_low", "clip_frac_high", "lr", "kl_ref"):
        assert all(key in m for m in metrics), key
    assert [m["lr"] for m in metrics[:3]] == pytest.approx([1e-3, 2e-3, 3e-3])  # warmup over 2 versions
    events = [json.loads(line) for line in (warned / "events.jsonl").read_text().splitlines()]
    assert [e["version"] for e in events if e["kind"] == "learner.entropy_collapse"] == [1]
    assert metrics[-1]["events/learner.entropy_collapse"] == 1
    quiet = run("quiet", 0.0)
    quiet_events = quiet / "events.jsonl"
    assert not quiet_events.exists() or "learner.entropy_collapse" not in quiet_events.read_text()


def test_a_stale_step_trains_at_the_scaled_lr(tmp_path) -> None:
    """At k = 4 the engine runs ahead of the learner, so steps train on groups 3-4 versions old: each
    record's `lr` is the configured lr times `staleness_lr_factor` of that step's mean staleness (never
    below the floor); with power 0 it is the configured lr throughout."""
    import json
    from pathlib import Path

    from baton.builder import build_pipeline

    def run(name: str, power: float) -> list[dict]:
        cfg = validate(RunConfig, {
            "name": name, "steps": 10, "run_root": str(tmp_path / "runs"), "model": {"path": str(tmp_path / "m")},
            "telemetry": {"progress": False, "log_level": "error"}, "checkpoint": {"every": 0},
            "staleness": {"k": 4}, "correction": {"kind": "decoupled"},
            "engine": {"kind": "torch", "batch_groups": 4}, "learner": {
                "lr": 3e-3, "groups_per_step": 4, "lr_tuned_staleness": 2.0, "lr_staleness_power": power,
                "lr_staleness_floor": 0.5}})
        run_dir = Path(build_pipeline(cfg).run()["run_dir"])
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    scaled = run("scaled", 2.0)
    assert max(m["staleness_mean"] for m in scaled) > 2, "the test needs steps staler than the tuned staleness"
    for m in scaled:
        factor = staleness_lr_factor(m["staleness_mean"], 2.0, 2.0, floor=0.5)
        assert m["lr"] == pytest.approx(3e-3 * factor) and m["lr_staleness_factor"] == pytest.approx(factor, abs=1e-4)
    assert min(m["lr"] for m in scaled) < 3e-3
    assert {m["lr"] for m in run("unscaled", 0.0)} == {3e-3}
