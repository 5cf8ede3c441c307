"""What checkpoints cost a run: the same config, seed and step count run without checkpoints (the
reference) and with `checkpoint.every = N`, interleaved `--repeats` times. Prints samples/s of each
(steady state, after `--warmup` versions), the seconds and bytes of each checkpoint (from the run
folder's `checkpoints.jsonl`), the last checkpoint's run state against the whole ledger (what a
checkpoint wrote before the ledger store: now it records the store's position and what is in flight),
and on the Ray runtime how long the conductor's ledger was frozen for the cuts.

    python benchmarks/checkpoints.py [--config configs/ray-mooncake.toml] [--steps 240] [--every 20]

Last stdout line: one JSON object with "figures", "reference" (the run without checkpoints) and
"ratios": samples_per_s_vs_none (goal >= 0.95: checkpoints every 20 versions cost under 5 %) and
last_run_state_vs_whole_ledger (a checkpoint writes what is in flight, not the run's history; goal <= 0.2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import msgspec
from async_vs_sync import run, steady_state

ROOT = Path(__file__).resolve().parents[1]


def checkpoint_figures(summary: dict) -> dict:
    run_dir = Path(summary["run_dir"])
    lines = [json.loads(x) for x in (run_dir / "checkpoints.jsonl").read_text().splitlines()]
    # the run's whole ledger in msgpack: what a checkpoint wrote before the store (at the run's end)
    whole = len(msgspec.msgpack.encode(msgspec.json.decode((run_dir / "ledger.json").read_bytes())))
    last = lines[-1]
    return {
        "checkpoints": len(lines),
        "checkpoint_s_median": round(statistics.median(x["seconds"] for x in lines), 4),
        "checkpoint_s_last": last["seconds"],
        "capture_s_median": round(statistics.median(x["capture_s"] for x in lines), 4),
        "run_bytes_last": last["run_bytes"],
        "consumer_bytes_last": last["consumer_bytes"],
        "ledger_store_bytes": (run_dir / "ledger.sqlite").stat().st_size,
        "whole_ledger_bytes": whole,
        "ledger_frozen_s": summary.get("checkpoint_pause_s"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "ray-mooncake.toml"))
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="baton-ckpt-") as tmp:
        none, every = [], []
        for _ in range(a.repeats):  # interleaved, so load on the machine hits both alike
            s = run(a.config, a.steps, [*a.overrides, "checkpoint.every=0"], Path(tmp))
            none.append(steady_state(s, a.warmup))
            s = run(a.config, a.steps, [*a.overrides, f"checkpoint.every={a.every}"], Path(tmp))
            every.append({**steady_state(s, a.warmup), **checkpoint_figures(s)})
    reference = {"samples_per_s": statistics.median(r["samples_per_s"] for r in none), "runs": none}
    figures = {"samples_per_s": statistics.median(r["samples_per_s"] for r in every), "every": a.every, "runs": every}
    last = every[-1]
    ratios = {
        "samples_per_s_vs_none": round(figures["samples_per_s"] / reference["samples_per_s"], 3),
        # the last checkpoint's run state, against the whole ledger it would otherwise rewrite
        "last_run_state_vs_whole_ledger": round(last["run_bytes_last"] / last["whole_ledger_bytes"], 4),
    }
    print(f"without checkpoints: {reference['samples_per_s']} samples/s; every {a.every}: "
          f"{figures['samples_per_s']} samples/s (x{ratios['samples_per_s_vs_none']}); last checkpoint "
          f"{last['checkpoint_s_last']} s, {last['run_bytes_last']} run-state bytes vs {last['whole_ledger_bytes']} "
          f"bytes of whole ledger (x{ratios['last_run_state_vs_whole_ledger']}); "
          f"ledger frozen {last['ledger_frozen_s']} s")
    print(json.dumps({"figures": figures, "reference": reference, "ratios": ratios}))


if __name__ == "__main__":
    main()
