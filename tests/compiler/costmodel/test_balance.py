"""Stage partitions from per-unit costs against brute force, and cost sources that price any
partition as the sum of its units."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tpc.compiler.optimise.balance import best_partition, latency, minmax_partition
from tpc.compiler.costmodel import AnalyticCostModel, ModelShapes, ProfiledCostModel, even_layers
from tpc.compiler.costmodel.devices import V100
from tpc.compiler.costmodel.source import CostSource
from tests.compiler.costmodel import synthetic


def all_partitions(n: int, K: int):
    """Every way to cut units 0..n-1 into K non-empty contiguous runs, built run by run."""
    def extend(start, left):
        if left == 1:
            yield [(start, n)]
            return
        for end in range(start + 1, n - left + 2):
            for rest in extend(end, left - 1):
                yield [(start, end)] + rest

    yield from extend(0, K)


def brute_latency(W, ranges, extra):
    slots = []
    for i in range(W.shape[1]):
        per_stage = [sum(W[u, i] for u in range(lo, hi)) for lo, hi in ranges]
        slots.append(max(per_stage) + (extra[i] if np.ndim(extra) else extra))
    return sum(slots) + (len(ranges) - 1) * max(slots)


CASES = [(seed, n, K) for seed in range(3) for n in range(1, 8) for K in range(1, n + 1)]


@pytest.mark.parametrize("seed,n,K", CASES)
def test_minmax_partition_equals_brute_force(seed, n, K):
    w = np.random.default_rng(seed).uniform(0.1, 5.0, n)
    got = minmax_partition(w, K)
    assert len(got) == K and got[0][0] == 0 and got[-1][1] == n
    assert all(hi > lo for lo, hi in got) and all(a[1] == b[0] for a, b in zip(got, got[1:]))
    want = min(max(w[lo:hi].sum() for lo, hi in p) for p in all_partitions(n, K))
    assert max(w[lo:hi].sum() for lo, hi in got) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("seed,n,K", CASES)
def test_best_partition_equals_brute_force_latency(seed, n, K):
    rng = np.random.default_rng(100 + seed)
    W = rng.uniform(0.1, 5.0, (n, 6)) * rng.uniform(0.2, 3.0, (1, 6))  # slices differ in size
    extra = rng.uniform(0.0, 0.5, 6)
    got = best_partition(W, K, extra)
    want = min(brute_latency(W, p, extra) for p in all_partitions(n, K))
    assert brute_latency(W, got, extra) == pytest.approx(want, rel=1e-12)
    assert latency(W, got, extra) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_local_search_improves_on_minmax_and_stays_valid(seed):
    """Past the enumeration limit: never worse than the min-max cut of the total work, never
    better than the true optimum (which brute force still finds at this size)."""
    rng = np.random.default_rng(200 + seed)
    n, K = 9, 4
    W = rng.uniform(0.1, 5.0, (n, 5)) * rng.uniform(0.2, 3.0, (1, 5))
    got = best_partition(W, K, 0.1, exhaustive_limit=0)
    start = minmax_partition(W.sum(axis=1), K)
    optimum = min(brute_latency(W, p, 0.1) for p in all_partitions(n, K))
    assert optimum - 1e-12 <= brute_latency(W, got, 0.1) <= brute_latency(W, start, 0.1) + 1e-12


def test_ties_are_broken_the_same_way_every_time():
    assert minmax_partition([1, 1, 1, 1], 2) == ((0, 2), (2, 4))
    assert best_partition(np.ones((4, 3)), 2) == ((0, 2), (2, 4))
    with pytest.raises(ValueError, match="cannot cut 3 units into 4 stages"):
        minmax_partition([1, 1, 1], 4)


def test_among_equal_heaviest_stages_the_last_stage_is_the_lightest():
    """[10], [3, 3], [3, 3, 1] and [10], [3, 3, 3], [3, 1] both have 10 as their heaviest stage:
    the last stage starts as late as it can. The front end's parameter balance is this DP."""
    from tpc.compiler.frontend.partition import partition_balanced

    assert minmax_partition([10, 3, 3, 3, 3, 1], 3) == ((0, 1), (1, 4), (4, 6))
    assert minmax_partition([1, 1, 1, 1, 1], 2) == ((0, 3), (3, 5))
    for weights, K in (([10, 3, 3, 3, 3, 1], 3), ([1, 1, 1, 1, 1], 2), ([7, 2, 2, 2, 2, 2, 5], 4)):
        assert partition_balanced(weights, K) == list(minmax_partition(weights, K))


def test_heavy_head_gets_fewer_layers_on_the_last_stage():
    """A GPT-2 medium sized analytic model: with the LM head on the last stage, the balanced partition
    gives that stage fewer blocks than the others, and beats even layers on the formula."""
    shapes = ModelShapes(layers=24, hidden=1024, heads=16, vocab=50257)
    source = CostSource(26, lambda r: AnalyticCostModel(V100, shapes, _layers(r, 26)))
    # four 512-token slices of 8 sequences: long enough that the head's matmul, not kernel
    # launches, sets its time (about 1.7 blocks)
    W = source.unit_times(np.full(4, 512.0), np.arange(4) * 512.0, np.full(4, 8.0))
    got = best_partition(W, 4)
    counts = [hi - lo for lo, hi in got]
    assert counts[-1] < counts[1] and counts[-1] < counts[2]
    even = even_layers(24, 4)
    ends = np.cumsum((even[0] + 1,) + even[1:-1] + (even[-1] + 1,))
    even_ranges = tuple(zip((0, *ends[:-1]), ends))
    assert latency(W, got) < latency(W, even_ranges)


def _layers(ranges, n):
    return tuple(sum(1 for u in range(lo, hi) if 0 < u < n - 1) for lo, hi in ranges)


@pytest.mark.parametrize("kind", ["analytic", "profiled"])
def test_a_stage_costs_the_sum_of_its_units(kind):
    if kind == "analytic":
        shapes = ModelShapes(layers=4, hidden=256, heads=4, vocab=1000)
        source = CostSource(6, lambda r: AnalyticCostModel(V100, shapes, _layers(r, 6)))
    else:
        prof = synthetic.tiny_gpt_profile("0" * 64)
        source = CostSource(4, lambda r: ProfiledCostModel(prof, r))
    n = source.num_units
    l, c, b = np.array([8.0, 24.0, 40.0]), np.array([0.0, 8.0, 16.0]), np.array([1.0, 2.0, 3.0])
    units = source.unit_times(l, c, b)
    assert units.shape == (n, 3) and (units > 0).all()
    for K in range(1, n + 1):
        for ranges in itertools.islice(all_partitions(n, K), 5):
            cost = source.for_stages(ranges)
            assert source.for_stages(ranges) is cost  # built once per partition
            for s, (lo, hi) in enumerate(ranges):
                f, bw = cost.slice_times(s, l, c, b)
                np.testing.assert_allclose(f + bw, units[lo:hi].sum(axis=0), rtol=1e-12)
