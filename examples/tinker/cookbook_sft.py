"""The tinker-cookbook's own SFT loop (`tinker_cookbook.supervised.train.main`) against `baton serve`, unchanged.

    tools/tinker-cookbook/install.sh             # .venv-cookbook: tinker-cookbook 0.5.8 (see below)
    .venv-cookbook/bin/python examples/tinker/cookbook_sft.py [--steps 30] [--batch 16] [--lr 1e-2]

Everything the cookbook needs is local: the tiny model's tokenizer is loaded from the served model's folder
(baton names the base model by its path, and the cookbook's `get_tokenizer` loads a folder with
`AutoTokenizer`), the data is the quickstart's reverse-digits task written here as a JSONL of chat
conversations (`{"messages": [user "37>", assistant "73"]}`), read by the cookbook's
`FromConversationFileBuilder` and rendered by its `qwen3_instruct` renderer (ChatML: the tiny tokenizer has
`<|im_start|>` and `<|im_end|>` as tokens; its character vocabulary has no newline, which becomes its unknown
token `?`, the same on every example). The loop is the recipe's: `forward_backward` with `cross_entropy` on
the renderer's datums (weight on the assistant's answer and its `<|im_end|>`, each example's weights summing
to 1), `optim_step` with its linear (here constant) schedule, a held-out NLL evaluation through a sampling
client, and its final `save_state` + `save_weights_for_sampler` checkpoint (`checkpoints.jsonl`).

tinker-cookbook 0.5.8 is the newest that installs from a registry without `tml-renderers>=0.4.1`; it pins
`transformers<=5.5.4`, older than the project's, so it lives in a venv of its own (`.venv-cookbook`, which
sees the project's packages but its own transformers). That transformers cannot build baton's models next to
the project's other packages, so the service is run by another Python: `--baton-python` (default: the
`python` on PATH), which also makes the tiny model. With `TINKER_BASE_URL`, `TINKER_API_KEY` and
`TINKER_BASE_MODEL` set, the loop trains on that service instead (`TINKER_BASE_MODEL` must then be a folder
with the tokenizer, or a name the cookbook can load).

The last line is a JSON object: the recipe's per-step `train_mean_nll`, its held-out `test/nll` before and
after, and the final checkpoint's paths.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_cookbook_arguments, baton_service, work_folder  # noqa: E402

RENDERER = "qwen3_instruct"  # ChatML without a thinking block: every special it writes is a tiny-model token


def write_conversations(path: Path, count: int, digits: int, seed: int) -> Path:
    """`count` reverse-digits chats (`12>` -> `21`) as the cookbook's conversation JSONL, one per line."""
    rng = random.Random(seed)
    with path.open("w") as out:
        for _ in range(count):
            text = "".join(rng.choice("0123456789") for _ in range(digits))
            messages = [{"role": "user", "content": f"{text}>"}, {"role": "assistant", "content": text[::-1]}]
            out.write(json.dumps({"messages": messages}) + "\n")
    return path


def recipe_config(args, base_url: str | None, model: str, data: Path, log_path: Path):
    """The cookbook's SFT `Config` over the local conversation file: constant learning rate, no periodic
    checkpoints, the held-out NLL at step 0 and at the end (`eval_every` = steps)."""
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=model, renderer_name=RENDERER,
                                            max_length=64, batch_size=args.batch)
    builder = FromConversationFileBuilder(common_config=common, file_path=str(data), test_size=args.test,
                                          shuffle_seed=args.seed)
    return train.Config(log_path=str(log_path), model_name=model, recipe_name="baton_cookbook_sft",
                        renderer_name=RENDERER, dataset_builder=builder, learning_rate=args.lr,
                        lr_schedule="constant", lora_rank=args.rank, base_url=base_url, save_every=0,
                        eval_every=args.steps - 1, infrequent_eval_every=0, max_steps=args.steps)


def read_run(log_path: Path) -> dict:
    """The recipe's figures from its own files: `metrics.jsonl` (one line per step) and `checkpoints.jsonl`."""
    steps = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_nll = [s["train_mean_nll"] for s in steps if "train_mean_nll" in s]
    test_nll = [s["test/nll"] for s in steps if "test/nll" in s]
    checkpoints = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()
                   if line.strip()]
    return {"train_mean_nll": train_nll, "test_nll": test_nll, "final_checkpoint": checkpoints[-1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16, help="conversations per step")
    parser.add_argument("--test", type=int, default=32, help="conversations held out for the NLL evaluation")
    parser.add_argument("--digits", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--seed", type=int, default=0)
    add_cookbook_arguments(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    from tinker_cookbook.supervised import train

    folder = work_folder(args.folder, "cookbook-sft")
    data = write_conversations(folder / "conversations.jsonl", args.steps * args.batch + args.test, args.digits,
                               args.seed)
    log_path = folder / "recipe"
    shutil.rmtree(log_path, ignore_errors=True)  # the recipe resumes from a log folder's checkpoints.jsonl
    if os.environ.get("TINKER_BASE_URL"):
        asyncio.run(train.main(recipe_config(args, None, os.environ["TINKER_BASE_MODEL"], data, log_path)))
    else:
        with baton_service(folder, python=args.baton_python) as (base_url, api_key, model):
            os.environ["TINKER_API_KEY"] = api_key  # the recipe builds its own ServiceClient(base_url=...)
            asyncio.run(train.main(recipe_config(args, base_url, model, data, log_path)))
    print(json.dumps({"steps": args.steps, "batch": args.batch, "lr": args.lr, "renderer": RENDERER,
                      **read_run(log_path)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
