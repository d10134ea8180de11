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
    """`build(ranges) -> CostModel` for the partitions of a model of `num_units` units.

    With `tensor` given, `build(ranges, tensor) -> CostModel` prices each stage split over a
    tensor group of that many ranks, and `split(T)` is the source of the same model at degree T
    (the plan search prices every tensor degree it tries); without, the source prices unsplit
    stages only."""

    def __init__(self, num_units: int, build: Callable, tensor: int | None = None):
        if num_units < 1:
            raise ValueError("a model has at least one unit")
        self.num_units = num_units
        self.tensor = 1 if tensor is None else tensor
        self._any_tensor = build if tensor is not None else None
        self._build = build if tensor is None else (lambda ranges: build(ranges, self.tensor))
        self._cache: dict[Ranges, CostModel] = {}
        self._splits: dict[int, CostSource] = {self.tensor: self}

    def split(self, tensor: int) -> "CostSource":
        """The source of the same model with every stage split over `tensor` ranks (built
        once per degree)."""
        if tensor not in self._splits:
            if self._any_tensor is None:
                raise ValueError(f"this cost source cannot price a tensor split (degree {tensor})")
            other = CostSource(self.num_units, self._any_tensor, tensor)
            other._splits = self._splits  # one family: any member's split is shared
            self._splits[tensor] = other
        return self._splits[tensor]

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
