"""A small cost model with known, irregular slice times, for testing the optimiser."""

from __future__ import annotations

import numpy as np

from tpc.compiler.costmodel.base import CostModel


class ToyCost(CostModel):
    """t(l, c, b) = fixed + per-token work + attention over the context, per stage.

    Only the required scalar methods are its own, so the base class's defaults are exercised.
    The coefficients come from a seed; every term is >= 0, so a slice's time never falls as
    its context grows (the DP relies on that).
    """

    def __init__(self, seed: int, num_stages: int = 2):
        rng = np.random.default_rng(seed)
        self.num_stages = num_stages
        self.fixed = rng.uniform(0.5, 3.0, num_stages)
        self.per_tok = rng.uniform(0.05, 0.2, num_stages)
        self.attn = rng.uniform(0.0, 0.004, num_stages)
        self.batch_gain = rng.uniform(0.5, 1.0)  # a bigger micro-batch is cheaper per row
        self.link = rng.uniform(0.0, 0.5)

    def slice_time(self, stage, l, c, mb_size):
        rows = mb_size ** self.batch_gain
        f = self.fixed[stage] + rows * (self.per_tok[stage] * l + self.attn[stage] * l * (c + l))
        return f, 2 * f

    def p2p_time(self, nbytes):
        return self.link + nbytes * 1e-4

    def activation_bytes(self, l, mb_size):
        return l * mb_size * 4

    def kv_bytes(self, stage, l, mb_size):
        return 2 * l * mb_size * 4

    def param_bytes(self, stage):
        return 1000
