"""The tinker-cookbook's own RL loop (`tinker_cookbook.rl.train.main`) against `baton serve`, unchanged.

    tools/tinker-cookbook/install.sh             # .venv-cookbook: tinker-cookbook 0.5.8 (cookbook_sft.py says why)
    .venv-cookbook/bin/python examples/tinker/cookbook_rl.py [--steps 16] [--groups 8] [--group-size 8] [--lr 1e-2]

The environment is the cookbook's single-turn `ProblemEnv` on the quickstart's reverse-digits task, built here
from local prompts (nothing downloaded): the question `37>`, rendered by the cookbook's `qwen3_instruct`
renderer as a ChatML user turn and a generation prompt; the answer parsed back by the same renderer (its stop
sequence is `<|im_end|>`, the tiny model's end token); the reward the fraction of the reversed digits right,
less the cookbook's format penalty (`--format-coef`, here 1.0 where the cookbook's default is 0.1) when the
answer does not end on the stop sequence within its 4 tokens. The loop is the
recipe's: each step saves the adapter for sampling (`save_weights_and_get_sampling_client`), samples
`--group-size` answers per prompt through baton's torch engine, centres rewards per group (the cookbook's
`compute_advantages`), assembles datums (`assemble_training_data`) and trains with `importance_sampling`, then
writes its final `save_state` + `save_weights_for_sampler` checkpoint.

What it learns in 16 steps is the format term: the random-init model ends 3 % of its answers on the stop
sequence at first and about all of them within 10 steps (reward -0.92 -> 0). Getting the digits right takes
hundreds of steps on this model (examples/tinker/rl.py, the same task through the bare SDK, reaches 0.8 mean
reward); with the format penalty at 1.0 the loop here settles on the shortest answer first, so the correctness
term stays near 0 in this budget.

The service is run by `--baton-python` (default: the `python` on PATH), as in cookbook_sft.py; with
`TINKER_BASE_URL`, `TINKER_API_KEY` and `TINKER_BASE_MODEL` set, the loop trains on that service instead.
The last line is a JSON object: the recipe's per-step mean reward (`env/all/reward/total`), correctness
(`env/all/correct`) and format (`env/all/format`: the fraction ending on the stop sequence), and the final
checkpoint's paths.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import chz
from tinker_cookbook import renderers
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_cookbook_arguments, baton_service, work_folder  # noqa: E402

RENDERER = "qwen3_instruct"  # ChatML without a thinking block: every special it writes is a tiny-model token


class ReverseDigitsEnv(ProblemEnv):
    """One reverse-digits question (`37>`); `check_answer` is the fraction of the reversed digits right, by
    position (the quickstart's reward), so a random-init model's group has rewards to tell apart."""

    def __init__(self, renderer: renderers.Renderer, digits: str, format_coef: float):
        super().__init__(renderer, format_coef=format_coef)
        self.digits = digits

    def get_question(self) -> str:
        return f"{self.digits}>"

    def check_answer(self, sample_str: str) -> float:  # the cookbook adds it to the reward as a float
        target = self.digits[::-1]
        return sum(a == b for a, b in zip(sample_str.strip(), target, strict=False)) / len(target)

    def check_format(self, sample_str: str) -> bool:
        return True  # the only format asked for is ending on the stop sequence, which the cookbook checks

    def get_reference_answer(self) -> str:
        return self.digits[::-1]


class ReverseDigitsDataset(RLDataset):
    """`batches` batches of `groups` prompts each, `group_size` episodes per prompt; the prompts fixed by `seed`."""

    def __init__(self, renderer: renderers.Renderer, batches: int, groups: int, group_size: int, digits: int,
                 seed: int, format_coef: float):
        rng = random.Random(seed)
        self.prompts = [["".join(rng.choice("0123456789") for _ in range(digits)) for _ in range(groups)]
                        for _ in range(batches)]
        self.renderer, self.group_size, self.format_coef = renderer, group_size, format_coef

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return [ProblemGroupBuilder(env_thunk=lambda d=d: ReverseDigitsEnv(self.renderer, d, self.format_coef),
                                    num_envs=self.group_size, dataset_name="reverse_digits")
                for d in self.prompts[index]]

    def __len__(self) -> int:
        return len(self.prompts)


@chz.chz
class ReverseDigitsBuilder(RLDatasetBuilder):
    """The recipe's dataset builder: the tokenizer from the model's folder, the cookbook's renderer over it."""

    model_name: str
    batches: int
    groups: int
    group_size: int
    digits: int = 2
    seed: int = 0
    format_coef: float = 0.1

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        renderer = renderers.get_renderer(RENDERER, get_tokenizer(self.model_name))
        return ReverseDigitsDataset(renderer, self.batches, self.groups, self.group_size, self.digits,
                                    self.seed, self.format_coef), None


def recipe_config(args, base_url: str | None, model: str, log_path: Path):
    """The cookbook's RL `Config`: `importance_sampling` (its default), no KL, no periodic saves or evals."""
    from tinker_cookbook.rl import train

    builder = ReverseDigitsBuilder(model_name=model, batches=args.steps, groups=args.groups,
                                   group_size=args.group_size, digits=args.digits, seed=args.seed,
                                   format_coef=args.format_coef)
    return train.Config(learning_rate=args.lr, dataset_builder=builder, model_name=model,
                        recipe_name="baton_cookbook_rl", max_tokens=args.digits + 2, log_path=str(log_path),
                        renderer_name=RENDERER, lora_rank=args.rank, base_url=base_url, eval_every=0,
                        save_every=0, num_groups_to_log=0, rollout_json_export=False, max_steps=args.steps)


def read_run(log_path: Path) -> dict:
    """The recipe's figures from its own files: `metrics.jsonl` (one line per step) and `checkpoints.jsonl`."""
    steps = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    checkpoints = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()
                   if line.strip()]
    return {"reward": [s["env/all/reward/total"] for s in steps if "env/all/reward/total" in s],
            "correct": [s["env/all/correct"] for s in steps if "env/all/correct" in s],
            "format": [s["env/all/format"] for s in steps if "env/all/format" in s],
            "final_checkpoint": checkpoints[-1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--groups", type=int, default=8, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="answers sampled per prompt")
    parser.add_argument("--digits", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format-coef", type=float, default=1.0,
                        help="the cookbook's format penalty for an answer that does not end on the stop sequence")
    add_cookbook_arguments(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    from tinker_cookbook.rl import train

    folder = work_folder(args.folder, "cookbook-rl")
    log_path = folder / "recipe"
    shutil.rmtree(log_path, ignore_errors=True)  # the recipe resumes from a log folder's checkpoints.jsonl
    if os.environ.get("TINKER_BASE_URL"):
        asyncio.run(train.main(recipe_config(args, None, os.environ["TINKER_BASE_MODEL"], log_path)))
    else:
        with baton_service(folder, python=args.baton_python) as (base_url, api_key, model):
            os.environ["TINKER_API_KEY"] = api_key  # the recipe builds its own ServiceClient(base_url=...)
            asyncio.run(train.main(recipe_config(args, base_url, model, log_path)))
    print(json.dumps({"steps": args.steps, "groups": args.groups, "group_size": args.group_size, "lr": args.lr,
                      "renderer": RENDERER, **read_run(log_path)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
