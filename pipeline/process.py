"""How a process is set up for a run: one place, called by `Pipeline.run()` / `resume()` (so the Python DSL
and `baton run` get the same settings) and by the CLI before it builds anything.

`prepare_process()` makes the process compute on one intra-op thread: torch's own pool, and, through
`OMP_NUM_THREADS`, whatever OpenMP pool starts later here or in a process started from here (a learner's
other ranks, an engine). A run's actors share the machine's cores among themselves and with whatever else
runs there (a second run, Ray workers, a shared node); each extra intra-op thread they start only adds
contention: under load the DSL quickstart ran 3-4 times slower with torch's default pool than the CLI with
one thread (`benchmarks/dsl_vs_cli.py`). A variable the user set (`OMP_NUM_THREADS`) is kept for the
processes started later; torch's pool in this process is set to one thread either way, as the CLI always
did. torch is only touched when it is already loaded (the stages load it): `pipeline` does not import it.
"""

from __future__ import annotations

import os
import sys

THREADS = 1  # intra-op threads per process


def prepare_process() -> dict[str, int | str]:
    """Set this process up for a run (see the module docstring); returns what it set, for tests and logs."""
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    settings: dict[str, int | str] = {"OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]}
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(THREADS)
        settings["torch_threads"] = torch.get_num_threads()
    return settings


__all__ = ["THREADS", "prepare_process"]
