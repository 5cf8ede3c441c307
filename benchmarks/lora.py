"""LoRA against full fine-tuning, on this machine: what a version costs to push, what a step costs, whether the
engine serves exactly the learner's adapter, and how soon each learns the quickstart.

    python benchmarks/lora.py [--rank 8] [--steps 5] [--pushes 5] [--learning-steps 500] [--skip-learning]
                              [--sglang]

- push bytes and time: the math example's model (tools/make_math_example.py's, random init), one version
  after each of `--pushes` learner steps, full weights against the rank-`--rank` adapter on q/k/v/o (the
  `[learner] lora` default), through `inproc` into a torch engine in this process and through
  `mooncake_p2p` into a torch engine process (tests/helpers/p2p_peer.py); an adapter's push time includes
  the engine's merge and its parity probe (goal: bytes <= 0.05 of a full push);
- learner step time, LoRA over full fine-tuning, on the same groups (median of `--steps`);
- logprob difference engine vs learner after a push: sampled completions' logprobs against the learner's
  teacher-forced ones (goal <= 1e-5), on the torch engine and, with `--sglang`, on an SGLang server;
- time to reward 0.8 on the quickstart (configs/quickstart.toml against configs/quickstart-lora.toml, the
  first version whose trailing 10-version mean reward reaches 0.8): seconds and versions, reported.

Last stdout line: one JSON object with "figures" and "ratios": push_bytes_lora_vs_full,
push_s_lora_vs_full (inproc and mooncake_p2p), step_s_lora_vs_full, logprob_diff_engine_vs_learner (and
_sglang), time_to_reward_0_8_lora_vs_full, versions_to_reward_0_8_lora_vs_full.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from make_math_example import make_qwen_like_model  # noqa: E402

from baton.builder import build_pipeline  # noqa: E402
from baton.config import load_toml, validate  # noqa: E402
from baton.schema import RunConfig  # noqa: E402
from stages.engines.base import SamplingParams  # noqa: E402
from stages.engines.torch import TorchEngine  # noqa: E402
from stages.learner import GRPOLearner  # noqa: E402
from stages.learner.lora import LoraSpec  # noqa: E402
from stages.learner.step import PolicyTrainer  # noqa: E402
from stages.weights import make_transport  # noqa: E402
from tests.helpers.engines import teacher_forced_logprobs  # noqa: E402
from tests.helpers.p2p_peer import PeerProcess  # noqa: E402
from tests.stages.learner.test_ranks import groups  # noqa: E402

PROMPT = [5, 9, 12, 40, 7]
TARGET_REWARD = 0.8


def trainers(model: Path, rank: int) -> dict[str, PolicyTrainer]:
    made = {"full": PolicyTrainer(GRPOLearner(model, device="cpu", lr=1e-3), 1000),
            "lora": PolicyTrainer(GRPOLearner(model, device="cpu", lr=1e-2, lora=LoraSpec(rank=rank)), 1000)}
    for trainer in made.values():
        trainer.schedule(0)
    return made


def step_seconds(trainer: PolicyTrainer, steps: int) -> float:
    seconds = []
    for step in range(steps):
        t0 = time.perf_counter()
        trainer.train(groups(step), 1.0)
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds[1:] or seconds)


async def pushes(trainer: PolicyTrainer, model: Path, kind: str, n: int) -> dict:
    """`n` versions (a step before each) through `kind` into a fresh torch engine: seconds and bytes."""
    transport = make_transport(kind)
    engine, peer = None, None
    if kind == "inproc":
        engine = TorchEngine(model, name=f"bench-{kind}")
        await engine.start()
        transport.subscribe(engine)
    else:
        peer = PeerProcess(model, f"bench-{kind}")
        transport.subscribe(transport.remote_receiver(peer, peer.name))
    seconds = []
    try:
        for version in range(1, n + 2):
            trainer.train(groups(100 + version), 1.0)
            tensors = trainer.weights(version)
            t0 = time.perf_counter()
            await transport.publish(version, tensors)
            if version > 1:  # the first sets up the link (hello, slots) and is not counted
                seconds.append(time.perf_counter() - t0)
        bytes_per_version = transport.stats["bytes"] / (n + 1)
    finally:
        await transport.close()
        if engine is not None:
            await engine.stop()
        if peer is not None:
            peer.stop()
    return {"push_s": round(statistics.median(seconds), 5), "bytes": int(bytes_per_version)}


async def engine_parity(trainer: PolicyTrainer, engine, version: int) -> float:
    """Push `version` of the LoRA learner into `engine`, sample 16 completions, compare logprobs."""
    await engine.receive_weights(version, trainer.weights(version))
    trainer.model.eval()
    worst = 0.0
    for c in await engine.generate([PROMPT] * 16, SamplingParams(max_new_tokens=16)):
        want = teacher_forced_logprobs(trainer.model, PROMPT, c.tokens)
        worst = max(worst, float((torch.from_numpy(c.logprobs) - want).abs().max()))
    trainer.model.train()
    return worst


async def parities(trainer: PolicyTrainer, model: Path, sglang: bool, logs: Path) -> dict:
    engine = TorchEngine(model, name="bench-parity")
    await engine.start()
    out = {"logprob_diff_engine_vs_learner": await engine_parity(trainer, engine, 1000)}
    merge_s = engine.stats["merge_s"]
    await engine.stop()
    out["torch_merge_and_probe_s"] = merge_s
    if sglang:
        from stages.engines.sglang import SGLangEngine
        from stages.engines.sglang_lora import LoraServing

        spec = trainer.spec.lora
        server = SGLangEngine(model, name="bench-sglang", log_dir=logs,
                              lora=LoraServing(spec.rank, tuple(spec.target_modules), 4))
        await server.start()
        try:
            out["logprob_diff_engine_vs_learner_sglang"] = await engine_parity(trainer, server, 1001)
            t0 = time.perf_counter()
            trainer.train(groups(999), 1.0)
            await server.receive_weights(1002, trainer.weights(1002))
            out["sglang_load_and_probe_s"] = round(time.perf_counter() - t0, 4)
        finally:
            await server.stop()
    return out


def time_to_reward(config: str, steps: int, root: Path) -> dict:
    """Run `config` for `steps` versions; the first version whose trailing 10-version mean reward reaches
    TARGET_REWARD, and the run's seconds to it (None: not reached)."""
    data = load_toml(ROOT / "configs" / config)
    data.update(steps=steps, run_root=str(root), model={"path": str(root / "tiny-qwen2")},
                telemetry={"progress": False, "log_level": "warning"}, checkpoint={"every": 0})
    summary = build_pipeline(validate(RunConfig, data)).run()
    metrics = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    for i in range(len(metrics)):
        window = metrics[max(0, i - 9): i + 1]
        if len(window) == 10 and statistics.mean(m["reward"] for m in window) >= TARGET_REWARD:
            return {"version": metrics[i]["version"], "seconds": metrics[i]["t"], "reward_end": summary["reward_end"]}
    return {"version": None, "seconds": None, "reward_end": summary["reward_end"]}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--pushes", type=int, default=5)
    p.add_argument("--learning-steps", type=int, default=500)
    p.add_argument("--skip-learning", action="store_true")
    p.add_argument("--sglang", action="store_true", help="also the logprob parity on an SGLang server (~1-2 min start)")
    a = p.parse_args()
    torch.set_num_threads(1)
    figures, ratios = {}, {}
    with tempfile.TemporaryDirectory(prefix="baton-lora-") as tmp:
        model = make_qwen_like_model(Path(tmp) / "math-model")
        made = trainers(model, a.rank)
        step = {kind: step_seconds(t, a.steps) for kind, t in made.items()}
        figures["step_s"] = {k: round(v, 4) for k, v in step.items()}
        ratios["step_s_lora_vs_full"] = ratio(step["lora"], step["full"])
        for kind in ("inproc", "mooncake_p2p"):
            pushed = {name: anyio.run(pushes, t, model, kind, a.pushes) for name, t in made.items()}
            figures[f"push_{kind}"] = pushed
            ratios[f"push_bytes_lora_vs_full_{kind}"] = ratio(pushed["lora"]["bytes"], pushed["full"]["bytes"])
            ratios[f"push_s_lora_vs_full_{kind}"] = ratio(pushed["lora"]["push_s"], pushed["full"]["push_s"])
        figures["parity"] = anyio.run(parities, made["lora"], model, a.sglang, Path(tmp) / "logs")
        ratios.update({k: v for k, v in figures["parity"].items() if k.startswith("logprob_diff")})
        if not a.skip_learning:
            learned = {kind: time_to_reward(config, a.learning_steps, Path(tmp) / kind)
                       for kind, config in (("full", "quickstart.toml"), ("lora", "quickstart-lora.toml"))}
            figures["to_reward_0_8"] = learned
            ratios["time_to_reward_0_8_lora_vs_full"] = ratio(learned["lora"]["seconds"], learned["full"]["seconds"])
            ratios["versions_to_reward_0_8_lora_vs_full"] = ratio(learned["lora"]["version"],
                                                                  learned["full"]["version"])
    print(json.dumps(figures, indent=1), file=sys.stderr)
    print(json.dumps({"figures": figures, "ratios": ratios}))


if __name__ == "__main__":
    main()
