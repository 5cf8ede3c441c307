"""GRPO advantages, the PPO-clip surrogate, and the verifiable-reward tasks."""

from __future__ import annotations

import random

import torch

torch.set_num_threads(1)

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from stages.data.tasks import TASKS, Addition, Prompt, ReverseDigits, Task, positional_credit  # noqa: E402
from stages.learner.losses import group_advantages, ppo_clip_loss  # noqa: E402

# ---------------------------------------------------------------- advantages


def test_equal_reward_groups_get_zero_advantage() -> None:
    rewards = torch.tensor([0.5, 0.5, 0.5, 1.0, 1.0, 0.0, 0.0, 0.0])
    index = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    adv = group_advantages(rewards, index)
    assert torch.equal(adv, torch.zeros(8))


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(2, 8), min_size=1, max_size=5),
    seed=st.integers(0, 2**31 - 1),
)
def test_advantages_zero_mean_unit_std_per_group(sizes: list[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    index = torch.cat([torch.full((n,), g) for g, n in enumerate(sizes)])
    rewards = torch.rand(len(index), generator=gen)
    # shuffle rows: groups need not be contiguous
    perm = torch.randperm(len(index), generator=gen)
    rewards, index = rewards[perm], index[perm]
    adv = group_advantages(rewards, index)
    assert adv.shape == rewards.shape
    for g in range(len(sizes)):
        a, r = adv[index == g], rewards[index == g]
        assert abs(float(a.mean())) < 1e-4
        std = float(r.std())  # unbiased, as in the module
        if std > 1e-2:
            assert float(a.std()) == pytest.approx(1.0, rel=2e-2)
            # order within the group is preserved: higher reward, higher advantage
            assert torch.equal(torch.argsort(a), torch.argsort(r)) or len(set(r.tolist())) < len(r)


def test_advantage_values_for_a_binary_group() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0, 0, 0, 0]))
    # mean 0.25, unbiased std 0.5
    assert torch.allclose(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-3)
    assert adv[0] > 0 and (adv[1:] < 0).all()


def test_groups_are_independent() -> None:
    r = torch.tensor([1.0, 0.0, 20.0, 10.0])
    adv = group_advantages(r, torch.tensor([0, 0, 1, 1]))
    alone = group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))
    assert torch.allclose(adv[:2], alone)
    assert torch.allclose(adv[:2], adv[2:], atol=1e-3)  # scale-free per group


# ---------------------------------------------------------------- ppo clip


def _loss_inputs(ratio: torch.Tensor, adv: torch.Tensor):
    behaviour = torch.log(torch.rand(ratio.shape, generator=torch.Generator().manual_seed(0)) * 0.5 + 0.1)
    logprobs = (behaviour + ratio.log()).clone().requires_grad_(True)
    return logprobs, behaviour


def test_loss_is_minus_mean_ratio_times_advantage_inside_clip() -> None:
    ratio = torch.tensor([[0.9, 1.0, 1.1], [0.85, 1.15, 1.05]])
    adv = torch.tensor([[2.0], [-1.0]])
    logprobs, behaviour = _loss_inputs(ratio, adv)
    mask = torch.ones_like(ratio)
    loss, stats = ppo_clip_loss(logprobs, behaviour, adv, mask, clip_eps=0.2)
    expected = -(ratio * adv).mean()
    assert torch.allclose(loss, expected, atol=1e-6)
    assert stats["clip_frac"] == 0.0
    loss.backward()
    # d(-mean(r*A))/d logprob = -r*A/N
    assert torch.allclose(logprobs.grad, -(ratio * adv) / ratio.numel(), atol=1e-6)


def test_on_policy_loss_is_minus_mean_advantage() -> None:
    behaviour = torch.log(torch.full((2, 4), 0.3))
    logprobs = behaviour.clone().requires_grad_(True)
    adv = torch.tensor([[1.0], [-3.0]])
    loss, stats = ppo_clip_loss(logprobs, behaviour, adv, torch.ones(2, 4))
    assert float(loss.detach()) == pytest.approx(1.0)  # -(4*1 + 4*-3)/8
    assert stats["approx_kl"] == pytest.approx(0.0, abs=1e-7)


def test_gradient_zero_where_clipped_in_advantage_direction() -> None:
    eps = 0.2
    # row 0: A > 0; row 1: A < 0
    ratio = torch.tensor([[1.5, 1.1, 0.5], [0.5, 0.9, 1.5]])
    adv = torch.tensor([[1.0], [-1.0]])
    logprobs, behaviour = _loss_inputs(ratio, adv)
    loss, stats = ppo_clip_loss(logprobs, behaviour, adv, torch.ones_like(ratio), clip_eps=eps)
    loss.backward()
    g = logprobs.grad
    # clipped in the direction the advantage pushes: no gradient
    assert g[0, 0] == 0 and g[1, 0] == 0
    # inside the clip: gradient flows
    assert g[0, 1] != 0 and g[1, 1] != 0
    # outside the clip against the advantage: the unclipped term is the minimum, gradient flows
    assert g[0, 2] != 0 and g[1, 2] != 0
    assert g[0, 1] < 0 < g[1, 1]  # descending raises logprob for A>0, lowers it for A<0
    assert stats["clip_frac"] == pytest.approx(4 / 6)


