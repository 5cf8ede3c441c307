"""The math example in the Python DSL: your own model, data and reward.

    python tools/make_math_example.py runs/math-example   # once: a Qwen2-shaped model and the data
    python examples/math_dsl.py runs/math-example [STEPS]

A chat model (byte-level BPE tokenizer, no BOS, ChatML template) is trained with GRPO on math word
problems read from JSONL, scored by math-verify plus a small format reward, fully asynchronously;
the eval split is answered greedily every `eval_every` versions (eval.jsonl in the run folder).
"""

from __future__ import annotations

import sys
from pathlib import Path

from buffers import MemoryStore, RefBuffer
from pipeline import Pipeline
from policies import MaxStaleness
from stages import DatasetTask, GRPOLearner, RewardFunction, Rollout, TorchEngine
from stages.data.rewards import weighted_sum
from stages.rollout.evaluation import Evaluation


def math_pipeline(example: str | Path, steps: int = 60, run_root: str | Path = "runs", eval_every: int = 50,
                  **overrides) -> Pipeline:
    """The math example's pipeline over the folder `tools/make_math_example.py` wrote; every `eval_every`
    versions the eval split is answered greedily (the run folder's eval.jsonl)."""
    example = Path(example)
    model = example / "model"
    task = DatasetTask(
        example / "data" / "train.jsonl",
        prompt_field="question",            # sent as a user message through the chat template
        answer_field="answer",
        system_prompt="Answer with a number.",
        max_new_tokens=2,
        reward_function=RewardFunction(weighted_sum(("math_verify", 0.8), ("format_number", 0.2)), timeout_s=5),
        eval_path=example / "data" / "eval.jsonl",
    )
    settings = {"group_size": 8, "batch_groups": 8, "groups_per_step": 8, "lr": 4e-4} | overrides
    return Pipeline(
        name="math",
        producer=Rollout(task, [TorchEngine(model)], tokenizer=model, group_size=settings["group_size"],
                         batch_groups=settings["batch_groups"],
                         evaluation=Evaluation(task.eval_task(), every=eval_every)),
        buffer=RefBuffer(MemoryStore(), max_bytes=256 << 20),
        consumer=GRPOLearner(model, lr=settings["lr"], groups_per_step=settings["groups_per_step"]),
        staleness=MaxStaleness(k=2, on_stale="drop"),
        steps=steps,
        run_root=run_root,
    )


if __name__ == "__main__":
    pipe = math_pipeline(sys.argv[1], steps=int(sys.argv[2]) if len(sys.argv) > 2 else 60)
    summary = pipe.run()
    print("reward", summary["reward_start"], "->", summary["reward_end"], "eval", pipe.producer.stats.get("eval"))
