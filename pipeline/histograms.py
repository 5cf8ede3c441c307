"""Sparse histograms on fixed bins, so that histograms of different steps (and of different
outcomes) add up and compare bin by bin.

A histogram is `{lower edge as text: count}`, holding only non-empty bins, ordered by edge; it is
plain JSON. `Bins` says where the edges are: linear (`width`) or powers of two (`log2`, for
non-negative sizes such as token counts: bins 0, 1, [2, 4), [4, 8) ...; at most ~64 bins whatever
the range). Nothing here knows what the values mean.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

Histogram = dict[str, int]


@dataclass(frozen=True)
class Bins:
    width: float | None = None  # linear bins [i * width, (i + 1) * width)
    log2: bool = False  # bins {0}, [1, 2), [2, 4), [4, 8) ...: values below 1 fall in 0

    def __post_init__(self) -> None:
        if (self.width is None) == (not self.log2):
            raise ValueError("Bins takes exactly one of width=... or log2=True")
        if self.width is not None and not self.width > 0:
            raise ValueError(f"Bins.width must be > 0, got {self.width}")

    def edge(self, value: float) -> float:
        """The lower edge of the bin `value` falls in."""
        if self.log2:
            return 0.0 if value < 1 else float(2 ** math.floor(math.log2(value)))
        assert self.width is not None
        return round(math.floor(value / self.width + 1e-9) * self.width, 9)  # 1e-9: 0.3 / 0.1 is 2.999...

    def count(self, values: Iterable[float]) -> Histogram:
        counts: dict[float, int] = {}
        for value in values:
            if math.isfinite(value):
                edge = self.edge(value)
                counts[edge] = counts.get(edge, 0) + 1
        return {f"{edge:g}": counts[edge] for edge in sorted(counts)}


def merge(*histograms: Mapping[str, int]) -> Histogram:
    """The bin-by-bin sum of histograms made with the same `Bins`."""
    total: dict[str, int] = {}
    for histogram in histograms:
        for edge, n in histogram.items():
            total[edge] = total.get(edge, 0) + n
    return {edge: total[edge] for edge in sorted(total, key=float)}
