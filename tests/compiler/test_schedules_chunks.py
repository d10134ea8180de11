"""The schedules of several chunks per rank and of split backwards (interleaved, looped-bfs, zb-h1,
zb-h2, seq-zb, seq-interleaved): every placement they accept lowers to a verified plan, each
keeps the order that defines it, they refuse what they cannot do with a located error; and
recomputation as a transform of their compute orders."""

from __future__ import annotations

import itertools

import pytest

from tpc.compiler.lowering import recompute
from tpc.compiler.lowering.lower import lower
from tpc.compiler.schedules import build_schedule, parameters, placement_of
from tpc.compiler.schedules.placement import PLACEMENTS, chunks, looped, place, vshape
from tpc.compiler.costmodel.unit import UnitCosts
from tpc.ir.diagnostics import TpirError
from tpc.ir.nodes import Op
from tpc.ir.show import render_grid
from tpc.ir.verify import check

from . import make_header

UNEQUAL = (5, 11, 1, 7)
NEW = ["interleaved", "looped-bfs", "zb-h1", "zb-h2", "seq-zb", "seq-interleaved"]
ANY_PLACEMENT = ["looped-bfs", "zb-h1", "zb-h2", "seq-zb"]


def header(K, p, *, placement=looped, **kw):
    return make_header(K, stage_ranks=placement(K, p), **kw)


@pytest.mark.parametrize("name", NEW)
def test_looped_placements_lower_to_verified_plans(name):
    """schedule x ranks {2,3} x chunks {1,2,3} x slices {1,3,unequal} x mbs {1,3,4} x dp {1,2}."""
    for p, v, slices, mbs, dp in itertools.product([2, 3], [1, 2, 3], [1, 3, UNEQUAL], [1, 3, 4], [1, 2]):
        if name == "interleaved" and v > 1 and mbs % p:
            continue  # refused: see test_interleaved_refuses_micro_batches_not_a_multiple_of_ranks
        K = p * v
        h = header(K, p, slices=slices, mbs=mbs, dp=dp, schedule=name, ties=(("tied", (0, K - 1)),))
        try:
            check(lower(h, build_schedule(name, h)))
        except TpirError as e:
            pytest.fail(f"{name} p={p} v={v} slices={slices} mbs={mbs} dp={dp}:\n{e.render()}")


@pytest.mark.parametrize("name", ANY_PLACEMENT)
@pytest.mark.parametrize("ranks", [vshape(4, 2), vshape(6, 3), (0, 0, 1, 1), (1, 0, 1, 0)])
def test_any_placement_lowers_to_verified_plans(name, ranks):
    """The V of ZB-V and DualPipeV (stage i and 2p-1-i on rank i), blocks, anything."""
    for slices, mbs in itertools.product([1, UNEQUAL], [1, 3]):
        h = make_header(len(ranks), slices=slices, mbs=mbs, schedule=name, stage_ranks=ranks)
        check(lower(h, build_schedule(name, h)))


def test_placements():
    assert looped(6, 3) == (0, 1, 2, 0, 1, 2)
    assert vshape(6, 3) == (0, 1, 2, 2, 1, 0)
    assert PLACEMENTS["linear"](3, 3) == (0, 1, 2)
    h = place(make_header(6), vshape(6, 3))
    assert h.mesh.pipe == 3 and chunks(h, 0) == (0, 5) and chunks(h, 2) == (2, 3)
    for bad in (lambda: looped(5, 2), lambda: vshape(4, 3), lambda: PLACEMENTS["linear"](4, 2)):
        with pytest.raises(TpirError) as err:
            bad()
        assert "--virtual-stages" in err.value.render() and "hint:" in err.value.render()
    assert {placement_of(n) for n in NEW} == {"looped"}


