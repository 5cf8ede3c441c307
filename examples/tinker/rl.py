"""GRPO-style RL through the official Tinker SDK against `baton serve`: the quickstart's task, learnt.

    pip install -e '.[tinker]'
    python examples/tinker/rl.py [--steps 600] [--groups 16] [--group-size 8] [--lr 1e-3] [--rank 8]

The task is the quickstart's (`stages.data.tasks.ReverseDigits`, 2 digits: `37>` -> `73`, reward the fraction
of answer positions right). Each step:

1. `save_weights_and_get_sampling_client()`: the adapter as it is now, served by baton's torch engine;
2. for each of `--groups` prompts (the text after the tokenizer's BOS where it has one, as `baton run`'s
   rollout tokenizes the tiny model's prompts), `sample(prompt, num_samples=--group-size)` (all sent at once), at
   temperature 1 with the task's token budget, every sampled token with its logprob;
3. each completion scored by the task; its advantage is its reward minus its group's mean (Dr. GRPO: not
   divided by the std), less `--entropy-coef` x each token's logprob (the entropy bonus baton's learner has and
   Tinker's losses do not), spread over its completion tokens and divided by the step's completion tokens (a
   token mean, as baton's learner takes);
4. `forward_backward(datums, "importance_sampling")` with the sampler's logprobs, then `optim_step`.

It prints each step's mean reward and the trailing mean of the last 10 steps, stops once that reaches
`--target` (0.8, what `baton run configs/quickstart.toml` reaches), and ends with a JSON line: the reward
curve, the step it reached the target at (null if never), and where the time went (sampling, training).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ADAM, serving, work_folder  # noqa: E402

WINDOW = 10  # steps in the trailing mean reward


def group_datums(prompt: list[int], sequences, rewards: list[float], scale: float, entropy_coef: float = 0.0) -> list:
    """One group's datums for `importance_sampling`: tokens prompt + completion, the sampler's logprobs and the
    advantage (reward - group mean - entropy_coef x the token's logprob) x `scale` on the completion's targets, 0
    on the prompt's. The logprob term is the entropy bonus Tinker's losses do not have, as a reward: its expected
    gradient is entropy_coef x the gradient of the policy's entropy (E[-log p grad log p]), so the samples of a
    group do not all become the same answer, where the group's advantages, and with them the signal, vanish."""
    from tinker import types

    mean = sum(rewards) / len(rewards)
    out = []
    for seq, reward in zip(sequences, rewards, strict=True):
        tokens = prompt + list(seq.tokens)
        if len(tokens) < 2 or not seq.tokens:
            continue
        head = len(prompt) - 1  # targets that are prompt tokens
        advantages = [0.0] * head + [(reward - mean - entropy_coef * float(x)) * scale for x in seq.logprobs]
        logprobs = [0.0] * head + [float(x) for x in seq.logprobs]
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": logprobs,
                                               "advantages": advantages}))
    return out


def rl_step(training, tokenizer, task, rng: random.Random, args, adam, clock: dict) -> float:
    """One step (see the module docstring); its mean reward. `clock` adds the seconds of each phase."""
    from tinker import types

    started = time.monotonic()
    sampler = training.save_weights_and_get_sampling_client()
    saved = time.monotonic()
    prompts = [task.sample(rng) for _ in range(args.groups)]
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]  # as baton's rollout starts them
    encoded = [bos + list(tokenizer.encode(p.text, add_special_tokens=False)) for p in prompts]
    params = types.SamplingParams(max_tokens=task.max_new_tokens, temperature=1.0)
    futures = [sampler.sample(types.ModelInput.from_ints(ids), args.group_size, params) for ids in encoded]
    results = [f.result() for f in futures]
    sampled = time.monotonic()
    scored = [[task.reward(p, tokenizer.decode(list(s.tokens), skip_special_tokens=True)) for s in r.sequences]
              for p, r in zip(prompts, results, strict=True)]
    tokens = sum(len(s.tokens) for r in results for s in r.sequences)
    data = [d for ids, r, rewards in zip(encoded, results, scored, strict=True)
            for d in group_datums(ids, r.sequences, rewards, 1.0 / max(tokens, 1), args.entropy_coef)]
    fb = training.forward_backward(data, "importance_sampling")
    optim = training.optim_step(adam)
    fb.result()
    optim.result()
    done = time.monotonic()
    clock["save_weights_for_sampler"] += saved - started
    clock["sample"] += sampled - saved
    clock["train"] += done - sampled
    return sum(map(sum, scored)) / sum(map(len, scored))


def learn(service, model: str, args) -> dict:
    """The loop until the trailing reward reaches the target or the steps run out; the curve and the clock."""
    from tinker import types

    from stages.data.tasks import ReverseDigits

    task = ReverseDigits(digits=args.digits)
    training = service.create_lora_training_client(base_model=model, rank=args.rank)
    tokenizer = training.get_tokenizer()
    adam = types.AdamParams(learning_rate=args.lr, **ADAM)
    rng = random.Random(args.seed)
    clock = {"save_weights_for_sampler": 0.0, "sample": 0.0, "train": 0.0}
    rewards: list[float] = []
    ends: list[float] = []  # seconds from the start at each step's end
    reached = None
    started = time.monotonic()
    for step in range(args.steps):
        rewards.append(rl_step(training, tokenizer, task, rng, args, adam, clock))
        ends.append(time.monotonic() - started)
        trailing = sum(rewards[-WINDOW:]) / len(rewards[-WINDOW:])
        print(f"step {step:4d}  reward {rewards[-1]:.3f}  trailing {trailing:.3f}", flush=True)
        if len(rewards) >= WINDOW and trailing >= args.target:
            reached = step
            break
    seconds = time.monotonic() - started
    samples = len(rewards) * args.groups * args.group_size
    return {"rewards": [round(r, 4) for r in rewards], "reached_target_at_step": reached,
            "trailing_reward": sum(rewards[-WINDOW:]) / len(rewards[-WINDOW:]), "seconds": seconds,
            "samples_per_s": samples / seconds, "step_ends_s": [round(t, 3) for t in ends],
            "seconds_by_phase": {k: round(v, 2) for k, v in clock.items()}}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600, help="most steps (it stops at the target)")
    parser.add_argument("--groups", type=int, default=16, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    parser.add_argument("--digits", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3, help="Tinker's LoRA alpha is 32, baton run's LoRA "
                        "quickstart's 16: 1e-3 here moves the adapter as its 2e-3 does")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--entropy-coef", type=float, default=0.01, help="the entropy bonus, as baton's learner's "
                        "entropy_coef (a reward of -coef x each token's logprob; 0: none)")
    parser.add_argument("--target", type=float, default=0.8, help="trailing mean reward to stop at")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--folder", default=None, help="the model, the service's folder and its log (default: a "
                                                       "temporary folder)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    torch.set_num_threads(1)
    folder = work_folder(args.folder, "rl")
    with serving(folder) as (service, model):
        result = learn(service, model, args)
    print(json.dumps({"groups": args.groups, "group_size": args.group_size, "lr": args.lr, "rank": args.rank,
                      **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
