"""A split backward's halves cost the cost model's `split_backward_time` where it has one (the
profiled model), half the backward each where it does not."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from tests.compiler.costmodel import synthetic
from tests.ir.plans import simple_plan
from tpc.compiler.costmodel import ProfiledCostModel
from tpc.compiler.costmodel.fit import CurveFit
from tpc.compiler.predict.memory import slice_extent
from tpc.compiler.costmodel.unit import UnitCosts
from tpc.compiler.predict.simulate import simulate
from tpc.ir.nodes import Op


def by_text(result, rank: int, text: str):
    [event] = [e for e in result.events_of(rank) if str(e.instr) == text]
    return event


@dataclass(frozen=True)
class SplitCosts(UnitCosts):
    """Unit costs whose backward, split, costs 1.5 (input) + 0.75 (weight) instead of 2."""

    def split_backward_time(self, stage, l, c, mb_size):
        return 1.5, 0.75


def test_split_halves_cost_what_the_cost_model_says():
    plan = simple_plan(2, 1, 1, split_backward=True)
    result = simulate(plan, SplitCosts())
    # rank 1: forward [1, 2), backward-input [2, 3.5), backward-weight [3.5, 4.25); rank 0's
    # backward-input waits for the gradient: [3.5, 5), then its backward-weight [5, 5.75)
    bi1 = by_text(result, 1, "backward-input stage 1 mb 0 slice 0")
    bw1 = by_text(result, 1, "backward-weight stage 1 mb 0 slice 0")
    bi0 = by_text(result, 0, "backward-input stage 0 mb 0 slice 0")
    bw0 = by_text(result, 0, "backward-weight stage 0 mb 0 slice 0")
    assert (bi1.start, bi1.end, bw1.start, bw1.end) == (2.0, 3.5, 3.5, 4.25)
    assert (bi0.start, bi0.end, bw0.start, bw0.end) == (3.5, 5.0, 5.0, 5.75)
    assert result.iteration_time == 5.75
    assert [r.busy for r in result.ranks] == [3.25, 3.25]


def test_without_split_backward_time_each_half_is_half_the_backward():
    plan = simple_plan(2, 1, 1, split_backward=True)
    result = simulate(plan, UnitCosts())
    bi0 = by_text(result, 0, "backward-input stage 0 mb 0 slice 0")
    bw0 = by_text(result, 0, "backward-weight stage 0 mb 0 slice 0")
    assert (bi0.start, bi0.end, bw0.start, bw0.end) == (3.0, 4.0, 4.0, 5.0)
    assert result.iteration_time == 5.0


def _scaled(fit: CurveFit, k: float) -> CurveFit:
    return CurveFit(fit.lengths, tuple(k * v for v in fit.base), tuple(k * v for v in fit.coef), 0.0)


def _profile(input_share: float | None, weight_share: float | None):
    """Two synthetic units; their split halves `input_share` and `weight_share` of the
    backward (None: not measured)."""
    units = []
    for u in (synthetic.unit("a", 20e-6, 1e-6, 2e-9), synthetic.unit("b", 40e-6, 2e-6, 4e-9)):
        if input_share is not None:
            u = dataclasses.replace(u, bwd_input=tuple(_scaled(f, input_share) for f in u.bwd),
                                    bwd_weight=tuple(_scaled(f, weight_share) for f in u.bwd))
        units.append(u)
    return synthetic.profile(units)


@pytest.mark.parametrize("mb_size", [1, 3])
def test_a_profiled_model_prices_the_halves_from_its_fits(mb_size):
    plan = simple_plan(2, 2, [8, 24], split_backward=True, mb_size=mb_size)
    measured = ProfiledCostModel(_profile(0.75, 0.45), [(0, 1), (1, 2)])
    unmeasured = ProfiledCostModel(_profile(None, None), [(0, 1), (1, 2)])
    for cm, shares in ((measured, (0.75, 0.45)), (unmeasured, (0.5, 0.5))):
        result = simulate(plan, cm)
        n = 0
        for e in result.events:
            if e.instr.op in (Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT):
                l, c, size = slice_extent(plan.header, e.instr)
                _, t_bwd = cm.slice_time(e.instr.stage, l, c, size)
                share = shares[e.instr.op is Op.BACKWARD_WEIGHT]
                assert e.work == pytest.approx(share * t_bwd)
                n += 1
        assert n == 16  # 2 ranks x 2 micro-batches x 2 slices x 2 halves
    # the measured halves add up to 1.2 backwards: every rank is busier than with halves
    busy = [r.busy for r in simulate(plan, measured).ranks]
    assert all(b > h for b, h in zip(busy, (r.busy for r in simulate(plan, unmeasured).ranks)))
