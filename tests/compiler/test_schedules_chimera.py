"""Chimera: two pipelines in opposite directions over weight replicas (format version 3).

Every shape lowers to a plan verified under gloo's and NCCL's rules and read back as printed;
each (stage, mb, slice) runs once, on its replica's rank; the unit-cost simulator reproduces
the paper's bubble (D-2)/(2N+D-2) against 1F1B's (D-1)/(N+D-1), with direct concatenation for
N = kD, at no more than D micro-batches' activations per rank; memory counts both replicas'
parameters; the simulator prices reduce-replicas; and the refusals are located."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from fractions import Fraction

import pytest

from tpc.cli.compile import check_options
from tpc.compiler.costmodel.unit import UnitCosts
from tpc.compiler.lowering.lower import lower
from tpc.compiler.predict.memory import rank_memory
from tpc.compiler.schedules import build_schedule, replicas, with_replicas
from tpc.compiler.predict.simulate import simulate
from tpc.ir.semantics import GLOO
from tpc.ir.diagnostics import TpirError
from tpc.ir.nodes import FORMAT_VERSION, Op
from tpc.ir.parse import parse
from tpc.ir.printer import print_plan
from tpc.ir.verify import check, verify

from . import make_header

UNEQUAL = (5, 11, 1, 7)


def chimera(D, **kw):
    return with_replicas(make_header(D, schedule="chimera", **kw))


def test_every_shape_lowers_to_a_plan_verified_under_both_backends():
    """D {2, 4, 6} x slices {1, 3, unequal} x mbs {2, 5, 8} x dp {1, 2}."""
    for D, slices, mbs, dp in itertools.product([2, 4, 6], [1, 3, UNEQUAL], [2, 5, 8], [1, 2]):
        h = chimera(D, slices=slices, mbs=mbs, dp=dp)
        for comm in ("gloo", "nccl"):
            plan = lower(h, build_schedule("chimera", h), comm=comm, verify=False)
            text = print_plan(plan)
            assert text.startswith(f"tpir {FORMAT_VERSION}\n")  # the newest: replicas need 3 or later
            diags = verify(parse(text, file="chimera.tpir"), comm)
            assert diags == [], f"D={D} slices={slices} mbs={mbs} dp={dp} {comm}: {diags[0]}"


def test_each_unit_runs_once_on_its_replicas_rank():
    h = chimera(4, slices=UNEQUAL, mbs=6)
    compute = build_schedule("chimera", h)
    seen = Counter()
    for rank, instrs in compute.items():
        for i in instrs:
            assert i.op in (Op.FORWARD, Op.BACKWARD)
            replica = h.microbatches[i.mb].replica
            assert replica == i.mb % 2
            assert rank == (i.stage if replica == 0 else 3 - i.stage)
            seen[(i.op, i.stage, i.mb, i.slice)] += 1
    assert set(seen.values()) == {1} and len(seen) == 2 * 4 * 6 * len(UNEQUAL)


def test_the_lowering_sums_each_stage_over_its_replicas_before_the_step():
    plan = lower(chimera(4, mbs=4, dp=2), build_schedule("chimera", chimera(4, mbs=4, dp=2)))
    for program in plan.ranks:
        r = program.rank
        tail = [str(i) for i in program.instrs[-3:]]
        assert tail == [f"reduce-replicas stage {min(r, 3 - r)}", f"reduce-replicas stage {max(r, 3 - r)}", "step"]
        assert sum(i.op is Op.ALLREDUCE for i in program.instrs) == 2  # both of its stages, over dp


def run(D, N, backward=2.0, slices=1):
    h = chimera(D, mbs=N, slices=slices)
    return simulate(lower(h, build_schedule("chimera", h)), UnitCosts(backward=backward), GLOO)


def run_1f1b(D, N, backward=2.0):
    h = make_header(D, mbs=N, schedule="1f1b")
    return simulate(lower(h, build_schedule("1f1b", h)), UnitCosts(backward=backward), GLOO)


@pytest.mark.parametrize("D,k", [(2, 1), (2, 3), (4, 1), (4, 2), (4, 3), (6, 1), (6, 3), (8, 1), (8, 2)])
def test_the_papers_bubble_with_direct_concatenation(D, k):
    """Li & Hoefler's figure (F = B): a basic unit of N = D micro-batches idles D - 2 per rank of
    2N + D - 2, and N = kD concatenated units idle no more (the next unit's forwards fill the
    bubbles at the end of the one before); 1F1B idles (D-1)/(N+D-1) of its step."""
    N = k * D
    result = run(D, N, backward=1.0)
    assert result.iteration_time == 2 * N + D - 2
    assert all(r.busy == 2 * N for r in result.ranks)
    assert Fraction(int(result.iteration_time) - 2 * N, int(result.iteration_time)) == Fraction(D - 2, 2 * N + D - 2)
    plain = run_1f1b(D, N, backward=1.0)
    assert Fraction(int(plain.iteration_time) - 2 * N, int(plain.iteration_time)) == Fraction(D - 1, N + D - 1)
    # activations: between D/2 + 1 and D micro-batches' per rank (the paper's range), at most
    # 1F1B's first rank's peak
    acts = [r.peak_memory.activations for r in result.ranks]
    assert max(acts) <= D and (D < 4 or min(acts) >= D // 2 + 1), acts
    assert max(r.peak_memory.activations for r in plain.ranks) == D


@pytest.mark.parametrize("D,N", [(4, 4), (4, 8), (6, 6), (6, 12), (8, 8), (8, 16)])
def test_with_a_backward_twice_a_forward_chimera_still_beats_1f1b(D, N):
    """F = 1, B = 2: the basic unit's bubbles grow (its figure assumes F = B) and concatenated
    units leave bubbles in the middle (the paper's remedy, forward doubling, is tested in
    test_schedules_chimera_doubling.py), but the step stays shorter than 1F1B's up to N = 2D."""
    assert run(D, N).iteration_time < run_1f1b(D, N).iteration_time


