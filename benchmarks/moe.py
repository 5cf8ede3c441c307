"""Mixture-of-experts rows of issue 50, on the tiny random-init Qwen3-MoE (8 experts, top-2, 2 layers; made
on first use, nothing downloaded), on CPU:

    python benchmarks/moe.py [--quick] [--seeds 0 1 2] [--routing-steps 60] [--push-steps 5] [--push-lr 4e-4]
                             [--learn-steps 1500] [--budget-s 400] [--ep-steps 5] [--ep-lr 1e-3]
                             [--skip routing push learning expert_parallel]

routing   configs/quickstart-moe.toml (`baton run`, the builder, each run its own process) at k = 0 (sync mode)
          and k = 8, `learner.routing_replay` "off" and "rollout", the torch engine in fp32, for
          `--routing-steps` versions: the mean and max over versions of metrics.jsonl's router_disagreement
          (share of (token, layer) pairs whose learner top-k differs from the rollout's) and logprob_gap
          (engine vs learner, per token), and router_drift (the learner's own top-k against the rollout's:
          what replay overrides). Expected, reported and not asserted: with replay at k = 0 a
          disagreement of 0 and a gap <= 1e-5.
push      the tiny MoE trained in process by AdamW (`--push-lr` 4e-4, weight decay 0: the quickstart learner's)
          on one short sequence per step (few tokens: top-2 of 8 experts leaves some experts without any
          gradient), `--push-steps` steps; per step the bytes of the version against the one before, packed as
          the engine holds it (bf16, and fp32), as `stages.weights.sparse.diff` sends it: full, element-sparse
          (`experts=False`) and expert-sparse (`experts=True`); each patch is applied to the base and must
          rebuild the version bit-exact. Beside it: the experts (per layer and fused tensor) that got no
          gradient in the step, and how many of those still changed (Adam's moments move an expert that had
          gradients before, even at weight decay 0).
learning  configs/quickstart-moe.toml at k = 8, replay "rollout" against "off", at each of `--seeds`: versions to
          a trailing (`--window` 20) mean train reward of 0.8; a run stops `--after` (20) versions past it, at
          `--learn-steps`, or at `--budget-s` (then not reached). The lowest trailing reward after the peak says
          whether a run collapsed.
expert_parallel
          the learner at `learner.expert_parallel = 2` (two gloo ranks on loopback, spawned as the tests spawn
          them: FSDP2 dense parts, each rank half of every layer's experts, tokens sent by all-to-all) against
          one process, `--ep-steps` AdamW steps (`--ep-lr`) on the same torch-engine groups with routing replay:
          the largest absolute difference of any weight after the steps (goal <= 1e-5), and the bytes rank 0
          holds of the experts' parameters + gradients + AdamW state, and of the whole model's, against one
          process's (goal for the experts <= 0.55). Step seconds are reported, not a goal (2 shared cores).

`--quick` is a smoke form: one push step, two expert-parallel steps and one 4-version routing run (k = 0,
replay on).

Last stdout line: one JSON object with "rows" and "ratios": expert_sparse_vs_element_sparse_bf16 and _fp32 (bytes,
summed over steps; goal <= 1), element_sparse_vs_full_bf16 / _fp32, expert_sparse_vs_full_bf16 / _fp32;
router_disagreement_k{0,8}_{off,rollout} and logprob_gap_k{...} (means); with the learning rows
versions_replay_on_vs_off_k8 (worst seed on over worst seed off; None where a side did not reach the target at
every seed) and reached_on / reached_off (fractions); with the expert-parallel rows ep2_vs_1_max_weight_diff,
expert_state_per_rank_vs_one, model_state_per_rank_vs_one and ep2_step_s_vs_one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = "configs/quickstart-moe.toml"
QUIET = ["telemetry.progress=false", "telemetry.log_level='warning'", "checkpoint.every=0", "model.dtype='float32'"]


# ---------------------------------------------------------------- runs of the MoE quickstart


def start_run(root: Path, name: str, k: int, replay: str, steps: int, seed: int = 0) -> tuple[subprocess.Popen, Path]:
    """`baton run` of the MoE quickstart at k (0: sync mode) with routing replay `replay`; its log file."""
    mode = ["mode='sync'", "staleness.k=0"] if k == 0 else [f"staleness.k={k}"]
    sets = [*mode, f"learner.routing_replay='{replay}'", f"seed={seed}", f"steps={steps}", f"run_root='{root}'",
            f"name='{name}'", *QUIET]
    cmd = [sys.executable, "-m", "baton.cli", "run", CONFIG, *[x for s in sets for x in ("--set", s)]]
    log = root / f"{name}.log"
    with log.open("w") as sink:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT), log


def records(root: Path, name: str) -> list[dict]:
    path = next(iter(sorted(root.glob(f"{name}-2*/metrics.jsonl"))), None)
    if path is None:
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def routing_row(root: Path, k: int, replay: str, steps: int) -> dict:
    name = f"routing-k{k}-{replay}"
    proc, log = start_run(root, name, k, replay, steps)
    proc.wait()
    got = [r for r in records(root, name) if "router_disagreement" in r]
    if not got:
        return {"row": "routing", "k": k, "replay": replay, "error": log.read_text()[-800:]}
    disagreement = [r["router_disagreement"] for r in got]
    gap = [r["logprob_gap"] for r in got]
    return {"row": "routing", "k": k, "replay": replay, "versions": len(got),
            "router_disagreement_mean": statistics.fmean(disagreement), "router_disagreement_max": max(disagreement),
            "logprob_gap_mean": statistics.fmean(gap), "logprob_gap_max": max(gap),
            "router_drift_mean": statistics.fmean(r.get("router_drift", 0.0) for r in got),
            "staleness_mean": statistics.fmean(r.get("staleness_mean", 0.0) for r in got)}


def trailing(rewards: list[float], window: int) -> list[float]:
    return [statistics.fmean(rewards[max(0, i + 1 - window): i + 1]) for i in range(len(rewards))]


def learning_row(root: Path, seed: int, replay: str, k: int, a: argparse.Namespace) -> dict:
    """Versions to a trailing reward of `a.target` at staleness bound k; the run is stopped `a.after` versions
    after it."""
    name, started = f"learn-k{k}-s{seed}-{replay}", time.perf_counter()
    proc, log = start_run(root, name, k, replay, a.learn_steps, seed)
    reached = None
    while proc.poll() is None:
        time.sleep(1.0)
        values = trailing([r["reward"] for r in records(root, name)], a.window)
        reached = next((i for i, v in enumerate(values) if i + 1 >= a.window and v >= a.target), None)
        if (reached is not None and len(values) > reached + a.after) or time.perf_counter() - started > a.budget_s:
            proc.terminate()
            proc.wait(60)
    got = records(root, name)
    if not got:
        return {"row": "learning", "k": k, "seed": seed, "replay": replay, "error": log.read_text()[-800:]}
    values = trailing([r["reward"] for r in got], a.window)
    hit = next((i for i, v in enumerate(values) if i + 1 >= a.window and v >= a.target), None)
    peak = max(range(len(values)), key=values.__getitem__)
    return {"row": "learning", "k": k, "seed": seed, "replay": replay, "reached": hit is not None,
            "versions_to_target": got[hit]["version"] if hit is not None else None, "versions_run": len(got),
            "final_trailing": round(values[-1], 4), "peak_trailing": round(values[peak], 4),
            "lowest_after_peak": round(min(values[peak:]), 4),
            "router_disagreement_mean": statistics.fmean(r.get("router_disagreement", 0.0) for r in got),
            "wall_s": round(time.perf_counter() - started, 1)}


# ---------------------------------------------------------------- push bytes after real AdamW steps


def quickstart_model() -> Path:
    """The quickstart's model folder, made as its config makes it."""
    from baton.schema import load_run_config

    with_root = load_run_config(ROOT / CONFIG).model
    return Path(type(with_root)(**{**with_root.model_dump(), "path": str(ROOT / with_root.path)}).make())


