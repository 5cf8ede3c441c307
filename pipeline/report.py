"""A PNG report of a run: `Panel`s (line, histogram, bar, timeline) drawn from metric records.

Rendering never fails because data is missing: absent keys are skipped, a panel without data is left
out, and a report without any says "no data". The file is replaced atomically.
"""

from __future__ import annotations

import math
import os
import textwrap
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["Panel", "render_report", "sliding_rate"]

# colours of a timeline's states: busy states saturated, waiting warm, bookkeeping grey
STATE_COLOURS = {
    "generating": "tab:green", "computing": "#2a9d8f", "waiting": "#f4a261",
    "storing + sending": "tab:blue", "loading weights": "tab:purple", "pushing weights": "tab:purple",
    "other": "lightgrey",
}
TITLE_CHARS = 56  # a title longer than this is wrapped: it fits a 6.4-inch panel at the default size


@dataclass
class Panel:
    """One subplot of a report.

    kind "line": one line per key in `y` against record key `x` (or the record index if x is None), or,
                 with `series` ({label: (xs, ys)}), those lines as given.
    kind "hist": a histogram of `values` if given, else of every record's `y` keys (one per key);
                 with `counts` ({label: {bin: count}}, pre-binned, e.g. by pipeline.histograms, by
                 integer or by name), one bar per label at each bin, as fractions of that label's total,
                 so groups of different sizes compare.
    kind "bar":  with `x` None, one bar per `y` key from the last record that has it; with `x` set,
                 bars of each `y` key at each record's `x` (grouped).
    kind "timeline": `lanes` ({lane: [(start s, duration s, state), ...]}), one row per lane, each
                 state in its colour (STATE_COLOURS; others cycle), up to `until` seconds if set.
    """

    title: str
    kind: Literal["line", "hist", "bar", "timeline"] = "line"
    x: str | None = None
    y: list[str] = field(default_factory=list)
    values: list[float] | None = None
    bins: int = 30
    counts: dict[str, dict[str, int]] | None = None
    series: dict[str, tuple[list[float], list[float]]] | None = None
    lanes: dict[str, list[tuple[float, float, str]]] | None = None
    until: float | None = None
    xlabel: str | None = None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _series(records: Iterable[Mapping[str, Any]], x: str | None, y: str) -> tuple[list[Any], list[float]]:
    xs: list[Any] = []
    ys: list[float] = []
    for i, record in enumerate(records):
        yv = _number(record.get(y))
        xv: Any = i if x is None else record.get(x)
        if yv is None or xv is None:
            continue
        xs.append(xv)
        ys.append(yv)
    return xs, ys


def sliding_rate(ts: Sequence[float], amounts: Sequence[float], window_s: float) -> list[float]:
    """At each time `ts[i]` (ascending), the amount per second over the window (ts[i] - window_s, ts[i]]
    (over (0, ts[i]] while ts[i] < window_s): a stall shows as a drop, unlike a cumulative average."""
    rates, total, first = [], 0.0, 0
    for i, t in enumerate(ts):
        total += amounts[i]
        while ts[first] <= t - window_s:
            total -= amounts[first]
            first += 1
        span = min(window_s, t)
        rates.append(total / span if span > 0 else 0.0)
    return rates


def _draw_binned(ax: Any, counts: Mapping[str, Mapping[str, int]]) -> bool:
    """Grouped bars of pre-binned counts, one colour per label, heights as fractions of the label."""
    shown = {label: bins for label, bins in counts.items() if sum(bins.values()) > 0}
    edges = sorted({edge for bins in shown.values() for edge in bins}, key=_bin_order)
    width = 0.8 / max(len(shown), 1)
    for j, (label, bins) in enumerate(shown.items()):
        total = sum(bins.values())
        ax.bar([i + j * width for i in range(len(edges))], [bins.get(e, 0) / total for e in edges],
               width=width, label=label)
    if edges:
        offset = width * (len(shown) - 1) / 2
        named = _bin_order(edges[-1])[0]  # bins named by words (reasons), not by numbers
        ax.set_xticks([i + offset for i in range(len(edges))], edges, rotation=20 if named else 0)
        ax.set_xlabel("bin" if named else "bin (lower edge)")
        ax.set_ylabel("fraction")
    return bool(shown)


def _bin_order(edge: str) -> tuple[int, float, str]:
    """Numeric bins in numeric order, then named ones alphabetically."""
    try:
        return 0, float(edge), ""
    except ValueError:
        return 1, 0.0, edge


def _draw_line(ax: Any, panel: Panel, records: list[Mapping[str, Any]]) -> bool:
    lines = panel.series if panel.series is not None else {key: _series(records, panel.x, key) for key in panel.y}
    drew = False
    for label, (xs, ys) in lines.items():
        if ys:
            ax.plot(xs, ys, label=label, marker="." if len(ys) < 50 else None)
            drew = True
    ax.set_xlabel(panel.x or "record")
    return drew


def _draw_hist(ax: Any, panel: Panel, records: list[Mapping[str, Any]]) -> bool:
    if panel.counts is not None:
        return _draw_binned(ax, panel.counts)
    groups = (
        {panel.title: [v for v in panel.values if _number(v) is not None]}
        if panel.values is not None
        else {key: _series(records, None, key)[1] for key in panel.y}
    )
    drew = False
    for label, values in groups.items():
        finite = [v for v in values if math.isfinite(v)]
        if finite:
            ax.hist(finite, bins=panel.bins, alpha=0.6 if len(groups) > 1 else 1.0, label=label)
            drew = True
    return drew


