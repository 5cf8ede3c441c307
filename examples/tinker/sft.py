"""Supervised fine-tuning through the official Tinker SDK against `baton serve`, beside the same run done directly.

    pip install -e '.[tinker]'
    python examples/tinker/sft.py [--steps 80] [--batch 32] [--lr 3e-3] [--rank 8] [--folder runs/tinker-sft]

The data is made here: the quickstart's reverse-digits task written as prompt and answer text (`37>` -> `73`
then the end token), nothing downloaded. Each step sends one batch as Tinker datums (`cross_entropy`, weight
1 / (answer tokens in the batch) on each answer token, 0 on the prompt) with `forward_backward`, then
`optim_step(AdamParams(...))`; the loss printed is the batch's mean negative log-likelihood per answer token
(`loss:sum`, as the weights make it a mean).

Beside it, the same batches train a second LoRA model of the same base directly with baton's learner trainer
(`stages.learner.step.PolicyTrainer`: its model and AdamW, the same loss, the same Adam settings), in this
process. The last line is a JSON object: both loss curves, their last-5-step means and their ratio.
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


def reverse_digits_pairs(count: int, digits: int, seed: int) -> list[tuple[str, str]]:
    """`count` (prompt, answer) texts of the quickstart's task: `12>` -> `21`."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        text = "".join(rng.choice("0123456789") for _ in range(digits))
        out.append((f"{text}>", text[::-1]))
    return out


def encode(tokenizer, prompt: str, answer: str) -> tuple[list[int], list[float]]:
    """The example's tokens (the prompt with the tokenizer's own specials, the answer, the end token) and a
    0/1 weight per token: 1 on the answer and the end token."""
    head = list(tokenizer.encode(prompt, add_special_tokens=True))
    tail = list(tokenizer.encode(answer, add_special_tokens=False)) + [tokenizer.eos_token_id]
    return head + tail, [0.0] * len(head) + [1.0] * len(tail)


def datums(rows: list[tuple[list[int], list[float]]]) -> list:
    """Tinker datums: input the tokens less the last, targets the tokens less the first, each target's weight
    its token's weight over the batch's total (so `loss:sum` is the mean NLL per answer token)."""
    from tinker import types

    total = sum(sum(w[1:]) for _, w in rows)
    return [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [x / total for x in w[1:]]})
            for tokens, w in rows]


def sdk_run(training, batches: list, args) -> list[float]:
    """The SFT loop through the SDK on the LoRA training client `training`: its loss per step."""
    from tinker import types

    adam = types.AdamParams(learning_rate=args.lr, **ADAM)
    losses = []
    for step, rows in enumerate(batches):
        fb = training.forward_backward(datums(rows), "cross_entropy")
        optim = training.optim_step(adam)  # queued behind the forward_backward: one round trip per step
        losses.append(fb.result().metrics["loss:sum"])
        optim.result()
        print(f"sdk    step {step:3d}  loss {losses[-1]:.4f}", flush=True)
    return losses


def direct_run(model: str, batches: list, args) -> list[float]:
    """The same loop on baton's learner trainer in this process: its model and AdamW, the same loss."""
    import torch

    from stages.learner import GRPOLearner
    from stages.learner.sharding import clip_grad_norm
    from stages.learner.step import PolicyTrainer
    from stages.service.training import lora_spec

    trainer = PolicyTrainer(GRPOLearner(model, lora=lora_spec(args.rank, True, True, True), device="cpu",
                                        entropy_coef=0.0), steps=len(batches))
    for group in trainer.optimizer.param_groups:
        group.update(lr=args.lr, betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"], weight_decay=0.0)
    losses = []
    for step, rows in enumerate(batches):
        width = max(len(t) for t, _ in rows) - 1
        ids, targets = torch.zeros((len(rows), width), dtype=torch.long), torch.zeros((len(rows), width),
                                                                                        dtype=torch.long)
        weights, mask = torch.zeros((len(rows), width)), torch.zeros((len(rows), width), dtype=torch.long)
        total = sum(sum(w[1:]) for _, w in rows)
        for i, (tokens, w) in enumerate(rows):
            n = len(tokens) - 1
            ids[i, :n], targets[i, :n] = torch.tensor(tokens[:-1]), torch.tensor(tokens[1:])
            weights[i, :n], mask[i, :n] = torch.tensor(w[1:]) / total, 1
        logits = trainer.model(input_ids=ids, attention_mask=mask).logits.float()
        logp = torch.log_softmax(logits, -1).gather(2, targets[:, :, None]).squeeze(-1)
        loss = -(weights * logp).sum()
        loss.backward()
        clip_grad_norm(trainer.model, ADAM["grad_clip_norm"])
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        print(f"direct step {step:3d}  loss {losses[-1]:.4f}", flush=True)
    return losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--batch", type=int, default=32, help="examples per step")
    parser.add_argument("--digits", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--folder", default=None, help="the model, the service's folder and its log (default: a "
                                                       "temporary folder)")
    parser.add_argument("--no-direct", action="store_true", help="skip the direct run beside it")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    folder = work_folder(args.folder, "sft")
    started = time.monotonic()
    with serving(folder) as (service, model):
        training = service.create_lora_training_client(base_model=model, rank=args.rank)
        tokenizer = training.get_tokenizer()  # the base model folder's, loaded locally
        pairs = reverse_digits_pairs(args.steps * args.batch, args.digits, args.seed)
        rows = [encode(tokenizer, p, a) for p, a in pairs]
        batches = [rows[i * args.batch:(i + 1) * args.batch] for i in range(args.steps)]
        sdk = sdk_run(training, batches, args)
    sdk_s = time.monotonic() - started
    direct = [] if args.no_direct else direct_run(model, batches, args)
    tail = min(5, len(sdk))
    result = {"steps": args.steps, "batch": args.batch, "lr": args.lr, "rank": args.rank, "sdk_loss": sdk,
              "direct_loss": direct, "sdk_first": sdk[0], "sdk_last5": sum(sdk[-tail:]) / tail, "sdk_seconds": sdk_s}
    if direct:
        result["direct_last5"] = sum(direct[-tail:]) / tail
        result["ratios"] = {"sdk_over_direct_last5_loss": result["sdk_last5"] / result["direct_last5"]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
