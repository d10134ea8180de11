"""The plan search prunes a candidate whose busiest rank's compute (`busy_bound`) already takes
longer than a plan found so far. That is sound only if the bound is a lower bound of every
schedule's simulated step time, split-backward schedules included: measured backward halves
may together cost less than the measured whole backward."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.compiler.simulate.plans import make_plan
from tpc.compiler.costmodel.unit import UnitCosts
from tpc.compiler.optimise.search import Slicing, busy_bound
from tpc.compiler.predict.simulate import simulate
from tpc.ir.semantics import GLOO


@dataclass(frozen=True)
class CheapHalves(UnitCosts):
    """Unit costs whose two backward halves together cost 60% of a whole backward."""

    def split_backward_time(self, stage, l, c, mb_size):
        b = self.slice_time(stage, l, c, mb_size)[1]
        return 0.3 * b, 0.3 * b


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-h2", "seq-zb", "gpipe"])
@pytest.mark.parametrize("costs", [UnitCosts(), CheapHalves()], ids=["even", "cheap-halves"])
def test_the_busy_bound_never_exceeds_the_simulated_step(schedule, costs):
    plan = make_plan(schedule, 2, 4, 2, seq=32)
    h = plan.header
    slicing = Slicing("given", tuple(m.size for m in h.microbatches), tuple(m.slices for m in h.microbatches))
    bound = busy_bound(_Staged(costs, h.num_stages), slicing, data=1)
    assert bound <= simulate(plan, costs, GLOO).iteration_time + 1e-12


class _Staged:
    """A cost model that knows how many stages it prices (what the search hands `busy_bound`)."""

    def __init__(self, costs, num_stages: int):
        self.costs, self.num_stages = costs, num_stages

    def __getattr__(self, name):
        return getattr(self.costs, name)
