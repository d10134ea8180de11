"""Merak's critical-path 1F1B (compiler/schedules/critical_path.py): the orders each variant
writes, the plans verify for any slicing, `--recompute` leaves their recomputation as placed, and
the simulator's unit-cost figures (forward 1, recompute 1, backward 2) that docs/schedules.md and
bench/critical_path.py report."""

from __future__ import annotations

import itertools

import pytest

from tests.compiler.simulate.plans import make_header as sim_header
from tpc.compiler.costmodel.unit import UnitCosts
from tpc.compiler.lowering import recompute
from tpc.compiler.lowering.lower import lower
from tpc.compiler.predict.simulate import simulate
from tpc.compiler.schedules import build_schedule, own_recompute
from tpc.ir.nodes import Op
from tpc.ir.semantics import GLOO, NCCL
from tpc.ir.verify import check

from . import make_header

VARIANTS = ("1f1b-pre-recompute", "1f1b-last-no-recompute", "1f1b-critical-path")


def _order(compute, rank):
    """A rank's order as F/R/B + micro-batch, slice 0 only."""
    return [f"{i.op.value[0].upper()}{i.mb}" for i in compute[rank] if i.slice == 0]


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("K,slices,mbs,dp", list(itertools.product([1, 2, 4], [1, 3, (5, 11, 1, 7)], [1, 2, 3, 5], [1, 2])))
def test_every_shape_lowers_to_a_verified_plan(name, K, slices, mbs, dp):
    header = make_header(K, slices=slices, mbs=mbs, dp=dp, schedule=name)
    check(lower(header, build_schedule(name, header)))
    check(lower(header, build_schedule(name, header), comm=GLOO), comm=GLOO)


def test_pre_recompute_is_1f1b_fully_recomputed():
    """tpc's `--recompute full` already puts every recompute before its gradient's receive."""
    header = make_header(4, slices=3, mbs=5, schedule="1f1b")
    full = recompute.apply(build_schedule("1f1b", header), recompute.uniform(header, "full"))
    assert build_schedule("1f1b-pre-recompute", header) == full


def test_last_stage_keeps_its_activations():
    header = make_header(4, slices=2, mbs=4, schedule="1f1b-last-no-recompute")
    compute = build_schedule("1f1b-last-no-recompute", header)
    assert not any(i.op is Op.RECOMPUTE or i.checkpoint for i in compute[3])
    for r in range(3):
        assert all(i.checkpoint for i in compute[r] if i.op is Op.FORWARD)
        # each slice's recompute right before its backward
        for a, b in zip(compute[r], compute[r][1:]):
            if b.op is Op.BACKWARD:
                assert (a.op, a.stage, a.mb, a.slice) == (Op.RECOMPUTE, b.stage, b.mb, b.slice)


def test_critical_path_swaps_stage_k_minus_2s_first_backward_with_its_third_forward():
    """Merak's FullCriticalPathTrainSchedule on 4 stages, 6 micro-batches: stage 2 runs
    F0 F1 F2 B0 B1 F3 B2 ...; the other stages keep 1F1B's order."""
    header = make_header(4, slices=1, mbs=6, schedule="1f1b-critical-path")
    compute = build_schedule("1f1b-critical-path", header)
    assert _order(compute, 2) == ["F0", "F1", "F2", "R0", "B0", "R1", "B1", "F3", "R2", "B2", "F4", "R3", "B3",
                                  "F5", "R4", "B4", "R5", "B5"]
    assert _order(compute, 3) == [x for m in range(6) for x in (f"F{m}", f"B{m}")]
    plain = build_schedule("1f1b-last-no-recompute", header)
    assert compute[0] == plain[0] and compute[1] == plain[1]
    # two stages: stage 0 is stage K-2
    header = make_header(2, slices=1, mbs=4, schedule="1f1b-critical-path")
    assert _order(build_schedule("1f1b-critical-path", header), 0)[:7] == ["F0", "F1", "F2", "R0", "B0", "R1", "B1"]


