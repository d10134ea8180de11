"""The V-shaped schedules (zbv, dualpipev): torch's orders on whole micro-batches, every slicing
lowering to a verified plan, their refusals located; `tpc compile` puts two stages on each rank
for them; the allreduce of a stage tied to another stage of its rank waits for both."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from tpc.compiler.options import CompileOptions
from tpc.compiler.lowering.lower import lower
from tpc.compiler.schedules import build_schedule, placement_of, stages_per_rank
from tpc.compiler.schedules.placement import vshape
from tpc.ir.diagnostics import TpirError
from tpc.ir.nodes import Op, RankProgram
from tpc.ir.verify import check, verify

from . import make_header

UNEQUAL = (5, 11, 1, 7)
V = ["zbv", "dualpipev"]


def header(p, *, schedule, **kw):
    return make_header(2 * p, stage_ranks=vshape(2 * p, p), schedule=schedule, **kw)


def _ops(instrs):
    short = {Op.FORWARD: "F", Op.BACKWARD: "B", Op.BACKWARD_INPUT: "I", Op.BACKWARD_WEIGHT: "W"}
    return [f"{short[i.op]}{i.stage}.{i.mb}" for i in instrs]


@pytest.mark.parametrize("name", V)
def test_v_shapes_lower_to_verified_plans(name):
    """ranks {1,2,3,4} x slices {1,3,unequal} x mbs x dp {1,2}, with the first and last stage
    tied (they share rank 0 in the V)."""
    for p, slices, mbs, dp in itertools.product([1, 2, 3, 4], [1, 3, UNEQUAL], [1, 3, 8, 9], [1, 2]):
        if name == "dualpipev" and mbs < 2 * p:
            continue  # refused: test_dualpipev_refuses_too_few_micro_batches
        h = header(p, schedule=name, slices=slices, mbs=mbs, dp=dp, ties=(("tied", (0, 2 * p - 1)),))
        try:
            check(lower(h, build_schedule(name, h)))
        except TpirError as e:
            pytest.fail(f"{name} p={p} slices={slices} mbs={mbs} dp={dp}:\n{e.render()}")


def test_placement_and_stages_per_rank():
    assert {placement_of(n) for n in V} == {"vshape"}
    assert {stages_per_rank(n) for n in V} == {2}
    assert stages_per_rank("zb-h1") == stages_per_rank("no such schedule") == 1


def test_zbv_is_torchs_order():
    """p = 2, m = 4, rank 0 (chunks 0 and 3): torch's ScheduleZBVZeroBubble for rank 0 is
    F0 F0 F0 | F3 I3 W3 F3 I3 W3 | F0 I0 W0 F3 I3 W3 | F0 I0 W0 F3 I3 W3 | I0 W0 I0 W0."""
    h = header(2, schedule="zbv", mbs=4)
    assert _ops(build_schedule("zbv", h)[0]) == [
        "F0.0", "F0.1", "F0.2", "F3.0", "I3.0", "W3.0", "F3.1", "I3.1", "W3.1",
        "F0.3", "I0.0", "W0.0", "F3.2", "I3.2", "W3.2", "I0.1", "W0.1", "F3.3", "I3.3", "W3.3",
        "I0.2", "W0.2", "I0.3", "W0.3"]  # fmt: skip


def _torch_ops(instrs):
    kind = {Op.FORWARD: "F", Op.BACKWARD: "B", Op.BACKWARD_INPUT: "I", Op.BACKWARD_WEIGHT: "W"}
    return [f"{i.stage}{kind[i.op]}{i.mb}" for i in instrs]


@pytest.mark.parametrize("name,cls,cases", [
    ("zbv", "ScheduleZBVZeroBubble", [(2, 4), (3, 5), (4, 8), (2, 1), (3, 2)]),
    ("dualpipev", "ScheduleDualPipeV", [(2, 4), (3, 6), (4, 8), (4, 11)]),
])
def test_orders_are_torchs_on_every_rank(name, cls, cases, tmp_path):
    """Against the installed torch.distributed.pipelining's own generator, and its runtime
    loads the exported plan back as the same actions."""
    from torch.distributed.pipelining import schedules as S

    from tests.compiler.torch_schedules import build, leaf_actions, stage
    from tpc.compiler.torch_schedule.exporter import export_schedule

    for p, m in cases:
        theirs = leaf_actions(build(getattr(S, cls), p, 2, m).pipeline_order, compute_only=True)
        h = header(p, schedule=name, mbs=m)
        assert {r: _torch_ops(v) for r, v in build_schedule(name, h).items()} == theirs, (p, m)
    plan = lower(h, build_schedule(name, h))
    out = export_schedule(plan, str(tmp_path / f"{name}.csv"))
    assert out.exact
    rt = S._PipelineScheduleRuntime([stage(2 * p, p, 0, s) for s in (0, 2 * p - 1)], m)
    rt._load_csv(out.csv_path)
    assert leaf_actions(rt.pipeline_order) == theirs


def test_dualpipev_pairs_a_forward_with_a_backward_of_another_micro_batch():
    """The steady state's overlapped F&B: a forward directly followed by the full backward of
    another micro-batch on the rank's other chunk (adjacent, independent instructions)."""
    p, m = 3, 8
    h = header(p, schedule="dualpipev", mbs=m)
    for r, instrs in build_schedule("dualpipev", h).items():
        pairs = [(a, b) for a, b in zip(instrs, instrs[1:]) if a.op is Op.FORWARD and b.op is Op.BACKWARD]
        assert len(pairs) >= 2 * (m - 2 * p + r + 1) - (r == p - 1)
        assert all(a.stage != b.stage and a.mb != b.mb for a, b in pairs)