def test_interleaved_refuses_micro_batches_not_a_multiple_of_ranks():
    h = header(4, 2, mbs=3, schedule="interleaved")
    with pytest.raises(TpirError) as err:
        build_schedule("interleaved", h)
    text = err.value.render()
    assert text.startswith("--schedule interleaved --virtual-stages 2: error:")
    assert "3 micro-batches, not a multiple of 2" in text and "--microbatches 2 or 4" in text


@pytest.mark.parametrize("name", ["interleaved", "seq-interleaved"])
def test_interleaved_schedules_refuse_a_placement_that_is_not_looped(name):
    h = make_header(4, mbs=2, schedule=name, stage_ranks=(0, 0, 1, 1))
    with pytest.raises(TpirError) as err:
        build_schedule(name, h)
    assert "stage s on rank s mod 2" in err.value.render() and "--virtual-stages" in err.value.render()


def test_parameters_are_keyword_arguments_and_unknown_ones_are_refused():
    assert parameters("seq-zb") == {"hold": None}
    assert parameters("zb-h1") == {}
    h = make_header(2, slices=2, mbs=2, schedule="seq-zb")
    assert build_schedule("seq-zb", h, hold=3) != build_schedule("seq-zb", h, hold=1)
    with pytest.raises(TpirError) as err:
        build_schedule("zb-h1", h, hold=3)
    assert "schedule 'zb-h1' has no parameter 'hold'" in err.value.render()
    with pytest.raises(TpirError):
        build_schedule("seq-zb", h, hold=0)


# ---------------------------------------------------------------------------------- orders


def _ops(instrs):
    short = {Op.FORWARD: "F", Op.BACKWARD: "B", Op.BACKWARD_INPUT: "B", Op.BACKWARD_WEIGHT: "W"}
    return [f"{short[i.op]}{i.stage}.{i.mb}" for i in instrs]


def test_interleaved_runs_megatrons_virtual_micro_batch_order():
    """p = 2, v = 2, m = 4: micro-batches go through each chunk in groups of p; rank 0 warms up
    with 2(p-1) + (v-1)p = 4 forwards."""
    h = header(4, 2, mbs=4, schedule="interleaved")
    rank0 = _ops(build_schedule("interleaved", h)[0])
    assert rank0 == ["F0.0", "F0.1", "F2.0", "F2.1",  # warm-up
                     "F0.2", "B2.0", "F0.3", "B2.1", "F2.2", "B0.0", "F2.3", "B0.1",
                     "B2.2", "B2.3", "B0.2", "B0.3"]  # fmt: skip


def test_looped_bfs_runs_each_chunk_breadth_first():
    h = header(4, 2, slices=2, mbs=2, schedule="looped-bfs")
    rank1 = [(i.op, i.stage, i.mb, i.slice) for i in build_schedule("looped-bfs", h)[1]]
    F, B = Op.FORWARD, Op.BACKWARD
    fwd = [(F, s, m, i) for s in (1, 3) for m in (0, 1) for i in (0, 1)]
    bwd = [(B, s, m, i) for s in (3, 1) for m in (1, 0) for i in (1, 0)]
    assert rank1 == fwd + bwd


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "seq-zb"])
def test_split_schedules_run_w_after_b_and_slices_in_reverse(name):
    h = make_header(3, slices=UNEQUAL, mbs=3, schedule=name)
    for instrs in build_schedule(name, h).values():
        seen_b = set()
        for i in instrs:
            if i.op is Op.BACKWARD_INPUT:
                seen_b.add((i.mb, i.slice))
                assert i.slice == len(UNEQUAL) - 1 or (i.mb, i.slice + 1) in seen_b
            elif i.op is Op.BACKWARD_WEIGHT:
                assert (i.mb, i.slice) in seen_b


