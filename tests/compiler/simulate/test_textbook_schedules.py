"""The published figures of interleaved 1F1B, LoopedBFS and Zero Bubble, reproduced exactly by
the simulator under unit costs (forward 1, backward 2; a split backward's halves 1 each, so
F = B = W = 1), and what recomputation costs.

Two measures of bubble appear. The iteration bubble: a rank's idle time over the step. The
Zero Bubble paper's: a rank's idle time between its own first and last compute (its "span"),
the largest over the ranks; it is what a steady stream of steps loses when each rank starts its
next step right after its own optimizer step. 1F1B's is 3(p-1) in both (rank 0 starts first and
ends last), ZB-H1's (p-1)(F+B-W) = p-1 in both, ZB-H2's (p-1)(F+B-2W) = 0 in the paper's."""

from __future__ import annotations

from fractions import Fraction

import pytest

from tests.compiler.simulate.plans import make_header
from tpc.compiler.lowering import recompute
from tpc.compiler.lowering.lower import lower
from tpc.compiler.schedules import build_schedule
from tpc.compiler.schedules.placement import looped, place, vshape
from tpc.compiler.costmodel.unit import UnitCosts
from tpc.compiler.predict.simulate import simulate
from tpc.ir.semantics import GLOO
from tpc.ir.nodes import COMPUTE_OPS, Op


def run(schedule: str, p: int, m: int, v: int = 1, slices: int = 1, choice: str = "none", **params):
    header = make_header(p * v, m, slices, schedule=schedule)
    if v > 1:
        header = place(header, looped(p * v, p))
    compute = recompute.apply(build_schedule(schedule, header, **params), recompute.uniform(header, choice))
    return simulate(lower(header, compute), UnitCosts(), GLOO)


def span_idle(result) -> list[float]:
    """Per rank: idle time between its first and its last compute instruction."""
    out = []
    for r in result.ranks:
        ev = [e for e in result.events_of(r.rank) if e.instr.op in COMPUTE_OPS]
        out.append(max(e.end for e in ev) - min(e.start for e in ev) - r.compute)
    return out


def activations(result) -> list[float]:
    return [r.peak_memory.activations for r in result.ranks]


# ------------------------------------------------------------------------------ interleaved


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 2, 4), (4, 2, 4), (4, 2, 8), (4, 3, 8), (3, 4, 6)])
def test_interleaved_bubble_is_p_minus_1_over_v_m_of_the_ideal(p, v, m):
    """Each rank holds v chunks of 1/v of the model: it computes 3vm chunk-units, and the pipeline
    fill and drain cost (p-1)(F+B) of one chunk instead of one whole stage: 3(p-1)."""
    result = run("interleaved", p, m, v)
    ideal = 3 * v * m
    assert result.iteration_time == ideal + 3 * (p - 1)
    assert Fraction(int(result.iteration_time) - ideal, ideal) == Fraction(p - 1, v * m)
    assert all(r.busy == ideal for r in result.ranks)
    plain = run("1f1b", p, m)  # 1F1B on whole stages: (p-1)/m of its ideal
    assert Fraction(int(plain.iteration_time) - 3 * m, 3 * m) == Fraction(p - 1, m)


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (3, 2, 6)])
def test_interleaved_activation_memory_of_korthikanti_et_al(p, v, m):
    """Rank r holds its warm-up plus one chunk-micro-batches, 2(p-r-1) + (v-1)p + 1: on the first
    rank v p + p - 1 chunks of 1/v of a stage each, that is p (1 + (p-1)/(p v)) stages' worth,
    the factor of Korthikanti et al. (2022, section 4.2.3) over 1F1B's p."""
    result = run("interleaved", p, m, v)
    assert activations(result) == [2 * (p - r - 1) + (v - 1) * p + 1 for r in range(p)]
    assert Fraction(int(activations(result)[0]), v) == p * (1 + Fraction(p - 1, p * v))


def test_interleaved_with_one_chunk_is_1f1b():
    header = make_header(3, 5, 2, schedule="interleaved")
    assert build_schedule("interleaved", header) == build_schedule("1f1b", header)


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (2, 3, 4)])
def test_looped_bfs_holds_every_micro_batch_of_every_chunk(p, v, m):
    """torch's LoopedBFS: GPipe chunk by chunk; every chunk holds all m micro-batches at the
    turn, against interleaved 1F1B's warm-up, and the step is no shorter than interleaved's."""
    result, inter = run("looped-bfs", p, m, v), run("interleaved", p, m, v)
    assert activations(result) == [v * m] * p
    assert max(activations(inter)) < v * m
    assert result.iteration_time >= inter.iteration_time