def test_token_slices_run_back_to_back_per_micro_batch():
    h = header(2, schedule="zbv", slices=UNEQUAL, mbs=3)
    for instrs in build_schedule("zbv", h).values():
        for k, ins in enumerate(instrs):
            if ins.op is Op.FORWARD and ins.slice > 0:
                assert (instrs[k - 1].stage, instrs[k - 1].mb, instrs[k - 1].slice) == (ins.stage, ins.mb, ins.slice - 1)
            if ins.op in (Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT) and ins.slice < len(UNEQUAL) - 1:
                prev = instrs[k - 1]
                assert (prev.op, prev.stage, prev.mb, prev.slice) == (ins.op, ins.stage, ins.mb, ins.slice + 1)


def test_dualpipev_refuses_too_few_micro_batches():
    h = header(3, schedule="dualpipev", mbs=5)
    with pytest.raises(TpirError) as err:
        build_schedule("dualpipev", h)
    text = err.value.render()
    assert text.startswith("--schedule dualpipev --microbatches 5: error:")
    assert "at least 2 x 3 ranks = 6 micro-batches" in text and "--microbatches 6 or more" in text


@pytest.mark.parametrize("name", V)
def test_v_shapes_refuse_another_placement(name):
    h = make_header(4, mbs=4, schedule=name)  # one stage per rank
    with pytest.raises(TpirError) as err:
        build_schedule(name, h)
    text = err.value.render()
    assert f"schedule {name!r} runs a V" in text and "stage 0 on rank 0, stage 1 on rank 1" in text


def test_compile_options_put_two_stages_on_each_rank():
    o = CompileOptions(seq_len=16, batch=8, stages=4, microbatches=4, schedule="zbv", dp=2, ranks=4)
    assert o.pipe == 2
    with pytest.raises(TpirError) as err:
        CompileOptions(seq_len=16, batch=4, stages=3, microbatches=4, schedule="dualpipev")
    text = err.value.render()
    assert text.startswith("--stages: error:") and "even number of stages, not 3" in text
    with pytest.raises(TpirError) as err:
        CompileOptions(seq_len=16, batch=8, stages=4, microbatches=4, schedule="zbv", ranks=4)
    assert "--ranks 4 does not match --stages 4 / 2 (two stages per rank) x --dp 1 = 2" in err.value.render()


# ------------------------------------------- allreduce of stages tied on one rank (the V's ends)


def test_allreduce_of_tied_stages_on_one_rank_waits_for_both():
    h = header(2, schedule="zbv", mbs=3, dp=2, ties=(("wte", (0, 3)),))
    plan = lower(h, build_schedule("zbv", h))
    rank0 = plan.ranks[0].instrs
    last_b = max(k for k, i in enumerate(rank0) if i.op in (Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT))
    assert all(k > last_b for k, i in enumerate(rank0) if i.op is Op.ALLREDUCE)
    # moved above stage 0's last backward, the allreduce of stage 3 is an error (R9)
    a = next(k for k, i in enumerate(rank0) if i.op is Op.ALLREDUCE and i.stage == 3)
    w0 = max(k for k, i in enumerate(rank0) if i.stage == 0 and i.op is Op.BACKWARD_WEIGHT)
    moved = list(rank0)
    moved.insert(w0, moved.pop(a))
    bad = dataclasses.replace(plan, ranks=(RankProgram(rank=0, instrs=tuple(moved)),) + plan.ranks[1:])
    errors = [d.message for d in verify(bad)]
    assert any("allreduce stage 3 runs before it is done with the gradients of stage 3 (and of stage 0, "
               "tied to it on this rank)" in e for e in errors), errors


def test_a_rank_of_a_v_counts_the_parameters_of_both_its_stages():
    """What --schedule auto compares against --memory-per-rank: the simulator's peak, which holds
    both chunks' parameters, gradients and optimizer state on each rank of the V."""
    from dataclasses import dataclass

    from tpc.compiler.costmodel.unit import UnitCosts
    from tpc.compiler.predict.simulate import simulate

    @dataclass(frozen=True)
    class Weighted(UnitCosts):
        def param_bytes(self, stage: int) -> float:
            return 10.0 ** stage

    h = header(2, schedule="zbv", mbs=3)
    result = simulate(lower(h, build_schedule("zbv", h)), Weighted())
    assert [r.peak_memory.params for r in result.ranks] == [1 + 1000, 10 + 100]
    assert [r.peak_memory.optimizer for r in result.ranks] == [2 * 1001, 2 * 110]
