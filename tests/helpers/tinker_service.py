"""`baton serve` started in its own process for the tinker SDK tests (stopped by its pid): a tiny model under `root`,
the service's folder, and its service.json (base_url, model, key_file)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from stages.data.model import make_tiny_model

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def running_service(root: Path, *options: str, **model_shape: int) -> Iterator[tuple[dict, Path]]:
    """`baton serve` over a tiny model in `root` (`make_tiny_model(**model_shape)`) with `options` (e.g. `--engine
    sglang`): (service.json, folder)."""
    model = make_tiny_model(root / "tiny", **model_shape)
    folder = root / "serve"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    log = root / "serve.log"  # a file, not a pipe: a pipe nobody reads would block the service once full
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "baton.cli", "serve", str(model), "--port", "0", "--dir",
                                 str(folder), "--threads", "1", *options], env=env, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 120
        while not (folder / "service.json").exists():
            assert proc.poll() is None, f"baton serve exited: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "baton serve did not start within 120 s"
            time.sleep(0.2)
        yield json.loads((folder / "service.json").read_text()), folder
    finally:
        proc.terminate()
        proc.wait(timeout=60)
