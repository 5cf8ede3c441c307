"""DPO through the official Tinker SDK's custom-loss path (`forward_backward_custom`) against `baton serve`.

    pip install -e '.[tinker]'
    python examples/tinker/dpo.py [--steps 10] [--pairs 32] [--beta 0.1] [--lr 3e-3] [--rank 8]

The preference pairs are made here from the quickstart's reverse-digits task: the prompt `37>`, chosen the
right answer `73`, rejected the digits unreversed `37` (each then the end token); nothing is downloaded.

`forward_backward_custom(data, loss)` runs the loss on the client: the SDK asks the service for each datum's
target logprobs (a `forward` with `cross_entropy`), computes the DPO loss here in torch, and sends its gradient
with respect to those logprobs back as the weights of a `cross_entropy` `forward_backward`, so the service
needs no loss of its own. The reference logprobs are the model's own before the first step (a LoRA adapter
starts as the identity: they are the base model's), read once with `forward`.

The loss per pair is -log sigmoid(beta * ((chosen - chosen_ref) - (rejected - rejected_ref))), where each term
is a sequence's summed logprob over its answer tokens; it starts at log 2 (0.693). Each step prints the mean
loss, the fraction of pairs whose chosen answer is preferred, and the mean margin; the last line is a JSON
object with the curves.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ADAM, serving, work_folder  # noqa: E402


def preference_pairs(count: int, digits: int, seed: int) -> list[tuple[str, str, str]]:
    """(prompt, chosen, rejected): `12>`, `21`, `12`; digits that read the same both ways are skipped."""
    rng, out = random.Random(seed), []
    while len(out) < count:
        text = "".join(rng.choice("0123456789") for _ in range(digits))
        if text != text[::-1]:
            out.append((f"{text}>", text[::-1], text))
    return out


def datum(tokenizer, prompt: str, answer: str):
    """A datum whose `weights` mark the answer's targets (1) and the prompt's (0): the custom loss reads them as
    the mask of the sequence logprob; the SDK sends them with the forward, where they do nothing."""
    from tinker import types

    head = list(tokenizer.encode(prompt, add_special_tokens=True))
    tail = list(tokenizer.encode(answer, add_special_tokens=False)) + [tokenizer.eos_token_id]
    tokens = head + tail
    weights = [0.0] * (len(head) - 1) + [1.0] * len(tail)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


def sequence_logprobs(data, logprobs_list) -> list:
    """Each datum's summed logprob over its answer targets (its `weights`)."""
    return [(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs_list, strict=True)]


def dpo_loss(reference: list[float], beta: float):
    """The custom loss for `forward_backward_custom`: data is chosen, rejected, chosen, rejected, ...; the mean
    DPO loss over the pairs, with accuracy and margin as metrics."""
    import torch

    def loss(data, logprobs_list):
        seq = sequence_logprobs(data, logprobs_list)
        ref = torch.tensor(reference)
        moved = torch.stack(seq) - ref
        margin = beta * (moved[0::2] - moved[1::2])
        value = -torch.nn.functional.logsigmoid(margin).mean()
        return value, {"dpo_loss": float(value.detach()), "accuracy": float((margin > 0).float().mean()),
                       "margin": float(margin.mean())}

    return loss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=32, help="preference pairs (each step trains on all)")
    parser.add_argument("--digits", type=int, default=2)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--folder", default=None, help="the model, the service's folder and its log (default: a "
                                                       "temporary folder)")
    args = parser.parse_args(argv)
    import torch
    from tinker import types

    torch.set_num_threads(1)
    folder = work_folder(args.folder, "dpo")
    curve = []
    with serving(folder) as (service, model):
        training = service.create_lora_training_client(base_model=model, rank=args.rank)
        tokenizer = training.get_tokenizer()
        data = [datum(tokenizer, p, a) for p, c, r in preference_pairs(args.pairs, args.digits, args.seed)
                for a in (c, r)]
        before = training.forward(data, "cross_entropy").result()
        reference = [float(x) for x in sequence_logprobs(
            data, [torch.tensor(o["logprobs"].data) for o in before.loss_fn_outputs])]
        loss = dpo_loss(reference, args.beta)
        adam = types.AdamParams(learning_rate=args.lr, **ADAM)
        for step in range(args.steps):
            fb = training.forward_backward_custom(data, loss)
            optim = training.optim_step(adam)
            metrics = fb.result().metrics
            optim.result()
            curve.append({k: round(metrics[k], 4) for k in ("dpo_loss", "accuracy", "margin")})
            print(f"step {step:3d}  loss {metrics['dpo_loss']:.4f}  accuracy {metrics['accuracy']:.2f}  "
                  f"margin {metrics['margin']:.3f}", flush=True)
    print(json.dumps({"pairs": args.pairs, "beta": args.beta, "lr": args.lr, "rank": args.rank, "curve": curve}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
