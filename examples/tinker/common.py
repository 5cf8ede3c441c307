"""What the Tinker examples share: a `baton serve` of their own over the tiny local model, and the SDK client on it.

`serving(folder)` makes the tiny model (random weights, a character tokenizer; nothing is downloaded) in
`folder/model`, starts `baton serve` on it in a process of its own on a free port of 127.0.0.1, and yields the
official SDK's `tinker.ServiceClient` on it with the base model's name; the service is stopped (by its pid) on
the way out. With `TINKER_BASE_URL` and `TINKER_API_KEY` set, the examples use that service instead, and
`TINKER_BASE_MODEL` names its model. `baton_service(folder, python)` is the same service without the SDK client:
(base URL, API key, model name), run by another Python (the cookbook examples' venv cannot build baton's models).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its `baton` runs the service
ADAM = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "grad_clip_norm": 1.0}  # baton's learner's AdamW settings


def work_folder(folder: str | None, name: str) -> Path:
    """`folder` (made if missing), or a new temporary folder `tinker-{name}-...`: the example's model, data,
    service and logs."""
    path = Path(folder or tempfile.mkdtemp(prefix=f"tinker-{name}-"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def add_cookbook_arguments(parser) -> None:
    """What the cookbook examples share: the Python that runs `baton serve` (theirs cannot) and their folder."""
    parser.add_argument("--baton-python", default=shutil.which("python") or "python",
                        help="the Python that runs `baton serve` and makes the tiny model (the project's)")
    parser.add_argument("--folder", default=None, help="the model, data, the recipe's log and the service's "
                                                       "(default: a temporary folder)")


def tiny_model(folder: Path) -> Path:
    """The quickstart's tiny Qwen2 (2 layers, 64 wide, random init) in `folder/model`, made once."""
    sys.path.insert(0, str(ROOT))
    from stages.data.model import make_tiny_model

    return make_tiny_model(folder / "model")


@contextlib.contextmanager
def serving(folder: Path, start_timeout_s: float = 120.0) -> Iterator[tuple[object, str]]:
    """(the SDK's ServiceClient, the base model's name) on a `baton serve` this process starts over the tiny
    model, or on the service `TINKER_BASE_URL` names."""
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker

    if os.environ.get("TINKER_BASE_URL"):
        yield tinker.ServiceClient(), os.environ.get("TINKER_BASE_MODEL", "")
        return
    with baton_service(folder, start_timeout_s=start_timeout_s) as (base_url, api_key, model):
        yield tinker.ServiceClient(base_url=base_url, api_key=api_key), model


@contextlib.contextmanager
def baton_service(folder: Path, python: str = sys.executable,
                  start_timeout_s: float = 120.0) -> Iterator[tuple[str, str, str]]:
    """(base URL, API key, base model's name) of a `baton serve` over the tiny model in `folder/model`, run by
    `python` (a Python with baton's dependencies: the cookbook's venv pins an older transformers, so its
    example names the project's Python here); stopped by its pid on the way out. The model is made by the same
    `python`, so this process need not import transformers at all."""
    if python == sys.executable:
        model = tiny_model(folder)
    else:
        subprocess.run([python, "-c", "import sys; from stages.data.model import make_tiny_model; "
                        "make_tiny_model(sys.argv[1])", str(folder / "model")], check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
        model = folder / "model"
    served = folder / "serve"
    (served / "service.json").unlink(missing_ok=True)
    shutil.rmtree(served / "state", ignore_errors=True)  # a fresh service each run: no earlier run's models back
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = open(folder / "serve.log", "w")  # noqa: SIM115  closed with the service
    proc = subprocess.Popen([python, "-m", "baton.cli", "serve", str(model), "--port", "0", "--dir",
                             str(served), "--threads", "1"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + start_timeout_s
        while not (served / "service.json").exists():
            if proc.poll() is not None:
                raise RuntimeError(f"baton serve exited {proc.returncode}: {(folder / 'serve.log').read_text()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"baton serve did not start within {start_timeout_s:.0f} s")
            time.sleep(0.2)
        info = json.loads((served / "service.json").read_text())
        yield info["base_url"], Path(info["key_file"]).read_text(), info["model"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # still busy after 30 s: stop it for good
            proc.kill()
            proc.wait()
        log.close()