def push_rows(steps: int, lr: float = 4e-4) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    path = quickstart_model()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    before, rows = clone_state(model), []
    for step in range(1, steps + 1):
        tokens = torch.randint(0, model.config.vocab_size, (1, 6), generator=g)
        model(input_ids=tokens, labels=tokens).loss.backward()
        idle = idle_experts(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        after = clone_state(model)
        row = {"row": "push", "lr": lr, "step": step, **idle_changed(idle, before, after)}
        for dtype in (torch.bfloat16, torch.float32):
            row |= {f"{k}_{str(dtype).removeprefix('torch.')}": v for k, v in push_bytes(before, after, dtype).items()}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        before = after
    return rows


def clone_state(model) -> dict:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def idle_experts(model) -> dict[str, list[int]]:
    """Per fused expert parameter, the experts whose gradient is all zero in this step."""
    out = {}
    for name, p in model.named_parameters():
        if "experts" in name.split(".") and p.dim() >= 3:
            grad = p.grad if p.grad is not None else p.new_zeros(p.shape)
            out[name] = [e for e in range(p.shape[0]) if not bool(grad[e].any())]
    return out


def idle_changed(idle: dict[str, list[int]], before: dict, after: dict) -> dict:
    """How many (tensor, expert) slices had no gradient, how many of them still moved (fp32, and in bf16),
    and how many expert slices stayed bit-identical in all."""
    moved32 = moved16 = same32 = same16 = slices = 0
    for name, experts in idle.items():
        b, a = before[name], after[name]
        slices += b.shape[0]
        for e in range(b.shape[0]):
            same32 += bool(torch_equal(b[e], a[e]))
            same16 += bool(torch_equal(b[e].bfloat16(), a[e].bfloat16()))
        moved32 += sum(not torch_equal(b[e], a[e]) for e in experts)
        moved16 += sum(not torch_equal(b[e].bfloat16(), a[e].bfloat16()) for e in experts)
    return {"expert_slices": slices, "no_grad_slices": sum(map(len, idle.values())),
            "no_grad_moved_fp32": moved32, "no_grad_moved_bf16": moved16,
            "unchanged_slices_fp32": same32, "unchanged_slices_bf16": same16}


def torch_equal(x, y) -> bool:
    import torch

    return torch.equal(x, y)


def push_bytes(before: dict, after: dict, dtype) -> dict:
    """Bytes of `after` against `before` as the engine would receive them in `dtype`: full, element-sparse,
    expert-sparse (one bucket of 4 MiB, the delta transport's default); each patch rebuilt and checked."""
    import numpy as np

    from stages.weights.layout import plan
    from stages.weights.sparse import Slots, Versions, diff, engine_tensors

    versions = Versions()
    for version, state in ((1, before), (2, after)):
        versions.add(version, state, plan(version, engine_tensors(state, dtype), 4 << 20))
    layout, base, new = versions.layout, versions.get(1).copy(), versions.get(2)
    out = {"full": layout.total}
    for key, experts in (("element_sparse", False), ("expert_sparse", True)):
        patch, pieces = diff(layout, new, base, 1, 0, experts=experts)
        slots = Slots([base.copy(), np.zeros_like(base)])
        slots.holds = [1, -1]
        rebuilt = slots.rebuild(0, layout, patch, np.concatenate(pieces))
        assert np.array_equal(rebuilt[: layout.total], new[: layout.total]), "a patch did not rebuild bit-exact"
        out[key] = sum(p.nbytes for p in pieces)
        out[f"{key}_forms"] = sorted({p.inner or p.form for p in patch.parts} | {p.form for p in patch.parts})
    moved = int(np.count_nonzero(base[: layout.total] != new[: layout.total]))
    out["changed_bytes_frac"] = round(moved / layout.total, 5)
    return out


# ---------------------------------------------------------------- the expert-parallel learner against one rank


def expert_parallel_rows(steps: int, lr: float) -> list[dict]:
    """`steps` optimizer steps of the learner at `learner.expert_parallel = 2` (two spawned gloo ranks on
    loopback: FSDP2 dense parts, each rank half of every layer's experts, tokens by all-to-all; started as the
    tests start them, `tests.helpers.learner_ranks.ranked_trainer`) against one process, on the same groups
    the torch engine generated (routing replay "rollout", fp32, micro-batches of 24 tokens; every other step one
    group only, so rank 1 runs empty passes): per step the loss and grad norm of both, then the largest
    absolute difference of every weight, and the bytes rank 0 holds (expert parameters + gradients + AdamW
    state; the whole model's) against one process's."""
    from dataclasses import replace

    from sharded_learner import state_bytes

    from stages.learner import GRPOLearner
    from stages.learner.step import PolicyTrainer
    from tests.helpers.learner_ranks import ranked_trainer
    from tests.stages.learner.test_experts import expert_state_bytes, max_diff
    from tests.stages.learner.test_replay import _generated_groups

    folder = quickstart_model()
    spec = GRPOLearner(folder, device="cpu", lr=lr, routing_replay="rollout", micro_batch_tokens=24)
    generated = _generated_groups(folder)
    one = PolicyTrainer(spec, 100)
    one.schedule(0)
    initial = {k: v.clone() for k, v in one.weights().items()}
    rows, seconds = [], {"one": 0.0, "ep2": 0.0}
    with ranked_trainer(replace(spec, expert_parallel=2)) as two:
        for step in range(1, steps + 1):
            batches = generated if step % 2 else generated[:1]
            started = time.perf_counter()
            a = one.train(batches, 0.0)
            seconds["one"] += time.perf_counter() - started
            started = time.perf_counter()
            b = two.train(batches, 0.0)
            seconds["ep2"] += time.perf_counter() - started
            row = {"row": "expert_parallel_step", "step": step, "groups": len(batches)}
            row |= {f"{k}_{side}": m[k] for k in ("loss", "grad_norm", "router_disagreement")
                    for side, m in (("one", a), ("ep2", b))}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        single, sharded = one.weights(), two.weights()
        per_rank = {"experts": expert_state_bytes(two.trainer), "model": state_bytes(two.trainer)}
    reference = {"experts": expert_state_bytes(one), "model": state_bytes(one)}
    worst = max(single, key=lambda k: float((single[k] - sharded[k]).abs().max()))
    rows.append({"row": "expert_parallel", "degree": 2, "steps": steps, "lr": lr,
                 "max_weight_diff": max_diff(single, sharded), "worst_tensor": worst,
                 "max_weight_moved": max_diff(single, initial),
                 "expert_state_bytes_rank0": per_rank["experts"], "expert_state_bytes_one": reference["experts"],
                 "model_state_bytes_rank0": per_rank["model"], "model_state_bytes_one": reference["model"],
                 "step_s_one": round(seconds["one"] / steps, 3), "step_s_ep2": round(seconds["ep2"] / steps, 3)})
    return rows


# ---------------------------------------------------------------- summary


def ratios(rows: list[dict]) -> dict:
    out: dict[str, float | None] = {}
    push = [r for r in rows if r["row"] == "push"]
    for d in ("bfloat16", "float32"):
        if push:
            kinds = ("full", "element_sparse", "expert_sparse")
            full, element, expert = (sum(r[f"{k}_{d}"] for r in push) for k in kinds)
            short = "bf16" if d == "bfloat16" else "fp32"
            out[f"expert_sparse_vs_element_sparse_{short}"] = round(expert / element, 4)
            out[f"element_sparse_vs_full_{short}"] = round(element / full, 4)
            out[f"expert_sparse_vs_full_{short}"] = round(expert / full, 4)
    for r in rows:
        if r["row"] == "routing" and "error" not in r:
            out[f"router_disagreement_k{r['k']}_{r['replay']}"] = round(r["router_disagreement_mean"], 6)
            out[f"logprob_gap_k{r['k']}_{r['replay']}"] = float(f"{r['logprob_gap_mean']:.3g}")
    for r in rows:
        if r["row"] == "expert_parallel":
            out["ep2_vs_1_max_weight_diff"] = float(f"{r['max_weight_diff']:.3g}")
            out["expert_state_per_rank_vs_one"] = round(r["expert_state_bytes_rank0"] / r["expert_state_bytes_one"], 4)
            out["model_state_per_rank_vs_one"] = round(r["model_state_bytes_rank0"] / r["model_state_bytes_one"], 4)
            out["ep2_step_s_vs_one"] = round(r["step_s_ep2"] / r["step_s_one"], 3)
    learn = {side: [r for r in rows if r["row"] == "learning" and r["k"] == 8 and r["replay"] == side]
             for side in ("rollout", "off")}
    if learn["rollout"] and learn["off"]:
        worst = {s: max((r["versions_to_target"] for r in rs), default=None) if all(r.get("reached") for r in rs)
                 else None for s, rs in learn.items()}
        out["versions_replay_on_vs_off_k8"] = (round(worst["rollout"] / worst["off"], 3)
                                               if worst["rollout"] and worst["off"] else None)
        out["reached_on"] = round(sum(bool(r.get("reached")) for r in learn["rollout"]) / len(learn["rollout"]), 3)
        out["reached_off"] = round(sum(bool(r.get("reached")) for r in learn["off"]) / len(learn["off"]), 3)
    at_k2 = [r for r in rows if r["row"] == "learning" and r["k"] == 2 and r["replay"] == "rollout"]
    if at_k2:  # the config's own bound, replay on: every seed must reach the target
        out["reached_k2_on"] = round(sum(bool(r.get("reached")) for r in at_k2) / len(at_k2), 3)
        worst = [r["versions_to_target"] for r in at_k2 if r.get("reached")]
        out["versions_k2_on_worst"] = max(worst) if len(worst) == len(at_k2) else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke form: one push step, one 4-version routing run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--routing-steps", type=int, default=60)
    parser.add_argument("--push-steps", type=int, default=5)
    parser.add_argument("--push-lr", type=float, default=4e-4, help="AdamW's for the push rows (the quickstart's)")
    parser.add_argument("--learn-steps", type=int, default=1500)
    parser.add_argument("--budget-s", type=float, default=400.0, help="wall seconds per learning run")
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--learn-k", type=int, nargs="+", default=[8, 2],
                        help="staleness bounds of the learning rows (k = 8: replay on and off; others: on only)")
    parser.add_argument("--after", type=int, default=20, help="versions a learning run goes on past the target")
    parser.add_argument("--ep-steps", type=int, default=5, help="optimizer steps of the expert-parallel rows")
    parser.add_argument("--ep-lr", type=float, default=1e-3, help="AdamW's for the expert-parallel rows")
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["routing", "push", "learning", "expert_parallel"])
    a = parser.parse_args()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
        root = Path(tmp)
        if "push" not in a.skip:
            rows += push_rows(1 if a.quick else a.push_steps, a.push_lr)
        if "expert_parallel" not in a.skip:
            rows += expert_parallel_rows(2 if a.quick else a.ep_steps, a.ep_lr)
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        cells = [(0, "rollout")] if a.quick else [(k, r) for k in (0, 8) for r in ("off", "rollout")]
        if "routing" not in a.skip:
            for k, replay in cells:
                rows.append(routing_row(root, k, replay, 4 if a.quick else a.routing_steps))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if "learning" not in a.skip and not a.quick:
            for k in a.learn_k:
                for seed in a.seeds:
                    for replay in ("rollout", "off") if k == 8 else ("rollout",):
                        rows.append(learning_row(root, seed, replay, k, a))
                        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "moe", "rows": rows, "ratios": ratios(rows)}))


if __name__ == "__main__":
    main()