def test_a_rank_counts_the_parameters_of_both_its_replicas():
    class Weighted(UnitCosts):
        def param_bytes(self, stage):
            return 10.0 ** stage

    h = chimera(4, mbs=4)
    plan = lower(h, build_schedule("chimera", h))
    for r in range(4):
        mem = rank_memory(plan.header, r, plan.ranks[r].instrs, Weighted())
        assert mem.peak.params == 10.0 ** r + 10.0 ** (3 - r)


def test_the_simulator_prices_reduce_replicas_as_an_all_reduce_of_the_stage():
    class Weighted(UnitCosts):
        def param_bytes(self, stage):
            return 1000.0

        def allreduce_time(self, nbytes, n):
            return nbytes / 100.0 * (n - 1)

    h = chimera(4, mbs=4)
    result = simulate(lower(h, build_schedule("chimera", h)), Weighted(), GLOO)
    events = [e for e in result.events if e.instr.op is Op.REDUCE_REPLICAS]
    assert len(events) == 8 and all(e.work == pytest.approx(10.0) for e in events)


def test_token_slices_keep_every_rank_busy_and_exact_in_count():
    """Unequal slices: each rank's work is its slices' tokens (forward 1, backward 2 per mean
    slice): two stages x two micro-batches x (F + B) of 4 mean slices each, whatever the order."""
    result = run(4, 4, slices=UNEQUAL)
    assert all(r.busy == pytest.approx(2 * 2 * 3 * 4) for r in result.ranks)


# ---------------------------------------------------------------------------------- refusals


def test_one_micro_batch_is_refused():
    with pytest.raises(TpirError) as e:
        build_schedule("chimera", chimera(4, mbs=1))
    assert "at least 2 micro-batches" in e.value.render()


def test_an_odd_number_of_stages_is_refused():
    with pytest.raises(TpirError) as e:
        build_schedule("chimera", chimera(3, mbs=2))
    assert "even number of stages, not 3" in e.value.render() and "--stages 4" in e.value.render()


@pytest.mark.parametrize("tied", [(0, 3), (0, 1)])
def test_a_tie_is_reduced_once_over_every_replica_of_its_stages(tied):
    """GPT-2's embedding and head (stages 0 and D-1, both on ranks 0 and D-1), and a tie of two
    neighbours (over all four ranks): one `reduce-tied` on every rank holding a replica of a
    tied stage, beside the stages' `reduce-replicas` (which leave the tied parameter out)."""
    h = chimera(4, mbs=4, slices=3, ties=(("wte", tied),))
    for comm in ("gloo", "nccl"):
        plan = lower(h, build_schedule("chimera", h), comm=comm, verify=False)
        assert verify(parse(print_plan(plan), file="chimera.tpir"), comm) == []
    holders = sorted({r for s in tied for r in h.stage_ranks(s)})
    assert list(h.tie_ranks("wte")) == holders
    for prog in plan.ranks:
        ops = [i.op for i in prog.instrs]
        assert ops.count(Op.REDUCE_TIED) == (prog.rank in holders)
        assert ops.count(Op.REDUCE_REPLICAS) == 2 and ops[-1] is Op.STEP


def test_a_tie_with_replicas_missing_on_one_holder_is_reported():
    """Rank 3 holds stage 0's second replica: it is a member of the tie's reduction (C7)."""
    h = chimera(4, mbs=4, ties=(("wte", (0, 3)),))
    plan = lower(h, build_schedule("chimera", h), comm="gloo", verify=False)
    text = print_plan(plan)
    lines = text.splitlines()
    at = max(i for i, line in enumerate(lines) if line.strip() == 'reduce-tied "wte"')
    diags = verify(parse("\n".join(lines[:at] + lines[at + 1:]) + "\n", file="chimera.tpir"), "gloo")
    assert any('never reduces tie "wte"' in d.message for d in diags), diags


