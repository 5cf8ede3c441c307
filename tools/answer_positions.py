"""Where a digit task's policy goes wrong, answer position by answer position; and whether the model
could fit the task at all when told the answers.

    python tools/answer_positions.py probe RUN_DIR [--samples 512]
    python tools/answer_positions.py fit --digits 4 [--steps 300] [--lr 1.5e-3] [--heads 8 --kv-heads 4]

`probe` loads RUN_DIR's latest checkpoint into its model and answers fresh reverse-digits or addition
prompts (the run's `[task]`) greedily: per answer position, the accuracy and the policy's entropy
there, its commonest answers beside the commonest right ones, and for reverse-digits which prompt digit
its wrong answers copy. A plateau below 1.0 with one position near chance and a low entropy there is a
position the policy locked onto a wrong rule; one answer given to most prompts is a bias, not a rule.
`fit` trains the same tiny model from the same random init with cross-entropy on the right answers
(what GRPO's reward only hints at): if it reaches 1.0, the architecture is not what limits RL.
"""

from __future__ import annotations

import argparse
import random
import sys
import tomllib
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.checkpoint import latest_checkpoint  # noqa: E402
from stages.data.model import load_model, load_tokenizer, make_tiny_model, prompt_token_ids  # noqa: E402
from stages.data.tasks import Addition, ReverseDigits  # noqa: E402
from stages.learner.state import read_model_weights  # noqa: E402


def task_of(config: dict):
    spec = config.get("task", {})
    if spec.get("kind", "reverse-digits") == "addition":
        return Addition()
    return ReverseDigits(digits=spec.get("digits", ReverseDigits.digits))


def encoded(tokenizer, task, n: int, seed: int) -> tuple[list, torch.Tensor, torch.Tensor]:
    """`n` prompts of `task`, their prompt ids and answer ids (every prompt of a digit task is one length)."""
    rng = random.Random(seed)
    prompts = [task.sample(rng) for _ in range(n)]
    ids = torch.tensor([prompt_token_ids(tokenizer, p.text) for p in prompts])
    answers = torch.tensor([tokenizer.encode(p.answer, add_special_tokens=False) for p in prompts])
    return prompts, ids, answers


@torch.no_grad()
def greedy(model, ids: torch.Tensor, length: int) -> tuple[torch.Tensor, list[float]]:
    """The greedy answer tokens and the mean entropy of the policy at each answer position."""
    entropies = []
    for _ in range(length):
        logp = torch.log_softmax(model(ids).logits[:, -1].float(), -1)
        entropies.append(float(-(logp.exp() * logp).sum(-1).mean()))
        ids = torch.cat([ids, logp.argmax(-1, keepdim=True)], 1)
    return ids[:, -length:], entropies


def probe(run_dir: Path, samples: int) -> None:
    config = tomllib.loads((run_dir / "config.toml").read_text())
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        raise SystemExit(f"{run_dir} has no checkpoint")
    folder = config["model"]["path"]
    tokenizer, model, task = load_tokenizer(folder), load_model(folder), task_of(config)
    read_model_weights(checkpoint / "consumer", model)  # written at any world size
    prompts, ids, answers = encoded(tokenizer, task, samples, seed=12345)
    out, entropies = greedy(model.eval(), ids, answers.shape[1])
    print(f"{checkpoint.name}: {task.name}, {samples} prompts, greedy")
    for position, entropy in enumerate(entropies):
        right = out[:, position] == answers[:, position]
        line = f"  position {position}: accuracy {right.float().mean():.3f}  entropy {entropy:.3f}"
        given, due = commonest(tokenizer, out[:, position]), commonest(tokenizer, answers[:, position])
        line += f"  answers given {given} (due {due})"
        if isinstance(task, ReverseDigits):
            line += "  wrong answers copy prompt digit " + copied(tokenizer, prompts, out, right, position)
        print(line)


def commonest(tokenizer, tokens: torch.Tensor, top: int = 3) -> str:
    """The `top` commonest tokens among `tokens` with their share: a policy that gives one answer to every
    prompt at a position has learnt a bias there (the commonest answer, or a neighbour position's), not a rule."""
    counts = Counter(tokens.tolist())
    return ", ".join(f"{tokenizer.decode([t])!r} {n / len(tokens):.0%}" for t, n in counts.most_common(top))


def copied(tokenizer, prompts, out: torch.Tensor, right: torch.Tensor, position: int) -> str:
    """Which prompt index the wrong answers at `position` equal (most common first)."""
    sources: Counter[str] = Counter()
    for prompt, answer, ok in zip(prompts, out[:, position].tolist(), right.tolist(), strict=True):
        if not ok:
            digit = tokenizer.decode([answer])
            sources[",".join(str(i) for i, d in enumerate(prompt.text[:-1]) if d == digit) or "none"] += 1
    return ", ".join(f"{where} x{count}" for where, count in sources.most_common(3)) or "-"


def fit(digits: int, steps: int, lr: float, heads: int, kv_heads: int) -> None:
    torch.manual_seed(0)
    # one folder per shape: make_tiny_model's init is seeded, so the default shape's weights equal the quickstart's
    folder = make_tiny_model(Path("runs/models") / f"tiny-h{heads}kv{kv_heads}", heads=heads, kv_heads=kv_heads)
    tokenizer, model, task = load_tokenizer(folder), load_model(folder), ReverseDigits(digits)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for step in range(1, steps + 1):
        _, ids, answers = encoded(tokenizer, task, 128, seed=step)
        logits = model(torch.cat([ids, answers], 1)).logits[:, ids.shape[1] - 1 : -1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), answers.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0:
            accuracy = [round(float(a), 3) for a in (logits.argmax(-1) == answers).float().mean(0)]
            print(f"step {step}: loss {loss.item():.4f}  accuracy per position {accuracy}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("probe", help="per-position accuracy and entropy of a run's latest checkpoint")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--samples", type=int, default=512)
    f = commands.add_parser("fit", help="supervised fit of the tiny model to reverse-digits")
    f.add_argument("--digits", type=int, default=4)
    f.add_argument("--steps", type=int, default=300)
    f.add_argument("--lr", type=float, default=1.5e-3, help="the supervised step size")
    f.add_argument("--heads", type=int, default=make_tiny_model.__kwdefaults__["heads"])
    f.add_argument("--kv-heads", type=int, default=make_tiny_model.__kwdefaults__["kv_heads"])
    a = parser.parse_args()
    torch.set_num_threads(1)
    if a.command == "probe":
        probe(a.run_dir, a.samples)
    else:
        fit(a.digits, a.steps, a.lr, a.heads, a.kv_heads)


if __name__ == "__main__":
    main()
