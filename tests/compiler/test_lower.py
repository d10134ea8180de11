"""Lowering passes, one at a time and together."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpc.compiler.lowering import lower as L
from tpc.compiler.schedules import build_schedule, with_replicas
from tpc.ir.diagnostics import TpirError
from tpc.ir.nodes import Instr, Op
from tpc.ir.parse import parse
from tpc.ir.printer import print_plan
from tpc.ir.verify import check

from . import SEQ, make_header

F, B = Op.FORWARD, Op.BACKWARD


def _c(op, s, m, i):
    return Instr(op, stage=s, mb=m, slice=i)


def _streams(header, schedule="terapipe"):
    compute = build_schedule(schedule, header)
    return {r: tuple(instrs) for r, instrs in compute.items()}


def _run(header, streams, upto):
    """Run the passes in order up to and including `upto`."""
    for name, run in L.PASSES:
        streams = run(header, streams)
        if name == upto:
            return streams
    raise AssertionError(f"no pass {upto}")


def _texts(stream):
    return [str(i) for i in stream]


# -------------------------------------------------------------------------------- loads


def test_loads_on_first_and_last_stage_ranks_before_first_use():
    header = make_header(3, slices=2, mbs=2)
    out = L.insert_loads(header, _streams(header))
    for rank in (0, 2):
        stream = out[rank]
        for m in range(2):
            loads = [p for p, i in enumerate(stream) if i.op is Op.LOAD and i.mb == m]
            first_use = min(p for p, i in enumerate(stream) if i.op is F and i.mb == m)
            assert loads == [first_use - 1]
    assert not any(i.op is Op.LOAD for i in out[1])


def test_one_load_when_a_rank_holds_first_and_last_stage():
    header = make_header(3, slices=2, mbs=2, stage_ranks=(0, 1, 0))
    out = L.insert_loads(header, _streams(header))
    assert [i.mb for i in out[0] if i.op is Op.LOAD] == [0, 1]
    assert not any(i.op is Op.LOAD for i in out[1])


# ----------------------------------------------------------------------- communication


# Compute and messages of 2 stages on 2 ranks, 1 micro-batch cut into 2 slices, in TeraPipe
# order: whatever the slice lengths, lowering places these lines the same way.
TWO_STAGES_TWO_SLICES = {
    0: [
        "forward stage 0 mb 0 slice 0",
        "send act stage 0 mb 0 slice 0 to 1",
        "forward stage 0 mb 0 slice 1",
        "send act stage 0 mb 0 slice 1 to 1",
        "recv grad stage 0 mb 0 slice 1 from 1",
        "backward stage 0 mb 0 slice 1",
        "recv grad stage 0 mb 0 slice 0 from 1",
        "backward stage 0 mb 0 slice 0",
    ],
    1: [
        "recv act stage 1 mb 0 slice 0 from 0",
        "forward stage 1 mb 0 slice 0",
        "recv act stage 1 mb 0 slice 1 from 0",
        "forward stage 1 mb 0 slice 1",
        "backward stage 1 mb 0 slice 1",
        "send grad stage 1 mb 0 slice 1 to 0",
        "backward stage 1 mb 0 slice 0",
        "send grad stage 1 mb 0 slice 0 to 0",
    ],
}


def test_recv_right_before_and_send_right_after_the_compute():
    header = make_header(2, slices=2, mbs=1)
    out = L.insert_comm(header, _streams(header))
    assert _texts(out[0]) == TWO_STAGES_TWO_SLICES[0]
    assert _texts(out[1]) == TWO_STAGES_TWO_SLICES[1]


def test_no_messages_between_stages_on_the_same_rank():
    header = make_header(4, slices=2, mbs=2, stage_ranks=(0, 0, 1, 1))
    out = L.insert_comm(header, _streams(header))
    msgs = [i for stream in out.values() for i in stream if i.op in (Op.SEND, Op.RECV)]
    # only the 1 -> 2 boundary crosses ranks: 2 mbs x 2 slices, act and grad, send and recv
    assert len(msgs) == 16
    assert {(i.op, i.stage) for i in msgs} == {(Op.SEND, 1), (Op.RECV, 2), (Op.SEND, 2), (Op.RECV, 1)}


def test_sends_follow_the_receivers_order_so_channels_stay_fifo():
    """The receiver needs mb 1 before mb 0: the send of mb 0 waits for mb 1's."""
    header = make_header(2, slices=1, mbs=2)
    compute = {
        0: (_c(F, 0, 0, 0), _c(F, 0, 1, 0), _c(B, 0, 1, 0), _c(B, 0, 0, 0)),
        1: (_c(F, 1, 1, 0), _c(F, 1, 0, 0), _c(B, 1, 1, 0), _c(B, 1, 0, 0)),
    }
    out = L.insert_comm(header, compute)
    assert _texts(out[0])[:4] == [
        "forward stage 0 mb 0 slice 0",
        "forward stage 0 mb 1 slice 0",
        "send act stage 0 mb 1 slice 0 to 1",
        "send act stage 0 mb 0 slice 0 to 1",
    ]
    check(L.lower(header, compute, verify=False))