def _draw_bar(ax: Any, panel: Panel, records: list[Mapping[str, Any]]) -> bool:
    if panel.x is None:
        heights = {}
        for key in panel.y:
            series = _series(records, None, key)[1]
            if series:
                heights[key] = series[-1]
        if heights:
            ax.bar(list(heights), list(heights.values()))
        return bool(heights)
    width = 0.8 / max(len(panel.y), 1)
    labels: list[Any] = []
    for j, key in enumerate(panel.y):
        xs, ys = _series(records, panel.x, key)
        if ys:
            ax.bar([i + j * width for i in range(len(xs))], ys, width=width, label=key)
            labels = labels if len(labels) >= len(xs) else xs
    if labels:
        offset = width * (len(panel.y) - 1) / 2
        ax.set_xticks([i + offset for i in range(len(labels))], [str(v) for v in labels])
    ax.set_xlabel(panel.x)
    return bool(labels)


def _draw_timeline(ax: Any, panel: Panel, records: list[Mapping[str, Any]]) -> bool:
    """One row per lane, top to bottom in the lanes' order; one legend entry per state drawn."""
    from matplotlib.patches import Patch

    lanes = {lane: spans for lane, spans in (panel.lanes or {}).items() if spans}
    cycle = iter(f"C{i}" for i in range(10, 1000))
    colours: dict[str, str] = {}
    for row, spans in enumerate(lanes.values()):
        by_state: dict[str, list[tuple[float, float]]] = {}
        for start, duration, state in spans:
            by_state.setdefault(state, []).append((start, duration))
        for state, bars in by_state.items():
            colour = colours.setdefault(state, STATE_COLOURS.get(state) or next(cycle))
            ax.broken_barh(bars, (len(lanes) - 1 - row - 0.4, 0.8), facecolors=colour, linewidth=0)
    ax.set_yticks(range(len(lanes)), list(reversed(list(lanes))))
    ax.set_xlabel("seconds since the run started")
    if panel.until is not None:
        ax.set_xlim(0, panel.until)
    if colours:
        ax.legend(handles=[Patch(color=c, label=s) for s, c in colours.items()], fontsize="small",
                  loc="upper center", bbox_to_anchor=(0.5, -0.22), ncols=min(len(colours), 4), frameon=False)
    return bool(lanes)


_DRAW: dict[str, Callable[[Any, Panel, list[Mapping[str, Any]]], bool]] = {
    "line": _draw_line, "hist": _draw_hist, "bar": _draw_bar, "timeline": _draw_timeline,
}


def _draw_panel(ax: Any, panel: Panel, records: list[Mapping[str, Any]]) -> bool:
    """Draw `panel` on `ax`; False if there was nothing to draw."""
    draw = _DRAW.get(panel.kind)
    if draw is None:
        raise ValueError(f"panel {panel.title!r}: unknown kind {panel.kind!r}")
    drew = draw(ax, panel, records)
    if panel.xlabel is not None:
        ax.set_xlabel(panel.xlabel)
    labelled = len(ax.get_legend_handles_labels()[0])
    if panel.kind != "timeline" and (labelled > 1 or (labelled and panel.kind == "line")):
        ax.legend(fontsize="small")
    return drew


def _with_data(panels: list[Panel], records: list[Mapping[str, Any]]) -> list[Panel]:
    """The panels that draw something (each tried on a scratch figure)."""
    from matplotlib.figure import Figure

    scratch = Figure()
    return [panel for panel in panels if _draw_panel(scratch.add_subplot(), panel, records)]


def _layout(panels: list[Panel]) -> list[tuple[int, int | None]]:
    """(row, column) of each panel on a two-column grid, in order; a timeline takes a whole row
    (column None)."""
    cells: list[tuple[int, int | None]] = []
    row, col = 0, 0
    for panel in panels:
        if panel.kind == "timeline":
            row, col = (row + 1 if col else row), 0
            cells.append((row, None))
            row += 1
        else:
            cells.append((row, col))
            row, col = (row + 1, 0) if col else (row, 1)
    return cells


def render_report(
    path: Path | str,
    records: list[Mapping[str, Any]],
    panels: list[Panel],
    *,
    title: str | None = None,
) -> list[str]:
    """Write a PNG with one subplot per panel that has data (titled `title`, default the file's stem)
    atomically; returns the titles of the panels drawn, in order. With no data at all, one panel says so."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    shown = _with_data(panels, records)
    cells = _layout(shown)
    ncols = 1 if len(shown) <= 1 else 2
    nrows = max(1, max((row for row, _ in cells), default=0) + 1)
    fig = Figure(figsize=(6.4 * ncols, 3.8 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title if title is not None else path.stem, fontsize="x-large")
    grid = fig.add_gridspec(nrows, ncols)
    for panel, (row, col) in zip(shown, cells, strict=True):
        ax = fig.add_subplot(grid[row, :] if col is None or ncols == 1 else grid[row, col])
        ax.set_title(textwrap.fill(panel.title, TITLE_CHARS * (2 if col is None and ncols == 2 else 1)),
                     fontsize="medium")
        _draw_panel(ax, panel, records)
    if not shown:
        ax = fig.add_subplot(grid[0, 0])
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.set_xticks([])
        ax.set_yticks([])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return [panel.title for panel in shown]
