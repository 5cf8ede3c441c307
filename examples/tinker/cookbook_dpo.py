"""The tinker-cookbook's own DPO loop (`tinker_cookbook.preference.train_dpo.main`) against `baton serve`, unchanged.

    tools/tinker-cookbook/install.sh             # .venv-cookbook: tinker-cookbook 0.5.8 (cookbook_sft.py says why)
    .venv-cookbook/bin/python examples/tinker/cookbook_dpo.py [--pairs 32] [--epochs 10] [--lr 3e-3]

The preference data is made here and read by the cookbook's own builders: a JSONL of labelled comparisons
(`ComparisonBuilderFromJsonl`: the prompt `37>`, one completion the reversed digits `73`, the other the digits
unchanged `37`, which of A and B is the right one drawn at random and named by the label), turned into
chosen/rejected datum pairs by `DPODatasetBuilderFromComparisons` with the `qwen3_instruct` renderer. The loop
is the recipe's: a reference sampling client of the initial adapter (`save_weights_and_get_sampling_client`),
its logprobs of both completions (`compute_logprobs`), the DPO loss through `forward_backward_custom`, then
`optim_step`, and its final checkpoint. As in dpo.py, the same `--pairs` comparisons are trained on for
`--epochs` passes (one batch of all of them per epoch unless `--batch` is smaller; the cookbook reshuffles each
epoch).

The service is run by `--baton-python` (default: the `python` on PATH), as in cookbook_sft.py; with
`TINKER_BASE_URL`, `TINKER_API_KEY` and `TINKER_BASE_MODEL` set, the loop trains on that service instead.
The last line is a JSON object: the recipe's per-step `dpo_loss`, `accuracy` (the fraction of pairs whose
chosen completion the policy prefers more than the reference does) and `margin`, and the final checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_cookbook_arguments, baton_service, work_folder  # noqa: E402

RENDERER = "qwen3_instruct"  # ChatML without a thinking block: every special it writes is a tiny-model token


def write_comparisons(path: Path, count: int, digits: int, seed: int) -> Path:
    """`count` labelled comparisons in the cookbook's JSONL form: the reversed digits against the digits as
    given (a palindrome is drawn again: its two completions would be the same)."""
    rng = random.Random(seed)
    with path.open("w") as out:
        while count:
            text = "".join(rng.choice("0123456789") for _ in range(digits))
            if text == text[::-1]:
                continue
            right, wrong = [{"role": "assistant", "content": text[::-1]}], [{"role": "assistant", "content": text}]
            first = rng.random() < 0.5
            comparison = {"prompt_conversation": [{"role": "user", "content": f"{text}>"}],
                          "completion_A": right if first else wrong, "completion_B": wrong if first else right}
            out.write(json.dumps({"comparison": comparison, "label": "A" if first else "B"}) + "\n")
            count -= 1
    return path


def recipe_config(args, base_url: str | None, model: str, data: Path, log_path: Path):
    """The cookbook's DPO `Config` over the local comparison file: `--epochs` passes, constant learning rate, no
    periodic saves or evaluations."""
    from tinker_cookbook.preference import train_dpo
    from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
    from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=model, renderer_name=RENDERER,
                                            max_length=64, batch_size=args.batch)
    builder = DPODatasetBuilderFromComparisons(common_config=common,
                                               comparison_builder=ComparisonBuilderFromJsonl(train_path=str(data)))
    return train_dpo.Config(log_path=str(log_path), model_name=model, recipe_name="baton_cookbook_dpo",
                            dataset_builder=builder, renderer_name=RENDERER, learning_rate=args.lr,
                            lr_schedule="constant", dpo_beta=args.beta, lora_rank=args.rank, base_url=base_url,
                            num_epochs=args.epochs, save_every=0, eval_every=0, infrequent_eval_every=0)


def read_run(log_path: Path) -> dict:
    """The recipe's figures from its own files: `metrics.jsonl` (one line per step) and `checkpoints.jsonl`."""
    steps = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    checkpoints = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()
                   if line.strip()]
    return {key: [s[key] for s in steps if key in s] for key in ("dpo_loss", "accuracy", "margin")} | {
        "final_checkpoint": checkpoints[-1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=32, help="labelled comparisons made")
    parser.add_argument("--epochs", type=int, default=10, help="passes over them")
    parser.add_argument("--batch", type=int, default=32, help="comparisons per step")
    parser.add_argument("--digits", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--beta", type=float, default=0.1, help="DPO's beta")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--seed", type=int, default=0)
    add_cookbook_arguments(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    from tinker_cookbook.preference import train_dpo

    folder = work_folder(args.folder, "cookbook-dpo")
    data = write_comparisons(folder / "comparisons.jsonl", args.pairs, args.digits, args.seed)
    log_path = folder / "recipe"
    shutil.rmtree(log_path, ignore_errors=True)  # the recipe resumes from a log folder's checkpoints.jsonl
    if os.environ.get("TINKER_BASE_URL"):
        train_dpo.main(recipe_config(args, None, os.environ["TINKER_BASE_MODEL"], data, log_path))
    else:
        with baton_service(folder, python=args.baton_python) as (base_url, api_key, model):
            os.environ["TINKER_API_KEY"] = api_key  # the recipe builds its own ServiceClient(base_url=...)
            train_dpo.main(recipe_config(args, base_url, model, data, log_path))
    print(json.dumps({"pairs": args.pairs, "epochs": args.epochs, "batch": args.batch, "lr": args.lr, "beta": args.beta,
                      "renderer": RENDERER, **read_run(log_path)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