def test_mask_excludes_tokens_from_loss_and_gradient() -> None:
    ratio = torch.tensor([[1.0, 1.1, 3.0], [0.9, 5.0, 0.1]])
    adv = torch.tensor([[1.0], [2.0]])
    logprobs, behaviour = _loss_inputs(ratio, adv)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, stats = ppo_clip_loss(logprobs, behaviour, adv, mask)
    expected = -(1.0 * 1.0 + 1.1 * 1.0 + 0.9 * 2.0) / 3
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    assert stats["clip_frac"] == 0.0  # the clipped tokens are all masked out
    loss.backward()
    assert (logprobs.grad[mask == 0] == 0).all()
    assert (logprobs.grad[mask == 1] != 0).all()
    # masked values do not matter at all
    logprobs2 = logprobs.detach().clone()
    logprobs2[mask == 0] = 50.0
    loss2, _ = ppo_clip_loss(logprobs2, behaviour, adv, mask)
    assert torch.allclose(loss.detach(), loss2)


def test_empty_mask_gives_zero_loss_not_nan() -> None:
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, stats = ppo_clip_loss(lp, torch.zeros(2, 3), torch.ones(2, 1), torch.zeros(2, 3))
    assert float(loss.detach()) == 0.0 and stats["clip_frac"] == 0.0


# ---------------------------------------------------------------- tasks


@pytest.mark.parametrize("digits", [1, 2, 5, 16])
def test_reverse_digits_prompts(digits: int) -> None:
    task = ReverseDigits(digits=digits)
    assert isinstance(task, Task)
    assert task.max_new_tokens == digits
    rng = random.Random(0)
    seen = set()
    for _ in range(50):
        p = task.sample(rng)
        assert p.text.endswith(">") and len(p.text) == digits + 1
        assert p.text[:-1].isdigit()
        assert p.answer == p.text[:-1][::-1]
        assert task.reward(p, p.answer) == 1.0
        seen.add(p.text)
    assert len(seen) > 1
    again = [task.sample(random.Random(0)).text for _ in range(2)]
    assert again[0] == again[1]  # sampling depends only on the rng


def test_reverse_digits_rewards() -> None:
    task = ReverseDigits(digits=4)
    p = Prompt(text="1234>", answer="4321")
    expected = {"4321": 1.0, "1234": 0.0, "5555": 0.0, "4300": 0.5, "4": 0.25, "": 0.0, "43219": 1.0}
    assert {completion: task.reward(p, completion) for completion in expected} == expected  # extras ignored


@pytest.mark.parametrize("digits", [0, -1, 17, 100])
def test_reverse_digits_out_of_range_raises(digits: int) -> None:
    with pytest.raises(ValueError, match="digits"):
        ReverseDigits(digits=digits)


def test_addition_prompts_and_rewards() -> None:
    task = Addition()
    assert isinstance(task, Task) and task.max_new_tokens == 2
    rng = random.Random(1)
    for _ in range(100):
        p = task.sample(rng)
        a, b = int(p.text[0]), int(p.text[2])
        assert p.text == f"{a}+{b}="
        assert p.answer == f"{a + b:02d}" and len(p.answer) == 2
        assert task.reward(p, p.answer) == 1.0
    p = Prompt(text="3+5=", answer="08")
    expected = {"08": 1.0, "8": 0.0, "09": 0.5, "18": 0.5, "91": 0.0}
    assert {completion: task.reward(p, completion) for completion in expected} == expected
    q = Prompt(text="9+9=", answer="18")
    assert task.reward(q, "18") == 1.0 and task.reward(q, "81") == 0.0


@given(answer=st.text("0123456789", min_size=1, max_size=16), completion=st.text("0123456789", max_size=20))
def test_positional_credit_is_a_fraction(answer: str, completion: str) -> None:
    c = positional_credit(answer, completion)
    assert 0.0 <= c <= 1.0
    assert (c == 1.0) == (completion[: len(answer)] == answer)
    assert positional_credit(answer, answer) == 1.0


def test_task_registry() -> None:
    assert TASKS["reverse-digits"] is ReverseDigits and TASKS["addition"] is Addition
    assert ReverseDigits().name == "reverse-digits" and Addition().name == "addition"


def test_learner_epochs_must_be_positive() -> None:
    from stages.learner import GRPOLearner

    with pytest.raises(ValueError, match="learner.epochs must be >= 1"):
        GRPOLearner("unused", epochs=0)
