"""Schedule builders: every schedule, over a grid of shapes, yields plans the verifier accepts,
and each keeps the order that defines it."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import pytest

from tpc.compiler.lowering.lower import lower
from tpc.compiler.schedules import SCHEDULES, build_schedule
from tpc.compiler.schedules.seq1f1b import warmup
from tpc.ir.diagnostics import TpirError
from tpc.ir.nodes import Op
from tpc.ir.verify import check

from . import make_header

UNEQUAL = (5, 11, 1, 7)  # sums to SEQ = 24
GRID = list(itertools.product([1, 2, 4], [1, 3, 8, UNEQUAL], [1, 4], [1, 2]))


def _compute_key(instr):
    return (instr.op, instr.stage, instr.mb, instr.slice)


SPLIT = ("zb-h1", "zb-h2", "seq-zb")  # backward-input / backward-weight instead of backward
# Merak's critical-path 1F1B: their own recompute instructions beside forward and backward
RECOMPUTING = ("1f1b-pre-recompute", "1f1b-last-no-recompute", "1f1b-critical-path")
# schedules that need the looped placement when a rank holds several stages
LOOPED_ONLY = ("interleaved", "seq-interleaved")
# schedules of two stages per rank in a V only (tests/compiler/test_schedules_vshape.py)
V_ONLY = ("zbv", "dualpipev")
# two weight replicas of every stage (tests/compiler/test_schedules_chimera.py)
BIDIRECTIONAL = ("chimera", "chimera-doubling")
ONE_STAGE_PER_RANK = sorted(set(SCHEDULES) - set(V_ONLY) - set(BIDIRECTIONAL))


def test_registry_names():
    assert sorted(SCHEDULES) == ["1f1b", "1f1b-critical-path", "1f1b-last-no-recompute", "1f1b-pre-recompute",
                                 "chimera", "chimera-doubling", "dualpipev", "gpipe", "interleaved", "looped-bfs", "seq-interleaved",
                                 "seq-zb", "seq1f1b", "terapipe", "zb-h1", "zb-h2", "zbv"]


def test_unknown_schedule_lists_the_known_ones():
    with pytest.raises(TpirError) as err:
        build_schedule("zigzag", make_header(2))
    text = err.value.render()
    assert "unknown schedule 'zigzag'" in text
    for name in SCHEDULES:
        assert name in text


@pytest.mark.parametrize("name", ONE_STAGE_PER_RANK)
def test_every_shape_lowers_to_a_verified_plan(name):
    """schedule x K in {1,2,4} x slices {1,3,8,unequal} x mbs {1,4} x dp {1,2}."""
    for K, slices, mbs, dp in GRID:
        ties = (("tied", (0, K - 1)),) if K > 1 else ()
        header = make_header(K, slices=slices, mbs=mbs, dp=dp, schedule=name, ties=ties)
        compute = build_schedule(name, header)
        try:
            check(lower(header, compute))
        except TpirError as e:  # name the failing shape
            pytest.fail(f"{name} K={K} slices={slices} mbs={mbs} dp={dp}:\n{e.render()}")


@pytest.mark.parametrize("name", ONE_STAGE_PER_RANK)
def test_each_unit_has_one_forward_and_one_backward_on_its_rank(name):
    header = make_header(4, slices=UNEQUAL, mbs=3, schedule=name)
    compute = build_schedule(name, header)
    ops = (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT) if name in SPLIT else (Op.FORWARD, Op.BACKWARD)
    assert sorted(compute) == [0, 1, 2, 3]
    for rank, instrs in compute.items():
        assert all(i.op in ops or (name in RECOMPUTING and i.op is Op.RECOMPUTE) for i in instrs)
        assert all(header.stage_rank(i.stage) == rank for i in instrs)
    counts = Counter(_compute_key(i) for instrs in compute.values() for i in instrs if i.op is not Op.RECOMPUTE)
    want = {
        (op, s, m, i)
        for op in ops
        for s in range(4)
        for m in range(3)
        for i in range(len(UNEQUAL))
    }
    assert set(counts) == want
    assert set(counts.values()) == {1}


@pytest.mark.parametrize("name", ["gpipe", "terapipe"])
@pytest.mark.parametrize("stage_ranks", [(0, 1, 0, 1), (0, 0, 1, 1), (0, 1, 2, 0)])
def test_global_order_schedules_accept_several_stages_per_rank(name, stage_ranks):
    header = make_header(
        4, slices=3, mbs=2, dp=2, schedule=name, stage_ranks=stage_ranks, ties=(("tied", (0, 3)),)
    )
    check(lower(header, build_schedule(name, header)))


@pytest.mark.parametrize("name", ["1f1b", "seq1f1b"])
def test_per_stage_schedules_refuse_several_stages_per_rank(name):
    header = make_header(4, slices=2, mbs=2, schedule=name, stage_ranks=(0, 1, 0, 1))
    with pytest.raises(TpirError) as err:
        build_schedule(name, header)
    text = err.value.render()
    assert "exactly one stage per pipeline rank" in text and "rank 0 holds 2" in text
    assert "hint:" in text


# --------------------------------------------------------------------- order properties


def test_gpipe_runs_all_forwards_before_any_backward():
    header = make_header(3, slices=3, mbs=4, schedule="gpipe")
    for instrs in build_schedule("gpipe", header).values():
        ops = [i.op for i in instrs]
        first_b = ops.index(Op.BACKWARD)
        assert set(ops[:first_b]) == {Op.FORWARD} and set(ops[first_b:]) == {Op.BACKWARD}


def test_gpipe_backwards_micro_batches_in_feed_order_slices_reversed():
    header = make_header(2, slices=3, mbs=2, schedule="gpipe")
    stage1 = build_schedule("gpipe", header)[1]
    assert [(i.op, i.mb, i.slice) for i in stage1] == [
        (Op.FORWARD, 0, 0), (Op.FORWARD, 0, 1), (Op.FORWARD, 0, 2),
        (Op.FORWARD, 1, 0), (Op.FORWARD, 1, 1), (Op.FORWARD, 1, 2),
        (Op.BACKWARD, 0, 2), (Op.BACKWARD, 0, 1), (Op.BACKWARD, 0, 0),
        (Op.BACKWARD, 1, 2), (Op.BACKWARD, 1, 1), (Op.BACKWARD, 1, 0),
    ]  # fmt: skip


def test_terapipe_backward_is_the_reverse_of_its_forward():
    header = make_header(3, slices=UNEQUAL, mbs=3, schedule="terapipe")
    for instrs in build_schedule("terapipe", header).values():
        fwd = [(i.mb, i.slice) for i in instrs if i.op is Op.FORWARD]
        bwd = [(i.mb, i.slice) for i in instrs if i.op is Op.BACKWARD]
        assert fwd == [(m, i) for m in range(3) for i in range(len(UNEQUAL))]
        assert bwd == fwd[::-1]
        assert [i.op for i in instrs] == [Op.FORWARD] * len(fwd) + [Op.BACKWARD] * len(bwd)


def _live_microbatches(instrs, slices_per_mb):
    """Max over the program of micro-batches with a forward started and a backward unfinished."""
    started, finished, peak = set(), Counter(), 0
    for i in instrs:
        if i.op is Op.FORWARD:
            started.add(i.mb)
        else:
            finished[i.mb] += 1
        peak = max(peak, sum(1 for m in started if finished[m] < slices_per_mb))
    return peak


def test_1f1b_stage_s_holds_at_most_k_minus_s_micro_batches():
    K, M, n = 4, 6, 3
    header = make_header(K, slices=n, mbs=M, schedule="1f1b")
    compute = build_schedule("1f1b", header)
    for s in range(K):
        # the bound is reached (M >= K), so the check is not vacuous
        assert _live_microbatches(compute[s], n) == K - s


def test_1f1b_runs_a_micro_batch_as_all_its_slices():
    header = make_header(2, slices=3, mbs=3, schedule="1f1b")
    stage0 = [(i.op, i.mb, i.slice) for i in build_schedule("1f1b", header)[0]]
    F, B = Op.FORWARD, Op.BACKWARD
    assert stage0 == [
        (F, 0, 0), (F, 0, 1), (F, 0, 2),  # warm-up: K - s - 1 = 1 micro-batch
        (F, 1, 0), (F, 1, 1), (F, 1, 2), (B, 0, 2), (B, 0, 1), (B, 0, 0),
        (F, 2, 0), (F, 2, 1), (F, 2, 2), (B, 1, 2), (B, 1, 1), (B, 1, 0),
        (B, 2, 2), (B, 2, 1), (B, 2, 0),
    ]  # fmt: skip


def test_seq1f1b_backward_runs_each_micro_batch_in_reverse_slices():
    header = make_header(3, slices=UNEQUAL, mbs=3, schedule="seq1f1b")
    n = len(UNEQUAL)
    for instrs in build_schedule("seq1f1b", header).values():
        bwd = [(i.mb, i.slice) for i in instrs if i.op is Op.BACKWARD]
        assert bwd == [(m, i) for m in range(3) for i in reversed(range(n))]
        fwd = [(i.mb, i.slice) for i in instrs if i.op is Op.FORWARD]
        assert fwd == [(m, i) for m in range(3) for i in range(n)]


def test_seq1f1b_warmup_then_one_forward_one_backward():
    K, M, n = 3, 4, 3
    header = make_header(K, slices=n, mbs=M, schedule="seq1f1b")
    compute = build_schedule("seq1f1b", header)
    for s in range(K):
        w = warmup(header, s)
        assert w == (n - 1) + (K - s - 1)
        ops = [i.op for i in compute[s]]
        steady = M * n - w
        assert ops[:w] == [Op.FORWARD] * w
        assert ops[w : w + 2 * steady] == [Op.FORWARD, Op.BACKWARD] * steady
        assert ops[w + 2 * steady :] == [Op.BACKWARD] * w


def test_seq1f1b_warmup_counts_the_longest_micro_batch():
    header = make_header(2, slices=2, mbs=2, schedule="seq1f1b")
    cuts = ((0, 6), (6, 12), (12, 24))
    mbs = (header.microbatches[0], dataclasses.replace(header.microbatches[1], slices=cuts))
    header = dataclasses.replace(header, microbatches=mbs)
    assert warmup(header, 1) == 2 and warmup(header, 0) == 3
    check(lower(header, build_schedule("seq1f1b", header)))


def peak_live_slices(instrs) -> int:
    """Max over the program of slice activations alive on a rank: forward done, backward not."""
    live = peak = 0
    for i in instrs:
        live += 1 if i.op is Op.FORWARD else -1
        peak = max(peak, live)
    return peak


def test_seq1f1b_holds_fewer_live_slice_activations_than_terapipe_and_1f1b():
    K, M, n = 4, 4, 4
    peaks = {}
    for name in ("seq1f1b", "1f1b", "terapipe", "gpipe"):
        header = make_header(K, slices=n, mbs=M, schedule=name)
        compute = build_schedule(name, header)
        peaks[name] = [peak_live_slices(compute[r]) for r in range(K)]
    assert peaks["seq1f1b"] == [n + K - 1 - s for s in range(K)]  # w_s + 1
    assert peaks["1f1b"] == [(K - s) * n for s in range(K)]
    assert peaks["terapipe"] == peaks["gpipe"] == [M * n] * K
    assert max(peaks["seq1f1b"]) < min(max(peaks["1f1b"]), max(peaks["terapipe"]))
    # the last stage holds one whole micro-batch under both; every earlier stage holds fewer
    assert all(a < b for a, b in zip(peaks["seq1f1b"][:-1], peaks["1f1b"][:-1]))
    assert peaks["seq1f1b"][-1] == peaks["1f1b"][-1] == n
    assert all(a < b for a, b in zip(peaks["seq1f1b"], peaks["terapipe"]))


def test_split_backward_lists_the_schedules_that_split_it():
    """`SPLIT_BACKWARD` (what packed documents and the plan search over them leave out) is exactly
    the schedules whose compute orders hold `backward-input`."""
    from tpc.cli.compile import check_options
    from tpc.compiler.header import build_header
    from tpc.compiler.schedules import SCHEDULES, build_schedule, splits_backward
    from tpc.ir.nodes import Op

    for name in SCHEDULES:
        opts = check_options(stages="4", microbatches=4, seq_len=8, batch=4, slices="2", schedule=name)
        header = build_header(model_path="m.py", sha256="0" * 64, factory="model", opts=opts, vocab=16,
                              unit_labels=[f"u{i}" for i in range(4)], ranges=[(i, i + 1) for i in range(4)], ties=[])
        compute = build_schedule(name, header)
        split = any(i.op is Op.BACKWARD_INPUT for stream in compute.values() for i in stream)
        assert split == splits_backward(name), name