def test_zb_h1_defers_w_on_later_ranks():
    """ZB-H1's figure: the last rank runs F B pairs and defers its first W until it holds p
    micro-batches; the first rank, at p from its warm-up on, runs each W right away."""
    h = make_header(4, mbs=8, schedule="zb-h1")
    compute = build_schedule("zb-h1", h)
    first_w = {r: _ops(compute[r]).index(f"W{r}.0") for r in range(4)}
    assert _ops(compute[3])[:first_w[3]] == ["F3.0", "B3.0", "F3.1", "B3.1", "F3.2", "B3.2", "F3.3", "B3.3"]
    assert _ops(compute[0])[:first_w[0] + 1] == ["F0.0", "F0.1", "F0.2", "F0.3", "B0.0", "W0.0"]


def test_list_scheduled_orders_are_deterministic():
    h = header(6, 3, slices=UNEQUAL, mbs=4, schedule="seq-zb")
    assert build_schedule("seq-zb", h) == build_schedule("seq-zb", h)


def test_show_marks_the_chunks_of_a_rank():
    h = header(4, 2, mbs=2, schedule="interleaved")
    grid = render_grid(lower(h, build_schedule("interleaved", h)))
    lines = grid.splitlines()
    assert lines[0].split() == ["step", "rank", "0", "[0,2]", "rank", "1", "[1,3]"]
    assert lines[1].split() == ["0", "F0.0.0:c0", "F1.0.0:c0"]
    assert "F2.0.0:c1" in grid and ":c<k> marks its chunk k" in grid


# ---------------------------------------------------------------------------- recomputation


def test_recompute_checkpoints_forwards_and_recomputes_right_before_each_backward():
    h = make_header(2, slices=3, mbs=2, schedule="zb-h1")
    compute = build_schedule("zb-h1", h)
    out = recompute.apply(compute, {0: "full", 1: "none"})
    assert out[1] == compute[1]
    stream = out[0]
    for p, ins in enumerate(stream):
        if ins.op is Op.FORWARD:
            assert ins.checkpoint
        if ins.op is Op.BACKWARD_INPUT:
            assert stream[p - 1].op is Op.RECOMPUTE and stream[p - 1].key == ins.key
    assert sum(i.op is Op.RECOMPUTE for i in stream) == 6
    check(lower(h, out))
    assert recompute.apply(compute, recompute.uniform(h, "none")) == compute
    with pytest.raises(TpirError) as err:
        recompute.uniform(h, "some")
    assert "--recompute" in err.value.render()


def test_auto_recomputes_the_early_stages_first():
    """1F1B on 4 stages, 8 micro-batches: stage s holds 4 - s micro-batches, so under a budget
    of 2.5 the first two stages are recomputed and the last two are not (Merak's stage-aware
    rule), and every rank fits."""
    h = make_header(4, mbs=8, schedule="1f1b")
    compute = build_schedule("1f1b", h)
    costs = UnitCosts()
    assert recompute.peaks(h, compute, costs) == {0: 4, 1: 3, 2: 2, 3: 1}
    choice = recompute.choose(h, compute, costs, 2.5)
    assert choice == {0: "full", 1: "full", 2: "none", 3: "none"}
    assert max(recompute.peaks(h, recompute.apply(compute, choice), costs).values()) <= 2.5
    assert recompute.choose(h, compute, costs, 4) == {s: "none" for s in range(4)}
    with pytest.raises(TpirError) as err:
        recompute.choose(h, compute, costs, 0.5)
    text = err.value.render()
    assert text.startswith("--memory-per-rank: error: pipeline rank 0 needs 1 act")
    assert "hint:" in text


def test_auto_on_a_rank_of_two_chunks_recomputes_the_one_that_saves_most():
    h = header(4, 2, mbs=4, schedule="interleaved")
    compute = build_schedule("interleaved", h)
    costs = UnitCosts()
    before = recompute.peaks(h, compute, costs)
    choice = recompute.choose(h, compute, costs, before[0] - 1)
    assert sum(c == "full" for c in choice.values()) >= 1
    after = recompute.peaks(h, recompute.apply(compute, choice), costs)
    assert all(after[r] <= before[0] - 1 for r in after)
