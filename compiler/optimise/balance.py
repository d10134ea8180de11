"""Stage partitions from measured per-unit costs: which units each pipeline stage holds.

The front end cuts a model into units (embedding, one per Transformer block, head). A stage is
a contiguous run of units, and its time for a slice is the sum of its units' times (true of
both cost models: a profile is measured per unit, the analytic model is per layer plus the
embedding and head). Stages need not hold equally many layers: the first stage also embeds and
the last also runs the LM head and loss, so a balanced pipeline gives them fewer blocks.

Two objectives:

* `minmax_partition(weights, K)`: the contiguous cut minimising the heaviest stage of one
  weight per unit (exact, O(K n^2)); with weights = each unit's work over the whole step it
  balances the stages' busy time.
* `best_partition(W, K, extra)`: the cut minimising TeraPipe's latency of a *fixed* slicing,

      sum_i slot_i + (K - 1) * max_i slot_i,   slot_i = max_s sum_{u in s} W[u, i] + extra[i]

  (W[u, i]: forward + backward of unit u on slice i; extra: the slice's transfers). This is
  what the optimiser's DP prices, so a partition chosen by it is the one the DP's slicing
  wants. Exact by enumeration while the number of cuts C(n-1, K-1) is at most
  `exhaustive_limit`; beyond that, the min-max cut of the total work improved by moving one
  stage boundary at a time by one unit while that lowers the latency (a local optimum).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

Ranges = tuple[tuple[int, int], ...]

# C(n-1, K-1) partitions or fewer are enumerated (a 12-unit model over 4 stages has 165)
EXHAUSTIVE_LIMIT = 5000


def _check(n: int, K: int) -> None:
    if not 1 <= K <= n:
        raise ValueError(f"cannot cut {n} units into {K} stages")


def ranges_from_bounds(bounds) -> Ranges:
    """Stage ranges from the inner boundaries (b_1 < ... < b_{K-1}) and the unit count last
    (from lengths instead: `tpc.compiler.optimise.slicing.ranges_of`)."""
    edges = [0, *bounds]
    return tuple((int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]))


def minmax_partition(weights, K: int) -> Ranges:
    """Contiguous ranges tiling the units, minimising the largest range sum: the one min-max
    partition of tpc (the front end's parameter balance calls it too).

    Ties: among the cuts with the least heaviest stage, the last stage starts as late as it can
    (it is as light as it can be), and the units before it are cut by the same rule into K - 1
    stages (a min-max cut of that prefix). So the result is deterministic, and integer weights
    (parameter counts, exact in float64 below 2**53) are compared exactly."""
    w = np.asarray(weights, dtype=np.float64)
    n = len(w)
    _check(n, K)
    prefix = np.concatenate(([0.0], np.cumsum(w)))
    best = np.full((K + 1, n + 1), np.inf)
    arg = np.zeros((K + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for k in range(1, K + 1):
        for i in range(k, n - (K - k) + 1):
            j = np.arange(k - 1, i)
            c = np.maximum(best[k - 1, j], prefix[i] - prefix[j])
            pick = len(c) - 1 - int(np.argmin(c[::-1]))  # the latest j among equals
            best[k, i], arg[k, i] = c[pick], j[pick]
    bounds, i = [], n
    for k in range(K, 0, -1):
        bounds.append(i)
        i = int(arg[k, i])
    return ranges_from_bounds(reversed(bounds))


def stage_sums(W: np.ndarray, ranges: Ranges) -> np.ndarray:
    """(K, slices): each stage's time of each slice, the sums of its units' rows of W."""
    prefix = np.vstack((np.zeros((1, W.shape[1])), np.cumsum(W, axis=0)))
    return np.stack([prefix[hi] - prefix[lo] for lo, hi in ranges])


def latency(W: np.ndarray, ranges: Ranges, extra=0.0) -> float:
    """TeraPipe's latency of the slices that are W's columns under `ranges` (module docstring)."""
    slot = stage_sums(W, ranges).max(axis=0) + extra
    return float(slot.sum() + (len(ranges) - 1) * slot.max())


def best_partition(W, K: int, extra=0.0, exhaustive_limit: int = EXHAUSTIVE_LIMIT) -> Ranges:
    """The partition minimising `latency(W, ., extra)`; see the module docstring for when it is
    exact. Among equal latencies the first in enumeration order (earliest boundaries) wins."""
    W = np.atleast_2d(np.asarray(W, dtype=np.float64))
    n = W.shape[0]
    _check(n, K)
    if math.comb(n - 1, K - 1) <= exhaustive_limit:
        best, best_t = None, np.inf
        for inner in itertools.combinations(range(1, n), K - 1):
            r = ranges_from_bounds((*inner, n))
            t = latency(W, r, extra)
            if t < best_t:
                best, best_t = r, t
        return best
    current = minmax_partition(W.sum(axis=1), K)
    t = latency(W, current, extra)
    improved = True
    while improved:  # first-improvement hill climbing over single-unit boundary moves
        improved = False
        bounds = [hi for _, hi in current]
        for b in range(K - 1):
            for step in (-1, 1):
                moved = bounds.copy()
                moved[b] += step
                lo = moved[b - 1] if b else 0
                if not lo < moved[b] < moved[b + 1]:
                    continue
                r = ranges_from_bounds(moved)
                tr = latency(W, r, extra)
                if tr < t * (1 - 1e-12):
                    current, t, improved = r, tr, True
                    break
            if improved:
                break
    return current
