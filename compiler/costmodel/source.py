"""`CostSource`: cost models for any stage partition of one model, and its per-unit times.

The plan search tries several partitions; each needs its own CostModel (a stage's time is the
sum of its units'). A source holds what does not change between partitions (the loaded
profile, or the device spec and the traced model's lambdified unit costs or GPT shapes) and builds the model of a partition on demand,
once per partition. `unit_times` prices every unit alone, which is what the stage partitioner
balances: the model built for the partition with one unit per stage.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from tpc.compiler.costmodel.base import CostModel

Ranges = tuple[tuple[int, int], ...]


class CostSource:
    """`build(ranges) -> CostModel` for the partitions of a model of `num_units` units."""

    def __init__(self, num_units: int, build: Callable[[Ranges], CostModel]):
        if num_units < 1:
            raise ValueError("a model has at least one unit")
        self.num_units = num_units
        self._build = build
        self._cache: dict[Ranges, CostModel] = {}

    def for_stages(self, ranges) -> CostModel:
        key = tuple((int(lo), int(hi)) for lo, hi in ranges)
        if key not in self._cache:
            self._cache[key] = self._build(key)
        return self._cache[key]

    def unit_times(self, l, c, mb) -> np.ndarray:
        """(units, ...) forward + backward of every unit for slices (l, c, mb) (arrays
        broadcast together)."""
        singles = self.for_stages(tuple((u, u + 1) for u in range(self.num_units)))
        rows = []
        for u in range(self.num_units):
            f, b = singles.slice_times(u, l, c, mb)
            rows.append(np.broadcast_to(f + b, np.broadcast(np.asarray(l), np.asarray(c),
                                                            np.asarray(mb)).shape))
        return np.stack(rows)
