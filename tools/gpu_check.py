"""The device check (`tools/gpu-check.sh` runs it when a session is lent a GPU): baton's own engine,
learner step and sparse weight deltas on a random-init model of real size, on CUDA in bf16.

    python tools/gpu_check.py [--shape qwen2-0.5b|tiny] [--device cuda|cpu] [--out DIR]

- engine: `TorchEngine(dtype="bfloat16")` generates `--batch` prompts x `--new-tokens` tokens
  (tokens/s, second call; the first warms up) and takes a whole new version (`receive_weights`, s);
- learner: `PolicyTrainer.step`, the real GRPO step, fp32 master weights under bf16 autocast, on
  `--batch` rows of prompt + completion (s per step, peak GPU memory);
- sparse deltas: the learner-side `Planner` packs each version in bf16 and diffs it against the one
  before, the receiver-side `Slots` rebuilds it and verifies every bucket's checksum (changed
  fraction, patch bytes / full bytes, diff and rebuild seconds) at lr 1e-6 and 1e-5;
- sharded learner: the same step with the model under FSDP2 (a group of one rank on the one GPU: bf16
  compute, fp32 reduction and master weights), s per step and peak memory, and its weights gathered
  one parameter at a time to the host (what a push of N ranks does without mooncake_p2p);
- LoRA: the learner with a rank-16 adapter on q/k/v/o (peft; the base frozen in bf16 on the GPU) steps,
  publishes the adapter with its parity probe, and a bf16 `TorchEngine` merges it into its base and
  checks the probe (s per step, peak memory, adapter bytes / full bytes, merge s, the probe's difference);
- Mooncake from CUDA memory (the TransferEngine calls `mooncake_p2p` makes, not its transport class,
  which sends from host memory): when `mooncake` imports there (it is not installed on the device
  image; carry the slimmed CUDA wheel, see tools/gpu-check.sh), two TransferEngines on loopback TCP:
  the learner's packed bf16 weights in CUDA memory written to a host buffer and to another CUDA buffer
  in 32 MiB buckets with `batch_transfer_sync_write`, verified byte for byte (GB/s);
- MoE: a random-init Qwen3-MoE (`MOE_SHAPES`: hidden 1024, 8 layers, 32 experts top-4, ~0.4B parameters;
  `--shape tiny`: the tiny MoE) whose "engine" is a bf16 copy of it: one forward records each completion
  token's logprob and experts (`RoutingCapture`), as the torch engine does, and the GRPO learner (fp32
  master weights under bf16 autocast) steps on those rows with `routing_replay` "off" then "rollout"
  (s per step, peak memory, router disagreement and the engine-vs-learner logprob gap of the first step,
  at the engine's weights). Expert parallelism needs more than one device: not here.
Prints one JSON object as its last line (and writes it to `--out`/gpu-check.json). `--shape tiny
--device cpu` is the CPU run of the same code that CI's machine can do; `--rows moe` runs the MoE row alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from buffers.codec import RolloutBatch  # noqa: E402
from stages.data.model import make_tiny_model, make_tiny_moe_model  # noqa: E402
from stages.data.routing import ROUTED_EXPERTS_FIELD, RoutingCapture, moe_layout  # noqa: E402
from stages.engines.base import SamplingParams  # noqa: E402
from stages.engines.torch import TorchEngine  # noqa: E402
from stages.learner import GRPOLearner  # noqa: E402
from stages.learner.lora import LoraSpec  # noqa: E402
from stages.learner.step import PolicyTrainer  # noqa: E402
from stages.weights.adapter import as_received  # noqa: E402
from stages.weights.base import new_stats  # noqa: E402
from stages.weights.sparse import Planner, Slots  # noqa: E402

SHAPES = {  # Qwen2-0.5B's config (random weights), and a tiny one for the CPU run
    "qwen2-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768),
    "tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
}

MOE_SHAPES = {  # a Qwen3-MoE that fits one H100 many times over and steps in seconds; the tiny MoE on the CPU
    "qwen2-0.5b": dict(hidden_size=1024, layers=8, heads=16, kv_heads=4, experts=32, top_k=4, moe_intermediate=512),
    "tiny": dict(),  # make_tiny_moe_model's defaults: hidden 64, 2 layers, 8 experts top-2
}
ROWS = ("engine", "learner", "sharded", "lora", "mooncake", "moe")


def make_model(folder: Path, shape: str) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    make_tiny_model(folder)  # a tokenizer (the checks use token ids only); its config and weights are replaced
    config = Qwen2Config(**SHAPES[shape], tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


async def check_engine(folder: Path, device: str, batch: int, new_tokens: int, vocab: int) -> dict:
    engine = TorchEngine(folder, device=device, dtype="bfloat16", seed=0)
    await engine.start()
    try:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(10, vocab, size=128).tolist() for _ in range(batch)]
        params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
        await engine.generate(prompts[:4], SamplingParams(max_new_tokens=8, temperature=1.0))
        t0 = time.perf_counter()
        out = await engine.generate(prompts, params)
        seconds = time.perf_counter() - t0
        tokens = sum(len(c.tokens) for c in out)
        state = load_file(folder / "model.safetensors", device=device)
        t0 = time.perf_counter()
        await engine.receive_weights(1, state)
        sync(device)
        return {"tokens": tokens, "tokens_per_s": round(tokens / seconds, 1), "generate_s": round(seconds, 3),
                "receive_weights_s": round(time.perf_counter() - t0, 4), "version": engine.version}
    finally:
        await engine.stop()


def fake_batches(groups: int, group_size: int, prompt: int, completion: int, vocab: int) -> list[RolloutBatch]:
    """`groups` batches of `group_size` rows: random prompt and completion ids, behaviour logprobs
    near a uniform policy's, a loss mask over the completion, rewards that differ within a group."""
    rng = np.random.default_rng(1)
    batches = []
    for _ in range(groups):
        rows = [{"tokens": rng.integers(10, vocab, size=prompt + completion).astype(np.int32),
                 "logprobs": np.r_[np.zeros(prompt), np.full(completion, -np.log(vocab))].astype(np.float32),
                 "loss_mask": np.r_[np.zeros(prompt), np.ones(completion)].astype(np.uint8),
                 "token_versions": np.r_[np.full(prompt, -1), np.zeros(completion)].astype(np.int32)}
                for _ in range(group_size)]
        fields = {"rewards": rng.random(group_size).astype(np.float32),
                  "prompt_lens": np.full(group_size, prompt, np.int32),
                  "versions": np.zeros((group_size, 2), np.int32), "turns": np.ones(group_size, np.int32)}
        batches.append(RolloutBatch.from_rows(rows, row_fields=fields, meta={}))
    return batches


