"""The evaluation program the compiler emits (compiler/lowering/eval_program.py): valid for any mesh and
stage placement, forward only, priced by the simulator; and the slice DP without backward
(`optimise(..., backward=False)`), against brute force."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.compiler import make_header
from tests.compiler.costmodel.test_dp import partitions, slicings
from tests.compiler.costmodel.toy import ToyCost
from tpc.compiler.costmodel.base import slot_times
from tpc.compiler.costmodel.unit import UnitCosts
from tpc.compiler.lowering.eval_program import eval_program, eval_slicing
from tpc.compiler.lowering.lower import lower
from tpc.compiler.schedules import build_schedule
from tpc.compiler.predict.simulate import simulate
from tpc.compiler.optimise.slice_optimiser import optimise
from tpc.ir.nodes import EVAL_OPS, Microbatch, Op
from tpc.ir.parse import parse
from tpc.ir.printer import print_plan
from tpc.ir.verify import check

HEADERS = {
    "k2": dict(stages=2, slices=3, mbs=2),
    "k3-dp2": dict(stages=3, slices=(10, 6, 8), mbs=3, dp=2),
    "k4-on-2-ranks-tied": dict(stages=4, slices=2, mbs=2, stage_ranks=(0, 1, 0, 1), ties=(("wte", (0, 3)),)),
    "k4-vshape": dict(stages=4, slices=2, mbs=2, stage_ranks=(0, 1, 1, 0)),
    "k1": dict(stages=1, slices=4, mbs=1),
}


@pytest.mark.parametrize("case", HEADERS)
def test_eval_program_is_valid_and_forward_only(case):
    spec = dict(HEADERS[case])
    header = make_header(spec.pop("stages"), **spec)
    plan = lower(header, build_schedule("gpipe", header))
    # its own slicing: one micro-batch of the whole replica batch, two unequal slices
    mbs = (Microbatch(0, header.replica_batch, ((0, 7), (7, header.shape.seq))),)
    for micro in (None, mbs):
        with_eval = dataclasses.replace(plan, eval=eval_program(header, micro))
        check(with_eval)
        assert parse(print_plan(with_eval)) == with_eval
        view = with_eval.evaluation()
        ops = [i.op for r in view.ranks for i in r.instrs]
        assert set(ops) <= EVAL_OPS
        assert ops.count(Op.REDUCE_LOSS) == (1 if header.mesh.data > 1 else 0)
        n_slices = sum(len(m.slices) for m in view.header.microbatches)
        assert ops.count(Op.FORWARD) == n_slices * header.num_stages


@pytest.mark.parametrize("stages,mbs,slices", [(2, 1, 4), (4, 2, 3), (3, 3, 1)])
def test_simulator_prices_the_pipelined_forward_and_keeps_no_stash(stages, mbs, slices):
    """Unit costs (forward 1, free transfers): n slices through K stages take n + K - 1, the
    GPipe forward fill; only KV caches (0 here) are held, no activation stash."""
    header = make_header(stages, slices=slices, mbs=mbs)
    plan = dataclasses.replace(lower(header, build_schedule("gpipe", header)), eval=eval_program(header))
    sim = simulate(plan.evaluation(), UnitCosts())
    assert sim.iteration_time == pytest.approx(mbs * slices + stages - 1)
    assert all(r.peak_memory.activations == 0 for r in sim.ranks)
    train = simulate(plan, UnitCosts())
    assert max(r.peak_memory.activations for r in train.ranks) > 0


def test_reduce_loss_is_priced_as_an_allreduce():
    header = make_header(2, slices=2, mbs=1, dp=4)
    plan = dataclasses.replace(lower(header, build_schedule("gpipe", header)), eval=eval_program(header))
    cost = ToyCost(0)
    sim = simulate(plan.evaluation(), cost)
    (ev,) = [e for e in sim.events if e.instr.op is Op.REDUCE_LOSS]
    assert ev.end - ev.start == pytest.approx(cost.allreduce_time(8.0, 4)) and ev.end > ev.start


def _forward_only_brute_force(cost, K, L, batch, g):
    best = np.inf
    for sizes in partitions(batch):
        per = [[tuple(float(slot_times(cost, np.array([hi - lo]), np.array([lo]), np.array([b]), backward=False)[0])
                      for lo, hi in s) for s in slicings(L, g)] for b in sizes]
        for combo in __import__("itertools").product(*per):
            ts = [t for times in combo for t in times]
            best = min(best, sum(ts) + (K - 1) * max(ts))
    return best


@pytest.mark.parametrize("seed,K,L,batch", [(0, 2, 24, 2), (1, 4, 32, 1), (2, 1, 24, 2), (3, 3, 24, 3)])
def test_forward_only_dp_equals_brute_force(seed, K, L, batch):
    cost = ToyCost(seed, num_stages=K)
    ch = optimise(cost, K, L, batch, granularity=8, backward=False)
    assert ch.predicted_time == pytest.approx(_forward_only_brute_force(cost, K, L, batch, 8), rel=1e-12)
    assert ch.sync_time == 0.0  # no gradients to synchronise


def _forward_only_time(cost, K, mbs) -> float:
    ts = [float(slot_times(cost, np.array([hi - lo]), np.array([lo]), np.array([m.size]), backward=False)[0])
          for m in mbs for lo, hi in m.slices]
    return sum(ts) + (K - 1) * max(ts)


@pytest.mark.parametrize("seed", [5, 7, 9])
def test_eval_slicing_beats_the_training_slicing_for_a_forward_only_program(seed):
    """The evaluation's own slicing is the DP's optimum without backward: priced forward only,
    no slower than the training program's slicing (the DP's optimum with backward). With a
    backward of exactly twice the forward and free transfers the two objectives are
    proportional and the slicings agree, as they do here."""
    K, L, rows = 4, 64, 2
    cost = ToyCost(seed, num_stages=K)
    train = optimise(cost, K, L, rows, granularity=8)
    header = dataclasses.replace(make_header(K, slices=1, mbs=1, seq=L, rows_per_mb=rows), microbatches=tuple(
        Microbatch(m, b, s) for m, (b, s) in enumerate(zip(train.mb_sizes, train.slices))))
    evaluation = eval_slicing(cost, header, granularity=8)
    assert sum(m.size for m in evaluation) == rows
    assert _forward_only_time(cost, K, evaluation) <= _forward_only_time(cost, K, header.microbatches) * (1 + 1e-12)
