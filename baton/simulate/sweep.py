"""`baton simulate --sweep`: every combination of engines, k and learners, as a table and a plot."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from baton.config import ConfigError
from baton.simulate.costs import Costs, MeasuredCosts
from baton.simulate.simulation import load_simulation_config, simulate

SWEEP_KEYS = ("engines", "k", "learners")


@dataclass
class SweepPoint:
    engines: int
    k: int
    learners: int
    figures: dict[str, float]


@dataclass
class Sweep:
    points: list[SweepPoint] = field(default_factory=list)


def parse_sweep(items: Sequence[str]) -> dict[str, list[int]]:
    """`["engines=1,2,4", "k=0,1"]` -> {"engines": [1, 2, 4], "k": [0, 1]}."""
    axes: dict[str, list[int]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or key not in SWEEP_KEYS:
            raise ConfigError(f"--sweep {item!r}: expected KEY=V1,V2,... with KEY one of {', '.join(SWEEP_KEYS)}, "
                              "e.g. --sweep engines=1,2,4,8 k=0,1,2,4")
        try:
            parsed = [int(v) for v in values.split(",") if v.strip()]
        except ValueError:
            raise ConfigError(f"--sweep {item!r}: values must be integers, e.g. {key}=1,2,4") from None
        if not parsed or min(parsed) < (0 if key == "k" else 1):
            raise ConfigError(f"--sweep {item!r}: give at least one value, each >= {0 if key == 'k' else 1}")
        axes[key] = parsed
    return axes


def run_sweep(config: str, overrides: Sequence[str], axes: dict[str, list[int]], steps: int | None,
              costs: Costs | None = None, engines: int | None = None, learners: int | None = None) -> Sweep:
    """Simulate every combination of the sweep's axes (k = 0 is mode 'sync')."""
    sweep = Sweep()
    ks = axes.get("k", [None])
    for e, k, m in itertools.product(axes.get("engines", [engines]), ks, axes.get("learners", [learners])):
        extra = [] if k is None else ([f"mode='{'sync' if k == 0 else 'async'}'", f"staleness.k={k}"])
        if m is not None:
            extra.append(f"simulate.learners={m}")
        cfg, spec = load_simulation_config(config, [*overrides, *extra])
        point_costs = costs
        if isinstance(costs, MeasuredCosts) and m is not None:
            point_costs = MeasuredCosts(costs.calls, costs.steps, m, costs.hop_s, costs.engine_load_s,
                                        costs.get_s_per_group)
        result = simulate(cfg, spec, point_costs, engines=e, steps=steps)
        ranks = spec.learners or cfg.learner_ranks
        sweep.points.append(SweepPoint(result.engines, result.k, ranks,
                                       {**result.figures, "sim_wall_s": result.wall_s}))
    return sweep


def print_sweep(sweep: Sweep) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="baton simulate --sweep (steady state)")
    for col in ("engines", "k", "learners", "samples/s", "x fewest engines", "learner busy", "engine idle",
                "mean staleness", "dropped"):
        table.add_column(col, justify="right")
    first: dict[tuple[int, int], float] = {}
    for p in sweep.points:
        f = p.figures
        base = first.setdefault((p.k, p.learners), f["samples_per_s"])
        table.add_row(str(p.engines), str(p.k), str(p.learners), f"{f['samples_per_s']:.1f}",
                      f"{f['samples_per_s'] / base:.2f}", f"{f['learner_busy']:.3f}", f"{f.get('engine_idle', 0):.3f}",
                      f"{f['mean_staleness']:.2f}", f"{f['dropped_frac']:.3f}")
    Console(stderr=True, width=120).print(table)


def write_sweep(root: str | Path, name: str, sweep: Sweep) -> Path:
    """sweep.json and sweep.png (samples/s and learner busy fraction against engines, one line per k) in a
    new run folder."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from pipeline.telemetry import RunFolder

    folder = RunFolder.create(root, f"{name}-sweep")
    folder.write_json("sweep.json", [p.__dict__ for p in sweep.points])
    fig = Figure(figsize=(12, 4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    lines = sorted({(p.k, p.learners) for p in sweep.points})
    for k, m in lines:
        pts = sorted((p for p in sweep.points if p.k == k and p.learners == m), key=lambda p: p.engines)
        label = f"k={k}" + (f", learners={m}" if len({q.learners for q in sweep.points}) > 1 else "")
        xs = [p.engines for p in pts]
        axes[0].plot(xs, [p.figures["samples_per_s"] for p in pts], marker="o", label=label)
        axes[1].plot(xs, [p.figures["learner_busy"] for p in pts], marker="o", label=label)
        axes[2].plot(xs, [p.figures.get("engine_idle", 0) for p in pts], marker="o", label=label)
    for ax, title in zip(axes, ("trained samples/s", "learner busy fraction", "engine idle fraction"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("engines")
        if len({p.engines for p in sweep.points}) > 1 and min(p.engines for p in sweep.points) > 0:
            ax.set_xscale("log", base=2)
        ax.legend(fontsize="small")
    fig.suptitle(f"{name}: where more engines stop paying, and what k buys")
    fig.savefig(folder.path / "sweep.png", dpi=100)
    folder.close()
    return folder.path
