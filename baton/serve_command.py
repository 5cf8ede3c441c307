"""`baton serve MODEL_DIR [--port P] [--dir D] [--state S]`: a Tinker-compatible training service over one base
model folder (`stages.service`), on 127.0.0.1, for the official `tinker` SDK (`pip install -e '.[tinker]'`).

It makes a key of the shape the SDK requires (`tml-` and 43 random URL-safe characters) unless `D/api_key`
holds one already (a restart over the same folder keeps its clients' key), writes it to `D/api_key` (mode 0600)
and the address to `D/service.json` ({"base_url", "pid", "model", "key_file"}), prints
both paths, and serves until Ctrl-C or SIGTERM. A client points the SDK at it:
`tinker.ServiceClient(base_url=..., api_key=open("D/api_key").read())` (or TINKER_BASE_URL / TINKER_API_KEY).
A training client's `save_state(name)` writes `D/checkpoints/{model_id}/{name}/` (the learner's checkpoint in
`state/`, the adapter as a PEFT folder in `adapter/`, or a fully fine-tuned model as a Hugging Face folder in
`model/`); a fully fine-tuned model's `save_weights_for_sampler` writes
`D/checkpoints/{model_id}/sampler_weights/{seq_id}/model.safetensors` (the seq_id of its call).

Its state (the journal of accepted calls, each model's committed learner state, the saved samplers) lives in `S`
(default `D/state`): started again over the same `S` after a kill, it comes back at each model's last committed
step and runs again what it had accepted after it (`stages.service.recovery`), before it serves.

With `--world-size N` every training model is sharded over N learner ranks (FSDP2; `stages.service.ranked`):
N - 1 follower processes start with the service and stop with it.

`--engine sglang` and `--engine vllm` sample on one SGLang or vLLM server (launched at the first sample, LoRA saves as
adapters, the least recently used unloaded first); fully fine-tuned models' samplers are refused there (`--engine
torch` serves them), and so are, on vLLM, adapters on the unembedding (`train_unembed=False` avoids them). Without
the engine's environment, or (vLLM) over a model whose head size its CPU attention cannot run, it exits 2.

Exit codes: 0 stopped by Ctrl-C or SIGTERM, 2 bad usage (no such model folder, the tinker extra missing, a world
size below 1, the engine's environment missing or a model it cannot run, a state folder of another model or a
damaged journal).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stages.service.sampling import SamplerSettings


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `serve` to a `baton` subparsers object."""
    p = subparsers.add_parser(
        "serve", help="serve a Tinker-compatible training API over a model folder (the tinker SDK drives it)",
        epilog="exit codes:\n  0   stopped by Ctrl-C or SIGTERM\n  2   bad usage: no model folder, the tinker "
               "extra missing (pip install -e '.[tinker]'),\n      --world-size below 1, the --engine's environment "
               "missing\n      or a model it cannot run, or --state holding another model's state",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", metavar="MODEL_DIR", help="a Hugging Face causal-LM folder (its tokenizer included)")
    p.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (0: any free one; default 8000)")
    p.add_argument("--dir", default="baton-serve", help="where the key and service.json go (default ./baton-serve)")
    p.add_argument("--state", default=None, help="the journal, committed learner states and saved samplers; a "
                   "restart over the same folder comes back where the service was (default DIR/state)")
    p.add_argument("--commit-every", type=float, default=10.0, metavar="SECONDS",
                   help="a model's learner state is committed to --state at most this often (its first step always; "
                        "0: every step); a restart runs the steps after the last commit again (default 10)")
    p.add_argument("--device", default="cpu", help="the learner's and engines' device (default cpu)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--world-size", type=int, default=1,
                   help="learner ranks each training model is sharded over (FSDP2; N-1 follower processes start "
                        "here; default 1)")
    p.add_argument("--engine", choices=("torch", "sglang", "vllm"), default="torch",
                   help="what samples the saved weights: baton's torch engine (default; LoRA and full fine-tuning) "
                        "or one SGLang (tools/sglang-cpu/install.sh) or vLLM (tools/vllm-cpu/install.sh; no adapter "
                        "on the unembedding) server serving each LoRA save as an adapter")
    p.add_argument("--max-lora-rank", type=int, default=32, help="--engine sglang or vllm: the largest adapter rank "
                                                                 "the server takes (default 32)")
    p.add_argument("--max-loaded-adapters", type=int, default=4,
                   help="--engine sglang or vllm: adapters loaded at once, the least recently used unloaded first (4)")
    return p


def write_key(folder: Path) -> tuple[str, Path]:
    """The `tml-...` key in `folder/api_key` (a fresh one unless a `tml-` key is there), readable by this user
    only."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "api_key"
    kept = path.read_text().strip() if path.is_file() else ""
    key = kept if kept.startswith("tml-") else "tml-" + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key)
    os.chmod(path, 0o600)
    return key, path


async def serve(model_dir: Path, port: int, folder: Path, state: Path, device: str, sampling: SamplerSettings,
                world_size: int = 1, commit_every_s: float = 10.0) -> None:
    from aiohttp import web

    from stages.service.recovery import recover
    from stages.service.routes import make_app
    from stages.service.service import Service

    key, key_file = write_key(folder)
    service = Service(model_dir, folder / "checkpoints", state, device=device, sampling=sampling,
                      world_size=world_size, commit_every_s=commit_every_s)
    back = await recover(service)
    if back["sessions"]:
        print(f"baton serve: back from {state}: " + ", ".join(f"{n} {what}" for what, n in back.items()), flush=True)
    runner = web.AppRunner(make_app(service, key), access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # the port the OS gave (--port 0)
    info = {"base_url": f"http://127.0.0.1:{bound}", "pid": os.getpid(), "model": str(model_dir.resolve()),
            "key_file": str(key_file.resolve())}
    (folder / "service.json").write_text(json.dumps(info))
    print(f"baton serve: {info['base_url']} for {info['model']}; key in {info['key_file']}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def run(args: argparse.Namespace) -> int:
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        print(f"baton serve: {model_dir} is not a model folder (no config.json)", file=sys.stderr)
        return 2
    if args.world_size < 1 or args.commit_every < 0:
        print(f"baton serve: --world-size must be >= 1 and --commit-every >= 0, got {args.world_size} and "
              f"{args.commit_every}", file=sys.stderr)
        return 2
    try:
        import tinker  # noqa: F401  the wire format's protobuf module ships in the SDK
    except ImportError:
        print("baton serve needs the tinker extra: pip install -e '.[tinker]'", file=sys.stderr)
        return 2
    from stages.service.sampling import EngineUnavailable, SamplerSettings, engine_sampler

    try:
        sampling = SamplerSettings(args.engine, max_lora_rank=args.max_lora_rank, max_loaded=args.max_loaded_adapters)
        engine_sampler(sampling, model_dir, 0, args.device)  # the engine's environment is there (nothing starts)
    except (ValueError, EngineUnavailable) as exc:
        print(f"baton serve: {exc}", file=sys.stderr)
        return 2
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    folder = Path(args.dir)
    from stages.service.journal import StateError

    try:
        asyncio.run(serve(model_dir, args.port, folder, Path(args.state) if args.state else folder / "state",
                          args.device, sampling, args.world_size, args.commit_every))
    except StateError as exc:  # the state folder belongs to another model, or its journal is damaged
        print(f"baton serve: {exc}", file=sys.stderr)
        return 2
    return 0