def test_sends_in_production_order_would_cross_and_the_verifier_says_so():
    """The same compute order with sends placed naively is refused: the reordering matters."""
    header = make_header(2, slices=1, mbs=2)
    compute = {
        0: (_c(F, 0, 0, 0), _c(F, 0, 1, 0), _c(B, 0, 1, 0), _c(B, 0, 0, 0)),
        1: (_c(F, 1, 1, 0), _c(F, 1, 0, 0), _c(B, 1, 1, 0), _c(B, 1, 0, 0)),
    }
    plan = L.lower(header, compute, verify=False)
    r0 = list(plan.ranks[0].instrs)
    a, b = (p for p, i in enumerate(r0) if i.op is Op.SEND)
    r0[a], r0[b] = r0[b], r0[a]
    naive = plan.__class__(header=header, ranks=(plan.ranks[0].with_trivia(instrs=tuple(r0)), plan.ranks[1]))
    with pytest.raises(TpirError) as err:
        check(naive)
    assert "cross" in err.value.render()


def test_split_backward_sends_the_gradient_after_backward_input():
    header = make_header(2, slices=1, mbs=1)
    BI, BW = Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT
    compute = {
        0: (_c(F, 0, 0, 0), _c(BI, 0, 0, 0), _c(BW, 0, 0, 0)),
        1: (_c(F, 1, 0, 0), _c(BI, 1, 0, 0), _c(BW, 1, 0, 0)),
    }
    plan = L.lower(header, compute)
    assert _texts(plan.ranks[1].instrs) == [
        "load mb 0",
        "recv act stage 1 mb 0 slice 0 from 0",
        "forward stage 1 mb 0 slice 0",
        "backward-input stage 1 mb 0 slice 0",
        "send grad stage 1 mb 0 slice 0 to 0",
        "backward-weight stage 1 mb 0 slice 0",
        "free-kv stage 1 mb 0",
        "step",
    ]


# ---------------------------------------------------------------- free-kv, reductions, step


def test_free_kv_after_the_last_backward_of_each_stage_and_mb():
    header = make_header(2, slices=3, mbs=2)
    out = _run(header, _streams(header, "seq1f1b"), "insert_free_kv")
    for rank, stream in out.items():
        frees = [(p, i) for p, i in enumerate(stream) if i.op is Op.FREE_KV]
        assert sorted((i.stage, i.mb) for _, i in frees) == [(rank, 0), (rank, 1)]
        for p, free in frees:
            last = max(q for q, i in enumerate(stream) if i.op is B and i.mb == free.mb)
            between = stream[last + 1 : p]
            assert all(i.op is Op.SEND for i in between)  # only its own gradient send
            assert stream[last].slice == 0


@pytest.mark.parametrize("dp", [1, 2])
def test_allreduce_once_per_stage_after_its_last_backward_iff_data_parallel(dp):
    header = make_header(4, slices=2, mbs=2, dp=dp, stage_ranks=(0, 1, 0, 1))
    out = _run(header, _streams(header, "gpipe"), "insert_allreduce")
    for rank, stream in out.items():
        reduces = [(p, i.stage) for p, i in enumerate(stream) if i.op is Op.ALLREDUCE]
        if dp == 1:
            assert reduces == []
            continue
        assert sorted(s for _, s in reduces) == sorted(header.stages_of_rank(rank))
        for p, s in reduces:
            assert p > max(q for q, i in enumerate(stream) if i.op is B and i.stage == s)


def test_reduce_tied_only_for_ties_spanning_ranks_before_step():
    header = make_header(
        4, slices=1, mbs=1, dp=2, stage_ranks=(0, 0, 1, 1),
        ties=(("across", (0, 3)), ("local", (0, 1)), ("other", (1, 2))),
    )  # fmt: skip
    plan = L.lower(header, _streams(header))
    for program in plan.ranks:
        tail = _texts(program.instrs)[-3:]
        assert tail == ['reduce-tied "across"', 'reduce-tied "other"', "step"]
        assert sum(i.op is Op.STEP for i in program.instrs) == 1
        last_allreduce = max(p for p, i in enumerate(program.instrs) if i.op is Op.ALLREDUCE)
        assert last_allreduce < len(program.instrs) - 3


def test_doc_example_plan_is_what_lowering_gives():
    """docs/ir.md's example (2 stages, 1 mb, slices 0:40 40:64, a tie) comes out line for line."""
    header = make_header(2, slices=(40, 24), mbs=1, seq=64, ties=(("transformer.wte.weight", (0, 1)),))
    plan = L.lower(header, _streams(header, "terapipe"))
    for rank in (0, 1):
        assert _texts(plan.ranks[rank].instrs) == [
            "load mb 0",
            *TWO_STAGES_TWO_SLICES[rank],
            f"free-kv stage {rank} mb 0",
            'reduce-tied "transformer.wte.weight"',
            "step",
        ]