# ------------------------------------------------------------------------------ zero bubble


@pytest.mark.parametrize("p,m", [(2, 4), (3, 5), (4, 4), (4, 8), (5, 10)])
def test_zb_h1_bubble_is_p_minus_1_times_f_plus_b_minus_w(p, m):
    F = B = W = 1
    result = run("zb-h1", p, m)
    assert all(r.busy == m * (F + B + W) for r in result.ranks)
    assert max(span_idle(result)) == (p - 1) * (F + B - W)
    assert all(r.idle == (p - 1) * (F + B - W) for r in result.ranks)
    one_f_one_b = run("1f1b", p, m)
    assert max(span_idle(one_f_one_b)) == (p - 1) * (F + B + W)


@pytest.mark.parametrize("p,m", [(2, 4), (3, 5), (4, 8), (5, 10)])
def test_zb_h1_keeps_1f1b_peak_activation_memory(p, m):
    """Every rank holds at most p micro-batches (from forward to W): 1F1B's first rank's."""
    assert activations(run("zb-h1", p, m)) == [p] * p
    assert max(activations(run("1f1b", p, m))) == p


@pytest.mark.parametrize("p,m", [(2, 3), (3, 5), (3, 8), (4, 7), (4, 12), (5, 9)])
def test_zb_h2_has_no_bubble_inside_any_rank_with_2p_minus_1_micro_batches_of_memory(p, m):
    result = run("zb-h2", p, m)
    assert span_idle(result) == [0] * p  # (p-1)(F+B-2W) = 0
    assert activations(result) == [2 * p - 1] * p
    # the step itself cannot end before the last rank's first input arrives, (p-1)F late: that
    # is ZB-H1's step time already
    assert result.iteration_time == 3 * m + (p - 1) == run("zb-h1", p, m).iteration_time


def test_zb_h2_with_too_few_micro_batches_is_zb_h1():
    header = make_header(4, 5, 1, schedule="zb-h2")
    assert build_schedule("zb-h2", header) == build_schedule("zb-h1", header)


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8)])
def test_interleaved_zero_bubble_on_chunks(p, v, m):
    """ZB-H1 on v chunks per rank (torch's InterleavedZeroBubble): at most v p chunk
    micro-batches held, and a bubble below interleaved 1F1B's 3(p-1)."""
    result = run("zb-h1", p, m, v)
    assert max(activations(result)) == v * p
    assert result.iteration_time - 3 * v * m < 3 * (p - 1)


# ---------------------------------------------------------------------- token-sliced variants


@pytest.mark.parametrize("p,m,n", [(2, 1, 4), (4, 1, 8), (4, 2, 4), (4, 4, 4), (2, 4, 4)])
def test_seq_zb_keeps_seq1f1b_memory_and_is_never_slower(p, m, n):
    """seq1f1b's first rank holds n + p - 1 slices (or all m n, when fewer); seq-zb holds as many
    on every rank, and its B's, half a backward, drain the pipeline faster."""
    zb, seq = run("seq-zb", p, m, slices=n), run("seq1f1b", p, m, slices=n)
    assert max(activations(zb)) == max(activations(seq)) == min(n + p - 1, m * n)
    assert zb.iteration_time < seq.iteration_time


@pytest.mark.parametrize("p,m,n", [(2, 4, 4), (4, 4, 4), (4, 8, 2), (3, 3, 4)])
def test_seq_zb_with_zb_h2_memory_has_no_bubble_inside_any_rank(p, m, n):
    tight, loose = run("seq-zb", p, m, slices=n), run("seq-zb", p, m, slices=n, hold=2 * p - 1)
    assert max(activations(loose)) > max(activations(tight))
    assert span_idle(loose) == [0] * p < span_idle(tight)


@pytest.mark.parametrize("p,v,m,n", [(2, 2, 2, 4), (4, 2, 4, 4), (2, 2, 1, 4)])
def test_seq_interleaved_holds_fewer_activations_than_interleaved(p, v, m, n):
    sliced = run("seq-interleaved", p, m, v, slices=n)
    assert sliced.iteration_time <= run("looped-bfs", p, m, v, slices=n).iteration_time
    if m % p == 0:
        assert max(activations(sliced)) < max(activations(run("interleaved", p, m, v, slices=n)))


