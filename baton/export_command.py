"""`baton export RUN_DIR OUT [--version V] [--dtype D] [--max-shard-size S] [--model PATH] [--force]`: a
checkpoint's model as a Hugging Face folder (stages.learner.export) that transformers, SGLang or vLLM loads.

The checkpoint is the run folder's latest complete one, or that of `--version`; any checkpoint loads,
whatever the learner's world size. The config, generation config and tokenizer (with its chat template)
come from the model folder the run started from: RUN_DIR/config.toml's `[model] path` (a relative path
is taken from the current folder, as `baton run` took it), or `--model`.

Exit codes: 0 written (the last stdout line is one JSON object: out, version, files, bytes, dtype), 1 the
export failed while writing (the message says why; OUT is left as it was), 2 bad input (no run folder
or checkpoint, no such version, OUT not empty without --force, a model folder that is gone or does not
fit), 130 interrupted by Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path
from typing import Any

EXIT_CODES = (
    (0, "written; the last stdout line is one JSON object (out, version, files, bytes, dtype)"),
    (1, "the export failed while writing (the message says why; OUT is left as it was)"),
    (2, "bad input: no run folder or checkpoint, no such version, OUT not empty without --force,\n"
        "      a model folder that is gone or does not fit, or bad usage"),
    (130, "interrupted by Ctrl-C or SIGTERM; OUT is left as it was"),
)


class BadInput(ValueError):
    """What `baton export` says and exits 2 on."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `export` to a `baton` subparsers object."""
    p = subparsers.add_parser(
        "export", help="write a checkpoint's model as a Hugging Face folder (config, tokenizer, safetensors)",
        epilog="exit codes:\n" + "\n".join(f"  {code:<4}{meaning}" for code, meaning in EXIT_CODES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder with checkpoints (checkpoint.every > 0)")
    p.add_argument("out", metavar="OUT", help="the folder to write (absent or empty, or replaced with --force)")
    p.add_argument("--version", dest="checkpoint_version", type=int, default=None, metavar="V",
                   help="the checkpoint of this version (default: the latest)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="the weights' dtype (default: the model config's, else float32)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help='weights past this size are split into several files and an index, e.g. "2GB" '
                   "(default 5GB)")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="the model folder the run started from (default: RUN_DIR/config.toml's [model] path)")
    p.add_argument("--force", action="store_true", help="replace OUT when it holds files")
    p.add_argument("--adapter", action="store_true", help="a LoRA run: the adapter alone, as a PEFT folder (by "
                   "default a LoRA checkpoint is written with its adapter merged into the base)")
    return p


def model_folder(run_dir: Path, explicit: str | None) -> Path:
    """`explicit`, else the run's config.toml's `[model] path`; BadInput naming the fix when neither is a folder."""
    if explicit is not None:
        if not Path(explicit).is_dir():
            raise BadInput(f"--model {explicit!r}: no such folder")
        return Path(explicit)
    config = run_dir / "config.toml"
    try:
        path = tomllib.loads(config.read_text())["model"]["path"]
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError) as exc:
        raise BadInput(f"{config} names no model folder ({type(exc).__name__}: {exc}); give it with --model PATH") \
            from None
    if not Path(path).is_dir():
        raise BadInput(f"the run's model folder {path!r} ({config}: [model] path) is not there from this folder "
                       f"({Path.cwd()}); run baton export where the run was started, or give it with --model PATH")
    return Path(path)


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    from stages.learner.export import ExportError, export_adapter, export_checkpoint, find_checkpoint

    try:
        checkpoint = find_checkpoint(run_dir, args.checkpoint_version)
        model = model_folder(run_dir, args.model)
        if args.adapter:
            exported = export_adapter(checkpoint, model, Path(args.out), force=args.force)
        else:
            exported = export_checkpoint(checkpoint, model, Path(args.out), dtype=args.dtype,
                                         max_shard_size=args.max_shard_size, force=args.force)
    except (BadInput, ExportError) as exc:
        print(f"baton export: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"baton export: writing {args.out} failed ({exc}); it is left as it was", file=sys.stderr)
        return 1
    print(json.dumps(exported.as_dict()), flush=True)
    return 0