def test_another_schedule_refuses_a_header_with_replicas():
    with pytest.raises(TpirError) as e:
        build_schedule("interleaved", chimera(4, mbs=4))
    assert "runs one weight replica of each stage" in e.value.render()


def test_another_placement_is_refused():
    h = make_header(4, mbs=4, schedule="chimera")  # one rank per stage: no replicas
    with pytest.raises(TpirError) as e:
        build_schedule("chimera", h)
    assert "needs stage s on ranks s and 4-1-s" in e.value.render()


@pytest.mark.parametrize("kw,flag", [(dict(virtual_stages=2), "--virtual-stages"), (dict(ranks=2), "--ranks")])
def test_compile_options_that_do_not_fit_two_pipelines_are_refused(kw, flag):
    with pytest.raises(TpirError) as e:
        check_options(stages=4, schedule="chimera", microbatches=4, seq_len=16, batch=8, **kw)
    assert flag in e.value.render()
    assert replicas("chimera") == 2 and replicas("1f1b") == 1


# ---------------------------------------------------------------------------- verifier rules


def _plan(**kw):
    h = chimera(4, mbs=4, **kw)
    return lower(h, build_schedule("chimera", h))


def _messages(plan):
    return [d.message for d in verify(parse(print_plan(plan), file="p.tpir"))]


def test_replicas_need_format_version_3():
    plan = _plan()
    old = dataclasses.replace(plan, header=dataclasses.replace(plan.header, version=2))
    text = "\n".join(_messages(old))
    assert "`ranks` (weight replicas of a stage) needs format version 3" in text
    assert "`replica` (a micro-batch's weight replica) needs format version 3" in text
    assert "`reduce-replicas` needs format version 3" in text


def test_a_missing_reduce_replicas_is_reported_on_its_rank():
    plan = _plan()
    r0 = plan.ranks[0]
    kept = tuple(i for i in r0.instrs if not (i.op is Op.REDUCE_REPLICAS and i.stage == 3))
    broken = dataclasses.replace(plan, ranks=(dataclasses.replace(r0, instrs=kept), *plan.ranks[1:]))
    text = "\n".join(_messages(broken))
    assert "rank 0 never sums the gradients of stage 3 with its replica on rank 3" in text


def test_a_reduce_replicas_before_its_stages_last_backward_is_reported():
    plan = _plan()
    r0 = list(plan.ranks[0].instrs)
    rr = next(p for p, i in enumerate(r0) if i.op is Op.REDUCE_REPLICAS and i.stage == 0)
    ins = r0.pop(rr)
    r0.insert(0, ins)
    broken = dataclasses.replace(plan, ranks=(dataclasses.replace(plan.ranks[0], instrs=tuple(r0)), *plan.ranks[1:]))
    text = "\n".join(_messages(broken))
    assert "reduce-replicas stage 0 runs before it is done with the gradients of stage 0" in text


def test_work_on_the_other_replicas_rank_is_reported():
    plan = _plan()
    r3 = plan.ranks[3]
    f = next(p for p, i in enumerate(r3.instrs) if i.op is Op.FORWARD and i.stage == 0)
    moved = r3.instrs[f]
    broken = dataclasses.replace(plan, ranks=(
        dataclasses.replace(plan.ranks[0], instrs=(moved, *plan.ranks[0].instrs)),
        *plan.ranks[1:3], dataclasses.replace(r3, instrs=r3.instrs[:f] + r3.instrs[f + 1:])))
    text = "\n".join(_messages(broken))
    assert f"stage 0 is held by rank 3 for micro-batch {moved.mb} (replica 1), not by rank 0" in text


def test_a_replica_the_stages_do_not_have_is_reported():
    plan = _plan()
    mbs = list(plan.header.microbatches)
    mbs[1] = dataclasses.replace(mbs[1], replica=2)
    text = "\n".join(_messages(dataclasses.replace(plan, header=dataclasses.replace(plan.header, microbatches=tuple(mbs)))))
    assert "microbatch 1 runs on replica 2, but the stages have 2 weight replicas" in text


def test_the_evaluation_runs_on_replica_0():
    plan = _plan()
    assert plan.eval is None or all(m.replica == 0 for m in plan.eval.microbatches)
    from tpc.compiler.lowering.eval_program import eval_program

    with_eval = dataclasses.replace(plan, eval=eval_program(plan.header))
    assert all(m.replica == 0 for m in with_eval.eval.microbatches)
    check(with_eval)
