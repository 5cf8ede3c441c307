"""A reward function that records the process settings a stage sees (`torch.get_num_threads()` in the worker
thread it is called from, `OMP_NUM_THREADS`) into the JSON file `$BATON_THREAD_PROBE`, then scores
reverse-digits exactly. `python tests/helpers/thread_probe.py RUN_ROOT MODEL STEPS`: the README's Python
quickstart with this reward, as a DSL user runs it (no `baton` module imported); prints the summary's JSON."""

from __future__ import annotations

import json
import os
import sys


def score(completion: str, answer: str) -> float:
    import torch

    path = os.environ.get("BATON_THREAD_PROBE")
    if path:
        with open(path, "w") as f:
            json.dump({"torch_threads": torch.get_num_threads(),
                       "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}, f)
    return float(completion.strip() == answer.strip())


def main(run_root: str, model_path: str, steps: int) -> None:
    from buffers import MemoryStore, RefBuffer
    from pipeline import Pipeline
    from policies import MaxStaleness
    from stages import GRPOLearner, Rollout, TorchEngine, make_tiny_model, tasks

    model = make_tiny_model(model_path)
    pipe = Pipeline(
        name="quickstart",
        producer=Rollout(tasks.ReverseDigits(digits=2), [TorchEngine(model)], tokenizer=model, group_size=8,
                         reward="tests.helpers.thread_probe:score"),
        buffer=RefBuffer(MemoryStore(), max_bytes=256 << 20),
        consumer=GRPOLearner(model, lr=4e-4, groups_per_step=16, weights="inproc"),
        staleness=MaxStaleness(k=2, on_stale="drop"),
        steps=steps, run_root=run_root, progress=False,
    )
    print(json.dumps(pipe.run()), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
