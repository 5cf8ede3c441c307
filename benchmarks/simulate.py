"""Simulated steps per second of `baton simulate` on the quickstart config (4 groups a step).

The suite asserts that the simulator's work grows linearly with the steps (tests/baton/test_simulate.py);
this measures what that work costs here: 10,000 steps took about 1 s on an idle core of this machine.

Prints, as the last stdout line, one JSON object: {steps: {"wall_s", "steps_per_s", "events"}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from baton.simulate import simulation as sim  # noqa: E402


def main() -> None:
    figures = {}
    for steps in (1_000, 10_000):
        sets = ["simulate.response_tokens_sigma=0", "simulate.warmup=5", f"steps={steps}",
                "learner.groups_per_step=4", "engine.batch_groups=4"]
        result = sim.simulate(*sim.load_simulation_config(str(ROOT / "configs" / "quickstart.toml"), sets))
        figures[steps] = {"wall_s": round(result.wall_s, 3), "steps_per_s": round(steps / result.wall_s),
                          "events": result.events}
        print(f"{steps:>6} steps: {result.wall_s:.2f} s, {steps / result.wall_s:,.0f} steps/s", file=sys.stderr)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