def test_lower_is_pure_and_deterministic():
    header = make_header(3, slices=3, mbs=2, dp=2, ties=(("t", (0, 2)),))
    compute = _streams(header, "seq1f1b")
    before = {r: tuple(s) for r, s in compute.items()}
    assert L.lower(header, compute) == L.lower(header, compute)
    assert compute == before


def test_lower_refuses_an_incomplete_schedule():
    header = make_header(2, slices=2, mbs=1)
    compute = _streams(header)
    compute[1] = tuple(i for i in compute[1] if not (i.op is B and i.slice == 0))
    with pytest.raises(TpirError):
        L.lower(header, compute)


# --------------------------------------------------------------------------- golden plans

GOLDEN = Path(__file__).parent / "golden"
GOLDEN_CASES = {
    # two stages, three token slices, two micro-batches, a tie across the ranks
    "seq1f1b_k2_s3_m2": dict(stages=2, slices=3, mbs=2, schedule="seq1f1b", ties=(("wte", (0, 1)),)),
    # unequal slices, three micro-batches, two data-parallel replicas (allreduce)
    "1f1b_k3_unequal_m3_dp2": dict(stages=3, slices=(10, 6, 8), mbs=3, dp=2, schedule="1f1b"),
    # four stages on two ranks: local hand-offs between co-located stages, a tie across ranks
    "terapipe_k4_on_2_ranks": dict(
        stages=4, slices=2, mbs=2, schedule="terapipe", stage_ranks=(0, 1, 0, 1), ties=(("wte", (0, 3)),)
    ),
    # two pipelines in opposite directions (format version 3): weight replicas, unequal slices,
    # two data-parallel replicas (reduce-replicas and allreduce)
    "chimera_k4_unequal_m4_dp2": dict(stages=4, slices=(10, 14), mbs=4, dp=2, schedule="chimera"),
}


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_golden_plan(case):
    """Compare byte for byte with tests/compiler/golden/CASE.tpir; TPC_REGEN_GOLDEN=1 rewrites."""
    spec = dict(GOLDEN_CASES[case])
    header = with_replicas(make_header(spec.pop("stages"), **spec))
    text = print_plan(L.lower(header, build_schedule(header.schedule.name, header)))
    path = GOLDEN / f"{case}.tpir"
    if os.environ.get("TPC_REGEN_GOLDEN") == "1":
        path.write_text(text, encoding="utf-8")
    want = path.read_text(encoding="utf-8")
    assert text == want, f"{path} differs from the lowering's output (TPC_REGEN_GOLDEN=1 rewrites it)"
    assert check(parse(want, file=str(path))) == parse(text)


# ------------------------------------------------------------- any valid order, any mapping


@st.composite
def _random_plan_inputs(draw):
    """A header with any stage-to-rank mapping and per-mb slice counts, and the projection of a
    random topological order of the forward/backward dependency graph onto its ranks."""
    K = draw(st.integers(1, 4))
    ranks = tuple(draw(st.lists(st.integers(0, 2), min_size=K, max_size=K)))
    used = sorted(set(ranks))
    ranks = tuple(used.index(r) for r in ranks)  # every rank holds a stage
    M = draw(st.integers(1, 3))
    counts = draw(st.lists(st.integers(1, 3), min_size=M, max_size=M))
    dp = draw(st.integers(1, 2))
    header = make_header(K, slices=1, mbs=M, dp=dp, stage_ranks=ranks, ties=(("t", (0, K - 1)),) if K > 1 else ())
    mbs = tuple(
        dataclasses.replace(mb, slices=tuple((round(i * SEQ / n), round((i + 1) * SEQ / n)) for i in range(n)))
        for mb, n in zip(header.microbatches, counts)
    )
    header = dataclasses.replace(header, microbatches=mbs)

    def deps(op, s, m, i):
        if op is F:
            return [(F, s, m, i - 1)] * (i > 0) + [(F, s - 1, m, i)] * (s > 0)
        return [(F, s, m, i)] + [(B, s, m, i + 1)] * (i + 1 < counts[m]) + [(B, s + 1, m, i)] * (s + 1 < K)

    todo = {(op, s, m, i) for op in (F, B) for s in range(K) for m in range(M) for i in range(counts[m])}
    done, order = set(), []
    while todo:
        ready = sorted(u for u in todo if all(d in done for d in deps(*u)))
        u = ready[draw(st.integers(0, len(ready) - 1))]
        todo.remove(u)
        done.add(u)
        order.append(_c(*u))
    compute = {r: tuple(i for i in order if ranks[i.stage] == r) for r in range(max(ranks) + 1)}
    return header, compute


@settings(max_examples=60, deadline=None)
@given(_random_plan_inputs())
def test_any_valid_order_on_any_mapping_lowers_to_a_verified_plan(inputs):
    header, compute = inputs
    plan = L.lower(header, compute)
    assert tuple(i for i in plan.ranks[0].instrs if i.op in (F, B)) == compute[0]
