"""The price of a unit that drops tokens (random layerwise token dropping, random-LTD).

A dropped unit runs on a fraction f of each slice's tokens (compiler/frontend/random_ltd.py):
its own work is the traced unit's at l' = f l tokens over a cached context of c' = f c (its KV
cache holds the kept tokens only), so its attention scales with about f^2 and its MLP, norms and
projections with f. Around it the rewrite adds the gather of the kept tokens (an index_select:
l' rows read and written) and the scatter back (an index_copy that copies its whole input and
writes the l' rows: 2 l + l'), and the backward their adjoints (an index_add into zeros and an
index_fill of the kept rows: about the same); each counted as memory traffic of the residual
stream, (2 l + 3 l') b h bytes-per-float in each direction, 3 kernels forward and 4 backward.

f is the plan's kept count over the sequence at the schedule's mean
(`tpc.compiler.random_ltd.RandomLTD.priced_fraction`): one partition and one slicing serve every
step, so they are chosen for the average step of the kept-count ramp.
"""

from __future__ import annotations

import numpy as np

from tpc.compiler.frontend.flops import UnitCost, Work

_FWD_KERNELS, _BWD_KERNELS = 3, 4


class DroppedUnitCostFn:
    """`fn(l, c, b) -> UnitCost` of a unit that keeps `fraction` of its tokens, over the traced
    unit's `fn` (a `flops.UnitCostFn`); `hidden` and `float_bytes` size the gather and scatter."""

    def __init__(self, fn, fraction: float, hidden: int, float_bytes: int):
        if not 0 < fraction <= 1:
            raise ValueError(f"a kept fraction is in (0, 1], not {fraction}")
        self.fn, self.fraction, self.hidden, self.float_bytes = fn, float(fraction), int(hidden), int(float_bytes)
        self.label = fn.label
        self.signature = tuple(fn.signature) + (("kept", round(self.fraction, 12)),)

    def __call__(self, l, c, b) -> UnitCost:
        f = self.fraction
        l, c, b = (np.asarray(x, dtype=np.float64) for x in (l, c, b))
        inner = self.fn(l * f, c * f, b)
        moved = (2 * l + 3 * l * f) * b * self.hidden * self.float_bytes

        def plus(work: dict, kernels: int) -> dict:
            out = dict(work)
            m = work["memory"]
            out["memory"] = Work(m.flops, m.bytes + moved, m.kernels + kernels)
            return out

        return UnitCost(inner.label, plus(inner.fwd, _FWD_KERNELS), plus(inner.bwd, _BWD_KERNELS),
                        inner.stash + l * f * b * self.hidden * self.float_bytes, inner.held)

    def relabel(self, label: str) -> "DroppedUnitCostFn":
        return DroppedUnitCostFn(self.fn.relabel(label), self.fraction, self.hidden, self.float_bytes)
