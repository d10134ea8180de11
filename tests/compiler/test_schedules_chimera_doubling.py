"""Chimera with forward doubling (compiler/schedules/chimera_doubling.py): the forwards of two
micro-batches of one pipeline run back to back, so a pair costs a backward when B = 2F.

Every shape lowers to a plan verified under gloo's and NCCL's rules; each (stage, mb, slice)
runs once on its replica's rank and every pair's forwards are adjacent; under unit costs with
B = 2F a step of N = 2kD micro-batches lasts at most the figure's 3N + 2D - 4 (a bubble of
(D-2)/(3N/2+D-2)), exactly that from k = 2 on, shorter than plain chimera's and 1F1B's, at 2D
micro-batches' activations per rank, twice chimera's cap."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from fractions import Fraction

import pytest

from tpc.compiler.costmodel.unit import UnitCosts
from tpc.compiler.lowering.lower import lower
from tpc.compiler.predict.simulate import simulate
from tpc.compiler.schedules import build_schedule, replicas, with_replicas
from tpc.compiler.schedules.chimera import forward_groups
from tpc.ir.diagnostics import TpirError
from tpc.ir.nodes import Op
from tpc.ir.parse import parse
from tpc.ir.printer import print_plan
from tpc.ir.semantics import GLOO
from tpc.ir.verify import verify

from . import make_header

NAME = "chimera-doubling"
UNEQUAL = (5, 11, 1, 7)


def header(D, schedule=NAME, **kw):
    return with_replicas(make_header(D, schedule=schedule, **kw))


def simulated(name, D, N, backward=2.0):
    h = header(D, name, mbs=N)
    return simulate(lower(h, build_schedule(name, h)), UnitCosts(backward=backward), GLOO)


def test_every_shape_lowers_to_a_plan_verified_under_both_backends():
    """D {2, 4, 6} x slices {1, unequal} x mbs {5, 8} x dp {1, 2}, tied with dp 2."""
    assert replicas(NAME) == 2
    for D, slices, mbs, dp in itertools.product([2, 4, 6], [1, UNEQUAL], [5, 8], [1, 2]):
        ties = (("wte", (0, D - 1)),) if dp == 2 else ()
        h = header(D, slices=slices, mbs=mbs, dp=dp, ties=ties)
        for comm in ("gloo", "nccl"):
            plan = lower(h, build_schedule(NAME, h), comm=comm, verify=False)
            diags = verify(parse(print_plan(plan), file="chimera.tpir"), comm)
            assert diags == [], f"D={D} slices={slices} mbs={mbs} dp={dp} {comm}: {diags[0]}"


def test_pairs_are_consecutive_micro_batches_of_one_pipeline_cut_alike():
    assert forward_groups(header(4, mbs=7), doubling=True) == ((0, 2), (1, 3), (4, 6), (5,))
    assert forward_groups(header(4, mbs=4), doubling=False) == ((0,), (1,), (2,), (3,))
    h = header(4, mbs=4)
    mbs = list(h.microbatches)
    mbs[2] = dataclasses.replace(mbs[2], slices=make_header(4, slices=3).microbatches[0].slices)
    h = dataclasses.replace(h, microbatches=tuple(mbs))
    assert forward_groups(h, doubling=True) == ((0,), (1, 3), (2,))  # 0 and 2 are cut otherwise


@pytest.mark.parametrize("D,N,slices", [(4, 8, 1), (4, 7, UNEQUAL), (6, 12, 3)])
def test_each_unit_runs_once_and_each_pairs_forwards_are_adjacent(D, N, slices):
    h = header(D, slices=slices, mbs=N)
    compute = build_schedule(NAME, h)
    partner = {m: g for g in forward_groups(h, doubling=True) for m in g}
    seen = Counter()
    for rank, instrs in compute.items():
        for at, i in enumerate(instrs):
            assert i.op in (Op.FORWARD, Op.BACKWARD)
            assert rank == h.stage_rank(i.stage, i.mb)
            seen[(i.op, i.stage, i.mb, i.slice)] += 1
            g = partner[i.mb]
            if i.op is Op.FORWARD and len(g) == 2:
                other = instrs[at + 1] if i.mb == g[0] else instrs[at - 1]
                assert (other.op, other.stage, other.mb, other.slice) == (Op.FORWARD, i.stage, sum(g) - i.mb, i.slice)
    assert set(seen.values()) == {1} and len(seen) == 2 * D * N * len(h.microbatches[0].lengths)


@pytest.mark.parametrize("D,k", [(2, 1), (2, 2), (4, 1), (4, 2), (4, 3), (6, 1), (6, 2), (8, 1), (8, 2)])
def test_the_doubled_units_bubble_under_a_backward_twice_a_forward(D, k):
    """F = 1, B = 2, N = 2kD: the figure's slots of length B (a backward, or a pair's
    forwards) with Chimera's D - 2 empty ones per rank: 3N + 2D - 4, a bubble of
    (D-2)/(3N/2+D-2); the first unit of pairs starts with single-cost forwards and can do
    better. Plain chimera's units leave bubbles between them and 1F1B idles (D-1)/(N+D-1);
    doubling holds 2D micro-batches' activations, twice chimera's cap."""
    N = 2 * k * D
    doubled, plain, base = simulated(NAME, D, N), simulated("chimera", D, N), simulated("1f1b", D, N)
    figure = 3 * N + 2 * D - 4
    assert all(r.busy == 3 * N for r in doubled.ranks)
    assert doubled.iteration_time <= figure and (k == 1 or doubled.iteration_time == figure)
    assert Fraction(figure - 3 * N, figure) == (D - 2) / (Fraction(3 * N, 2) + D - 2)
    assert Fraction(int(base.iteration_time) - 3 * N, int(base.iteration_time)) == Fraction(D - 1, N + D - 1)
    if D >= 4:
        assert doubled.iteration_time < plain.iteration_time and doubled.iteration_time < base.iteration_time
    else:  # two stages: chimera has no bubble to fill
        assert doubled.iteration_time == plain.iteration_time
    assert max(r.peak_memory.activations for r in doubled.ranks) == 2 * D
    assert max(r.peak_memory.activations for r in plain.ranks) == D


def test_the_refusals_are_chimeras_under_its_own_name():
    with pytest.raises(TpirError) as e:
        build_schedule(NAME, header(3, mbs=2))
    assert f"schedule {NAME!r}" in e.value.render() and "--stages 4" in e.value.render()
    with pytest.raises(TpirError) as e:
        build_schedule(NAME, header(4, mbs=1))
    assert "at least 2 micro-batches" in e.value.render()