def test_recompute_option_leaves_their_recomputation_as_placed():
    from tpc.compiler.pipeline import Recompute
    from tpc.ir.diagnostics import TpirError

    class State:
        def __init__(self, header, compute):
            self.header, self.compute = header, compute

        def but(self, **kw):
            raise AssertionError("the compute order must stay as the schedule wrote it")

    assert all(own_recompute(n) for n in VARIANTS) and not own_recompute("1f1b")
    header = make_header(4, slices=2, mbs=4, schedule="1f1b-last-no-recompute")
    state = State(header, build_schedule("1f1b-last-no-recompute", header))
    notes = []
    assert Recompute("full").run(state, notes.append) is state
    assert "places its own recomputation" in notes[0]
    with pytest.raises(TpirError) as err:
        Recompute("auto", budget=1.0).run(state, notes.append)
    assert "--recompute auto" in err.value.render() and "hint:" in err.value.render()


def _unit(name, p, m, comm=GLOO):
    header = sim_header(p, m, 1, schedule=name)
    compute = build_schedule(name, header)
    if not own_recompute(name):
        compute = recompute.apply(compute, recompute.uniform(header, "full"))
    return simulate(lower(header, compute, comm=comm), UnitCosts(), comm)


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 4), (4, 8), (4, 16), (8, 8), (8, 16), (8, 32)])
def test_unit_cost_figures(p, m):
    """1F1B fully recomputed takes 4m + 3(p-1); keeping the last stage's activations takes 2
    off (the last micro-batch's recompute on the last stage, and a forward of the drain);
    swapping stage K-2's first backward takes 1 more off (its recomputes of micro-batches 0 and 1
    run while the last stage computes them) under buffered sends (gloo). Under NCCL's in-order
    stream (a send waits for its receive, and the operations between two ranks run in order) it
    keeps the 3 units at 2 stages and is 1 unit slower than keeping the last stage alone at 4 and
    8: stage K-2's activation sends, which lowering puts right after their forwards, wait for the
    last stage's receives and hold back the gradient receives behind them (Merak sends those
    activations after the gradients)."""
    base = _unit("1f1b", p, m).iteration_time
    assert base == 4 * m + 3 * (p - 1)
    assert _unit("1f1b-pre-recompute", p, m).iteration_time == base
    assert _unit("1f1b-last-no-recompute", p, m).iteration_time == base - 2
    assert _unit("1f1b-critical-path", p, m).iteration_time == base - 3
    assert _unit("1f1b-critical-path", p, m, NCCL).iteration_time == base - (3 if p == 2 else 1)


def test_schedule_auto_with_full_recompute_compares_them(tmp_path, capsys):
    """`--schedule auto --recompute full` simulates every candidate recomputed and compares
    Merak's three; on the h100 model, of the 1F1B family the one keeping the last stage (the
    head) is the fastest, and the plan written is the fastest candidate of all (chimera, whose
    two pipelines fill each other's bubbles, here)."""
    import re

    from tpc.cli.main import main

    out = tmp_path / "a.tpir"
    assert main(["compile", "examples/gpt.py", "-o", str(out), "--stages", "4", "--microbatches", "8",
                 "--seq-len", "64", "--batch", "8", "--schedule", "auto", "--device-model", "h100",
                 "--recompute", "full", "--explain"]) == 0
    err = capsys.readouterr().err
    times = {m.group(1): float(m.group(2))
             for m in re.finditer(r"^\s+\*?\s+4x1\s+\S+\s+(\S+)\s+.*?(\d+\.\d+) ms", err, re.M)}
    merak = {"1f1b-pre-recompute", "1f1b-last-no-recompute", "1f1b-critical-path"}
    assert merak <= set(times), err
    family = {n: t for n, t in times.items() if n in merak | {"1f1b"}}
    assert min(family, key=family.get) == "1f1b-last-no-recompute", family
    assert family["1f1b-pre-recompute"] == family["1f1b"]
    best = min(times, key=times.get)
    assert f'schedule "{best}"' in out.read_text()