# ---------------------------------------------------------------------------- recomputation


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_recompute_costs_a_forward_and_holds_one_graph(p, m):
    plain, full = run("1f1b", p, m), run("1f1b", p, m, choice="full")
    assert all(r.busy == 4 * m for r in full.ranks)  # F + R + B = 1 + 1 + 2
    assert [e.end - e.start for e in full.events if e.instr.op is Op.RECOMPUTE] == [1.0] * (p * m)
    assert activations(full) == [1] * p < activations(plain)
    # 1F1B's steady state never waits for a gradient, so here the recomputes add one forward
    # per micro-batch to the critical path and leave the bubble as it was
    assert full.iteration_time == plain.iteration_time + m
    assert [r.idle for r in full.ranks] == [r.idle for r in plain.ranks]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "seq1f1b", "terapipe"])
def test_recompute_runs_in_the_wait_for_a_gradient(schedule):
    """A recompute sits right before its backward's gradient receive: wherever a rank waits for
    a gradient, it has just recomputed (the recompute filled part of the wait), and the step
    grows by the last stage's recomputes alone, m n forwards, whatever the other ranks do."""
    p, m, n = 4, 4, 2
    plain, full = run(schedule, p, m, slices=n), run(schedule, p, m, slices=n, choice="full")
    waits = [e for e in full.events if e.instr.op is Op.RECV and e.instr.payload.value == "grad" and e.wait > 0]
    assert waits and all(full.events_of(e.rank)[e.index - 1].instr.op is Op.RECOMPUTE for e in waits)
    assert full.iteration_time == plain.iteration_time + m * n


# ------------------------------------------------------------------------ V-shaped schedules


def run_v(schedule: str, p: int, m: int, slices: int = 1):
    """2p chunks of half a 1F1B stage on p ranks in a V; unit costs per chunk (F 1, B 2, W 1)."""
    header = place(make_header(2 * p, m, slices, schedule=schedule), vshape(2 * p, p))
    return simulate(lower(header, build_schedule(schedule, header)), UnitCosts(), GLOO)


@pytest.mark.parametrize("p,m", [(2, 3), (2, 4), (3, 5), (3, 6), (4, 7), (4, 8), (4, 12)])
def test_zbv_has_no_bubble_at_1f1b_memory(p, m):
    """ZB-V (Qi et al., section 6): with M >= 2p - 1 and F = B = W, no rank idles between its
    first and last compute, while each holds 2p chunk micro-batches of half a stage: p stages'
    worth, 1F1B's first rank's peak on the same p ranks."""
    result = run_v("zbv", p, m)
    assert all(r.busy == 2 * 3 * m for r in result.ranks)  # two chunks, F + B + W each
    assert span_idle(result) == [0] * p
    assert activations(result) == [2 * p] * p
    assert Fraction(int(max(activations(result))), 2) == max(activations(run("1f1b", p, m)))
    # the step still ends p - 1 chunk forwards after the busy time: the last rank waits that
    # long for its first input (as ZB-H2's does, in chunks of half the size)
    assert result.iteration_time == 6 * m + (p - 1)


@pytest.mark.parametrize("p,m", [(2, 1), (3, 2), (4, 3)])
def test_zbv_with_too_few_micro_batches_idles_but_stays_within_memory(p, m):
    """torch's order on max(2p - 1, M) micro-batches with the missing ones dropped."""
    result = run_v("zbv", p, m)
    assert max(activations(result)) <= 2 * p
    assert max(span_idle(result)) > 0


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 10), (3, 9)])
def test_dualpipev_bubble_and_memory_of_the_dualpipe_table(p, m):
    """DualPipe's table, DualPipeV row, PP = 2p chunks: activations PP + 1 per rank; bubble
    (PP/2 - 1)(F&B + B - 3W). Under unit costs F = 1, B = 2 (a full backward), W = 1 and the
    overlapped pair F&B = B = 2 (the forward hidden under the backward) that is p - 1. The
    simulator prices the pair one after the other (CPU), and the schedule still idles p - 1 on
    its first rank, the fill of its last rank's unpaired first F, B; every other rank less."""
    F, B, W, FB = 1, 2, 1, 2
    result = run_v("dualpipev", p, m)
    assert activations(result) == [2 * p + 1] * p
    assert span_idle(result) == [(p - 1 - r) * F for r in range(p)]
    assert max(span_idle(result)) == (p - 1) * (FB + B - 3 * W)
    assert all(r.busy == 2 * 3 * m for r in result.ranks)
    assert result.iteration_time == 6 * m + (p - 1)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_shapes_with_token_slices_hold_proportionally_more_slices(schedule):
    """n slices per micro-batch: the same order, each action n slice instructions; the peak
    counts slice activations, n times the micro-batch figure."""
    p, m, n = 2, 4, 4
    assert max(activations(run_v(schedule, p, m, slices=n))) == n * max(activations(run_v(schedule, p, m)))
