"""The simulator reproduces the textbook results of pipeline schedules exactly under unit costs.

Unit costs: forward 1, backward 2 per slice, transfers free. With p stages, m micro-batches
and one slice each, every rank computes for 3m and the iteration takes 3(m + p - 1), so a
rank's bubble (idle time / iteration time) is 3(p-1) / 3(m+p-1) = (p-1)/(m+p-1), for GPipe
and for 1F1B alike: 1F1B changes the order of work and the memory it needs, not the bubble.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from tests.compiler.simulate.plans import make_plan
from tpc.compiler.costmodel.unit import UnitCosts
from tpc.compiler.predict.simulate import simulate

SHAPES = [(2, 1), (2, 4), (3, 5), (4, 2), (4, 8), (5, 3)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", SHAPES)
def test_bubble_fraction_is_p_minus_1_over_m_plus_p_minus_1(schedule, p, m):
    result = simulate(make_plan(schedule, p, m), UnitCosts())
    assert result.iteration_time == 3 * (m + p - 1)
    expected = Fraction(p - 1, m + p - 1)
    for r in result.ranks:
        assert r.busy == 3 * m  # m forwards of 1 and m backwards of 2
        assert r.idle == result.iteration_time - r.busy
        # bubble is defined as idle / iteration time; the algebra above gives (p-1)/(m+p-1)
        assert r.bubble == pytest.approx(float(expected), abs=1e-12)
        assert Fraction(r.idle).limit_denominator() / Fraction(result.iteration_time) == expected


@pytest.mark.parametrize("p,m", SHAPES)
def test_gpipe_keeps_every_micro_batch_alive_on_every_stage(p, m):
    result = simulate(make_plan("gpipe", p, m), UnitCosts())
    assert [r.peak_memory.activations for r in result.ranks] == [m] * p


@pytest.mark.parametrize("p,m", SHAPES)
def test_1f1b_keeps_min_p_minus_i_m_micro_batches_alive_on_stage_i(p, m):
    result = simulate(make_plan("1f1b", p, m), UnitCosts())
    assert [r.peak_memory.activations for r in result.ranks] == [min(p - i, m) for i in range(p)]


@pytest.mark.parametrize("K,n", [(2, 1), (2, 4), (4, 8), (3, 16), (8, 4)])
def test_terapipe_one_micro_batch_costs_n_plus_K_minus_1_over_n_of_the_ideal(K, n):
    """One micro-batch cut into n equal slices on K stages, unit costs.

    The ideal is the time one stage needs for its own work if it never waited: n slice
    forwards and n slice backwards, 3n. Forwards fill the pipe in n + K - 1 slots of 1 and the
    backwards drain it in n + K - 1 slots of 2, so the iteration takes 3(n + K - 1), that is
    (n + K - 1)/n times the ideal.
    """
    result = simulate(make_plan("terapipe", K, 1, n), UnitCosts())
    ideal = 3 * n
    assert result.iteration_time == 3 * (n + K - 1)
    assert Fraction(result.iteration_time) / ideal == Fraction(n + K - 1, n)
    # every stage holds all n slice graphs of the micro-batch before its first backward
    assert [r.peak_memory.activations for r in result.ranks] == [n] * K


def test_slice_length_scaling_prices_unequal_slices_by_their_length():
    """With `UnitCosts.for_plan`, slices of 48 and 16 tokens (mean 32) cost 1.5 and 0.5."""
    plan = make_plan("terapipe", 2, 1, 2, slice_lengths=(48, 16))
    costs = UnitCosts.for_plan(plan.header)
    assert costs.slice_time(0, 48, 0, 1) == (1.5, 3.0)
    result = simulate(plan, costs)
    # F0 [0,1.5) F1 [1.5,2) on rank 0; rank 1: F0 [1.5,3) F1 [3,3.5) B1 [3.5,4.5) B0 [4.5,7.5);
    # rank 0: B1 [4.5,5.5) B0 [7.5,10.5)
    assert result.iteration_time == pytest.approx(10.5)
    assert [r.busy for r in result.ranks] == pytest.approx([6.0, 6.0])
