"""The optimiser's DP and knapsack against brute force on problems small enough to enumerate."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tpc.compiler.optimise import terapipe_dp as dp
from tpc.compiler.costmodel.base import slot_times
from tpc.compiler.optimise.slice_optimiser import best_slicing, explain, optimise
from tpc.ir.diagnostics import TpirError
from tests.compiler.costmodel.toy import ToyCost


def compositions(n: int):
    """Every way to write n as an ordered sum of positive parts."""
    for cuts in itertools.product((0, 1), repeat=n - 1):
        parts, run = [], 1
        for c in cuts:
            if c:
                parts.append(run)
                run = 1
            else:
                run += 1
        parts.append(run)
        yield parts


def partitions(n: int, largest: int | None = None):
    """Every multiset of positive sizes summing to n, sizes non-increasing."""
    largest = n if largest is None else largest
    if n == 0:
        yield []
        return
    for first in range(min(n, largest), 0, -1):
        for rest in partitions(n - first, first):
            yield [first] + rest


def slicings(L: int, g: int):
    pos = dp.positions(L, g)
    n = len(pos) - 1
    for parts in compositions(n):
        idx = np.cumsum([0] + parts)
        yield tuple((int(pos[a]), int(pos[b])) for a, b in zip(idx[:-1], idx[1:]))


def slot(cost, sl, b):
    lo, hi = sl
    return float(slot_times(cost, np.array([hi - lo]), np.array([lo]), np.array([b]))[0])


def brute_force(cost, K, L, batch, g, count=None):
    """min over micro-batch multisets and, per micro-batch, every slicing, of
    sum of slot times + (K-1) * max slot time."""
    options = {}  # size -> list of (times tuple)
    best = np.inf
    for sizes in partitions(batch):
        if count is not None and len(sizes) != count:
            continue
        per = []
        for b in sizes:
            if b not in options:
                options[b] = [tuple(slot(cost, sl, b) for sl in s) for s in slicings(L, g)]
            per.append(options[b])
        for combo in itertools.product(*per):
            ts = [t for times in combo for t in times]
            best = min(best, sum(ts) + (K - 1) * max(ts))
    return best


@pytest.mark.parametrize("seed,K,L,g", [(0, 2, 40, 8), (1, 4, 48, 8), (2, 8, 36, 8), (3, 1, 32, 8),
                                        (4, 16, 56, 8), (5, 3, 21, 4)])
def test_token_dp_equals_brute_force(seed, K, L, g):
    cost = ToyCost(seed)
    slices, predicted = best_slicing(cost, K, L, 1, granularity=g)
    want = brute_force(cost, K, L, 1, g)
    assert predicted == pytest.approx(want, rel=1e-12)
    # the slicing returned achieves the predicted time and covers [0, L) in order
    assert slices[0][0] == 0 and slices[-1][1] == L
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))
    ts = [slot(cost, sl, 1) for sl in slices]
    assert sum(ts) + (K - 1) * max(ts) == pytest.approx(predicted, rel=1e-12)


@pytest.mark.parametrize("seed,K,batch,count", [(10, 4, 3, None), (11, 6, 4, None), (12, 2, 4, 2),
                                                (13, 8, 5, None), (14, 5, 4, 3)])
def test_knapsack_with_slicing_equals_brute_force(seed, K, batch, count):
    cost = ToyCost(seed)
    L, g = 24, 8
    ch = optimise(cost, K, L, batch, microbatches=count, granularity=g)
    assert ch.predicted_time == pytest.approx(brute_force(cost, K, L, batch, g, count), rel=1e-12)
    assert sum(ch.mb_sizes) == batch
    if count is not None:
        assert len(ch.mb_sizes) == count
    ts = [slot(cost, sl, b) for b, sls in zip(ch.mb_sizes, ch.slices) for sl in sls]
    assert sum(ts) + (K - 1) * max(ts) == pytest.approx(ch.predicted_time, rel=1e-12)


def test_batch_only_is_the_unsliced_brute_force():
    cost = ToyCost(20)
    K, L, batch = 4, 32, 5
    ch = optimise(cost, K, L, batch, token_slicing=False)
    assert all(len(s) == 1 for s in ch.slices)
    assert ch.predicted_time == pytest.approx(brute_force(cost, K, L, batch, L), rel=1e-12)
    assert ch.unsliced_time == ch.predicted_time


def test_token_slicing_never_loses_to_batch_only():
    for seed in range(5):
        ch = optimise(ToyCost(seed, num_stages=4), 4, 64, 4)
        assert ch.predicted_time <= ch.unsliced_time + 1e-12


def test_knapsack_alone_against_enumeration():
    rng = np.random.default_rng(7)
    sizes = (1, 2, 3, 4, 5)
    seq_cost = rng.uniform(1, 10, (3, len(sizes)))
    for batch in range(1, 8):
        q, arg = dp.knapsack(seq_cost, sizes, batch)
        for row in range(3):
            want = min(sum(seq_cost[row, b - 1] for b in p) for p in partitions(batch, 5))
            assert q[row] == pytest.approx(want)
            picks = dp.knapsack_choice(arg, sizes, batch, None, row=row)
            assert sum(sizes[i] for i in picks) == batch
            assert sum(seq_cost[row, i] for i in picks) == pytest.approx(want)


def test_granularity_that_does_not_divide_L():
    pos = dp.positions(21, 8)
    assert pos.tolist() == [0, 8, 16, 21]
    ch = optimise(ToyCost(3), 3, 21, 2, granularity=8)
    for sls in ch.slices:
        assert sls[-1][1] == 21 and all(lo % 8 == 0 for lo, _ in sls)


def test_bad_inputs_are_located_errors():
    with pytest.raises(TpirError) as e:
        optimise(ToyCost(0), 2, 16, 2, microbatches=3)
    assert "hint" in str(e.value)
    with pytest.raises(TpirError):
        optimise(ToyCost(0), 0, 16, 2)


def test_explain_names_the_choice():
    ch = optimise(ToyCost(1), 4, 48, 2)
    text = explain(ch)
    assert f"predicted step {ch.predicted_time:.6g} s" in text
    assert "without token slicing" in text and "distinct slot times" in text