def learner_on(folder: Path, device: str, lr: float) -> PolicyTrainer:
    """The learner's trainer as its actor makes it (fp32 weights, the learner's own loader), constant lr."""
    trainer = PolicyTrainer(GRPOLearner(model_path=folder, lr=lr, device=device), steps=1 << 30)
    trainer.schedule(0)
    return trainer


def check_learner_and_deltas(folder: Path, device: str, batch: int, vocab: int, steps: int) -> dict:
    """Learner steps at lr 1e-6 then 1e-5; after each, the version packed in bf16 and sent as a delta
    into the receive slot that is not live, as `mooncake_p2p` with `sparse = true` does."""
    batches = fake_batches(max(batch // 8, 1), 8, prompt=128, completion=128, vocab=vocab)
    actor, planner = learner_on(folder, device, lr=1e-6), Planner("bfloat16", stats=new_stats())
    t0 = time.perf_counter()
    first = planner.stage(0, actor.model.state_dict(), 32 << 20)
    learner = {"params": sum(p.numel() for p in actor.model.parameters()), "rows_per_step": batch,
               "tokens_per_row": 256, "pack_s": round(time.perf_counter() - t0, 4), "step_s": []}
    slots = Slots([np.empty(first.nbytes, np.uint8) for _ in range(2)])
    slots.slots[0][:] = first
    slots.rebuild(0, planner.versions.layout, None, None)
    slots.applied(0)
    sparse, version = {}, 0
    for lr in (1e-6, 1e-5):
        for group in actor.optimizer.param_groups:
            group["lr"] = lr
        sparse[f"lr={lr:g}"] = []
        for _ in range(steps):
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            with torch.autocast(device_type=actor.device.type, dtype=torch.bfloat16):
                info = actor.step(batches)
            sync(device)
            learner["step_s"].append(round(time.perf_counter() - t0, 4))
            version += 1
            sparse[f"lr={lr:g}"].append({"loss": info["loss"], **send(planner, actor, version, slots)})
    if device.startswith("cuda"):
        learner["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return {"learner": learner, "sparse": sparse}


def send(planner: Planner, actor: PolicyTrainer, version: int, slots: Slots) -> dict:
    """Stage `version`, diff it against the newest version a slot holds, rebuild it (verified) in the
    slot that is not live, then make that one live."""
    target = 1 - slots.live
    t0 = time.perf_counter()
    planner.stage(version, actor.model.state_dict(), 32 << 20)
    patch, pieces = planner.patch(tuple(slots.holds), target, refused=False)
    payload = np.concatenate(pieces)
    diff_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    slots.rebuild(target, planner.versions.layout, patch, payload)
    slots.applied(target)
    total = planner.versions.layout.total
    return {"base": patch.base, "changed_frac": round(sum(p.changed for p in patch.parts) / (total // 2), 5),
            "bytes_vs_full": round(payload.nbytes / total, 4), "diff_s": round(diff_s, 4),
            "rebuild_s": round(time.perf_counter() - t0, 4)}


def timed_steps(trainer: PolicyTrainer, device: str, batch: int, vocab: int, steps: int, autocast: bool) -> dict:
    """`steps` steps of `trainer` (from version 0) on the same fake batches, timed one by one, under bf16
    autocast or not; the peak GPU memory over them on CUDA."""
    trainer.schedule(0)
    batches = fake_batches(max(batch // 8, 1), 8, prompt=128, completion=128, vocab=vocab)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(steps):
        t0 = time.perf_counter()
        with torch.autocast(device_type=trainer.device.type, dtype=torch.bfloat16, enabled=autocast):
            trainer.train(batches)
        sync(device)
        seconds.append(round(time.perf_counter() - t0, 4))
    out: dict = {"step_s": seconds}
    if device.startswith("cuda"):
        out["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


def check_sharded_learner(folder: Path, device: str, batch: int, vocab: int, steps: int) -> dict:
    """The learner's FSDP2 path on one rank of its own group (nccl on CUDA, gloo on CPU)."""
    import torch.distributed as dist

    from pipeline.net import free_port

    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        trainer = PolicyTrainer(GRPOLearner(model_path=folder, lr=1e-6, device=device), steps=1 << 30, shard=True)
        out = timed_steps(trainer, device, batch, vocab, steps, autocast=False)
        t0 = time.perf_counter()
        weights = trainer.weights()
        return out | {"gather_s": round(time.perf_counter() - t0, 4),
                      "gathered_bytes": sum(t.nbytes for t in weights.values())}
    finally:
        dist.destroy_process_group()


def check_lora(folder: Path, device: str, batch: int, vocab: int, steps: int) -> dict:
    """A LoRA learner's steps and one published adapter, merged and probed by a bf16 TorchEngine."""
    spec = LoraSpec(rank=16, alpha=32, check_tolerance=0.1)  # a bf16 engine against an fp32 learner
    trainer = PolicyTrainer(GRPOLearner(model_path=folder, lr=1e-4, device=device, lora=spec), steps=1 << 30)
    out = timed_steps(trainer, device, batch, vocab, steps, autocast=True)
    out["trainable"] = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    adapter = {k: v.detach().to("cpu") for k, v in trainer.weights(steps).items()}
    full = sum(t.nbytes for t in load_file(folder / "model.safetensors").values())
    out["adapter_bytes_vs_full"] = round(sum(t.nbytes for t in adapter.values()) / full, 4)
    out.update(asyncio.run(merge_on_engine(folder, device, steps, adapter)))
    return out


async def merge_on_engine(folder: Path, device: str, version: int, adapter: dict[str, torch.Tensor]) -> dict:
    engine = TorchEngine(folder, device=device, dtype="bfloat16", seed=0)
    await engine.start()
    try:
        t0 = time.perf_counter()
        await engine.receive_weights(version, as_received(adapter))
        sync(device)
        stats = engine.stats
        return {"receive_s": round(time.perf_counter() - t0, 4), "engine_version": engine.version,
                **{k: stats[k] for k in ("adapters_merged", "adapters_refused", "merge_s") if k in stats}}
    finally:
        await engine.stop()


def check_mooncake_cuda(folder: Path, device: str) -> dict:
    """The learner's packed bf16 weights, in CUDA memory, written by one TransferEngine into another's
    host buffer and CUDA buffer over loopback TCP (32 MiB buckets), verified byte for byte."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        return {"skipped": f"mooncake is not installed here ({exc})"}
    if not device.startswith("cuda"):
        return {"skipped": "not on CUDA"}
    engines = [TransferEngine(), TransferEngine()]
    for engine in engines:
        if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            return {"failed": "TransferEngine.initialize"}
    planner = Planner("bfloat16", stats=new_stats())
    packed = planner.stage(0, load_file(folder / "model.safetensors"), 32 << 20)
    source = torch.from_numpy(packed).to(device)
    targets = {"to_host": torch.zeros(source.numel(), dtype=torch.uint8).pin_memory(),
               "to_cuda": torch.zeros(source.numel(), dtype=torch.uint8, device=device)}
    out: dict = {"bytes": source.numel()}
    if engines[0].register_memory(source.data_ptr(), source.numel()) != 0:
        return {"failed": "register_memory of CUDA weights"}
    peer = f"127.0.0.1:{engines[1].get_rpc_port()}"
    for name, target in targets.items():
        if engines[1].register_memory(target.data_ptr(), target.numel()) != 0:
            out[name] = "register_memory failed"
            continue
        starts = range(0, source.numel(), 32 << 20)
        t0 = time.perf_counter()
        rc = engines[0].batch_transfer_sync_write(peer, [source.data_ptr() + s for s in starts],
                                                  [target.data_ptr() + s for s in starts],
                                                  [min(32 << 20, source.numel() - s) for s in starts])
        sync(device)
        seconds = time.perf_counter() - t0
        same = bool(torch.equal(target.to(device), source)) if rc == 0 else False
        out[name] = {"rc": rc, "gb_per_s": round(source.numel() / seconds / 1e9, 2), "verified": same}
    return out


def engine_rows(folder: Path, device: str, batch: int, prompt: int, completion: int) -> list[RolloutBatch]:
    """Groups of 8 rows of random ids scored by a bf16 copy of the model as the torch engine scores what it
    generates: each completion token's logprob, and its experts (the routing of the position whose logits
    sampled it, zeros on prompt tokens), in the codec's `routed_experts` field."""
    from transformers import AutoModelForCausalLM

    engine = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    layout = moe_layout(engine)
    vocab = engine.config.vocab_size
    ids = torch.from_numpy(np.random.default_rng(2).integers(4, vocab, size=(batch, prompt + completion))).to(device)
    capture = RoutingCapture(engine, layout)
    with torch.no_grad():
        logits = engine(input_ids=ids).logits.float()
    routed = capture.all_positions(batch).to("cpu").numpy().astype(layout.id_dtype)  # [rows, seq, layers, k]
    capture.remove()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None]).squeeze(-1).to("cpu").numpy()
    ids, rows = ids.to("cpu").numpy().astype(np.int32), []
    for r in range(batch):
        experts = np.zeros_like(routed[r])
        experts[prompt:] = routed[r, prompt - 1 : -1]  # token t was sampled from position t - 1's logits
        rows.append({"tokens": ids[r], "logprobs": np.r_[np.zeros(prompt), logp[r, prompt - 1 :]].astype(np.float32),
                     "loss_mask": np.r_[np.zeros(prompt), np.ones(completion)].astype(np.uint8),
                     "token_versions": np.r_[np.full(prompt, -1), np.zeros(completion)].astype(np.int32),
                     ROUTED_EXPERTS_FIELD: experts})
    del engine
    rng, batches = np.random.default_rng(3), []
    for start in range(0, batch, 8):
        part = rows[start : start + 8]
        fields = {"rewards": rng.random(len(part)).astype(np.float32),
                  "prompt_lens": np.full(len(part), prompt, np.int32),
                  "versions": np.zeros((len(part), 2), np.int32), "turns": np.ones(len(part), np.int32)}
        batches.append(RolloutBatch.from_rows(part, row_fields=fields, meta={}))
    return batches


def check_moe(folder: Path, device: str, shape: str, batch: int, steps: int) -> dict:
    """The MoE row: the learner's bf16-autocast steps on engine-scored rows, routing replay off then on."""
    spec = MOE_SHAPES[shape]
    folder = make_tiny_moe_model(folder, **spec, overwrite=True)
    params = sum(t.numel() for t in load_file(folder / "model.safetensors").values())
    out: dict = {"shape": {**spec, "params": params}, "rows_per_step": max(batch // 8, 1) * 8}
    batches = engine_rows(folder, device, out["rows_per_step"], prompt=64, completion=128)
    for replay in ("off", "rollout"):
        learner = GRPOLearner(model_path=folder, lr=1e-6, device=device, routing_replay=replay)
        trainer = PolicyTrainer(learner, steps=1 << 30)
        trainer.schedule(0)
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        row: dict = {"step_s": []}
        for step in range(steps):
            t0 = time.perf_counter()
            with torch.autocast(device_type=trainer.device.type, dtype=torch.bfloat16):
                info = trainer.train(batches)
            sync(device)
            row["step_s"].append(round(time.perf_counter() - t0, 4))
            if step == 0:  # at the engine's weights: what the numerics alone make differ
                row |= {k: round(info[k], 6) for k in ("router_disagreement", "router_drift", "logprob_gap")}
        if device.startswith("cuda"):
            row["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        out[f"replay_{replay}"] = row
        del trainer, learner
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-0.5b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="learner steps per learning rate")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated rows to run, of {','.join(ROWS)}")
    a = parser.parse_args()
    rows = set(a.rows.split(","))
    if rows - set(ROWS):
        parser.error(f"--rows: {', '.join(sorted(rows - set(ROWS)))} unknown; the rows are {', '.join(ROWS)}")
    torch.set_num_threads(1 if a.device == "cpu" else 8)
    result = {"shape": a.shape, "device": a.device, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if a.device.startswith("cuda") else None}
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model(Path(tmp) / "model", a.shape) if rows - {"moe"} else Path(tmp) / "model"
        vocab = SHAPES[a.shape]["vocab_size"]
        if "engine" in rows:
            result["engine"] = asyncio.run(check_engine(folder, a.device, a.batch, a.new_tokens, vocab))
        if "learner" in rows:
            result.update(check_learner_and_deltas(folder, a.device, a.batch, vocab, a.steps))
        if "sharded" in rows:
            result["sharded_learner"] = check_sharded_learner(folder, a.device, a.batch, vocab, a.steps)
        if "lora" in rows:
            result["lora"] = check_lora(folder, a.device, a.batch, vocab, a.steps)
        if "mooncake" in rows:
            result["mooncake_cuda"] = check_mooncake_cuda(folder, a.device)
        if "moe" in rows:
            result["moe"] = check_moe(Path(tmp) / "moe", a.device, a.shape, a.batch, a.steps)
    line = json.dumps(result)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "gpu-check.json").write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
