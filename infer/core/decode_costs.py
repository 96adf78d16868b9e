"""What a decode-only step of n rows costs on this machine, from the steps measured: a table by batch size.

Per size, the median of its latest SAMPLES steps; between two sizes measured, the line through them,
and below the smallest, the line through the two smallest (no lower than half the smallest's: a step
reads every weight whatever its rows); past the largest, the largest's scaled by rows (on the safe
side: a row costs less than a step's mean share of it). A table
by size rather than a window of recent steps, because a flood of wide steps would push the narrow
steps out of a window, and with them what a stream's step costs alone: the measure the group bound
holds a flood to (group_decode_bound.py), which one slow step of a busy machine must not replace.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque

SAMPLES = 8  # latest steps kept per batch size


class DecodeCosts:
    def __init__(self) -> None:
        self._samples: dict[int, deque[float]] = {}
        self._median: dict[int, float] = {}
        self._sizes: list[int] = []  # the sizes measured, ascending
        self._counts: dict[int, int] = {}  # steps measured per size, in all

    def add(self, rows: int, seconds: float) -> None:
        samples = self._samples.get(rows)
        if samples is None:
            samples = self._samples[rows] = deque(maxlen=SAMPLES)
            bisect.insort(self._sizes, rows)
        samples.append(seconds)
        self._counts[rows] = self._counts.get(rows, 0) + 1
        self._median[rows] = statistics.median(samples)

    def __bool__(self) -> bool:
        return bool(self._sizes)

    def count(self, rows: int) -> int:
        """How many steps of exactly `rows` rows were measured, in all."""
        return self._counts.get(rows, 0)

    def measured(self, lo: float, hi: float) -> bool:
        """Whether a size in [lo, hi] was measured."""
        i = bisect.bisect_left(self._sizes, lo)
        return i < len(self._sizes) and self._sizes[i] <= hi

    def seconds(self, rows: int) -> float | None:
        """A decode-only step of `rows` rows (module docstring); None before any step was measured."""
        sizes = self._sizes
        if not sizes:
            return None
        i = bisect.bisect_left(sizes, rows)
        if i < len(sizes) and sizes[i] == rows:
            return self._median[rows]
        if i == 0:
            t0 = self._median[sizes[0]]
            if len(sizes) == 1:
                return t0
            t1 = self._median[sizes[1]]
            slope = max(0.0, (t1 - t0) / (sizes[1] - sizes[0]))
            return max(t0 / 2, t0 - slope * (sizes[0] - rows))
        if i == len(sizes):
            return self._median[sizes[-1]] * rows / sizes[-1]
        a, b = sizes[i - 1], sizes[i]
        ta, tb = self._median[a], self._median[b]
        return ta + (tb - ta) * (rows - a) / (b - a)

    def above(self, rows: int) -> list[tuple[int, float]]:
        """The sizes measured above `rows`, ascending, with their costs."""
        return [(n, self._median[n]) for n in self._sizes[bisect.bisect_right(self._sizes, rows) :]]
