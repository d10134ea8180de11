"""Every schedule of the installed torch.distributed.pipelining, built by torch's own code and
dumped with its `_dump_csv`, imported onto a real model (tiny GPT; six blocks for eight stages)
and run by the reference interpreter: loss and gradients as plain autograd on the unsliced model
(the check `tpc run --verify-grads` makes), in both CSV forms. Torch's own Schedule1F1B order is
wrong (tests/compiler/test_torch_schedule.py) and is left out here."""

from __future__ import annotations

import copy

import pytest
from torch.distributed.pipelining import schedules as S

from tests.compiler.torch_schedules import CASES, build, dump
from tests.executors.real import model_file, traced
from tpc.cli.compile import check_options
from tpc.compiler.header import build_header
from tpc.compiler.frontend import file_sha256
from tpc.compiler.torch_schedule.actions import read_csv
from tpc.compiler.torch_schedule.importer import plan_from_schedule
from tpc.compiler.torch_schedule.layout import layout_of, place
from tpc.executors.training.batches import RandomTokens
from tpc.executors.interpreter import interpret
from tpc.executors.options import RunOptions
from tpc.executors.oracle import batch_reference, gradient_error
from tpc.ir.diagnostics import TpirError

TOL = 1e-5
SEQ = 8


def torch_plan(path, *, slices: int = 1, dp: int = 1, rows: int = 1):
    """The plan `tpc compile MODEL --schedule-file PATH --slices N --dp D` makes, on the tiny
    GPT that has units for the CSV's stages (traced once per model)."""
    sched = read_csv(str(path))
    layout = layout_of(sched)
    name = "gpt" if layout.stages <= 4 else "gpt_deep"
    model_path = model_file(name)
    model, sliced, vocab = traced(model_path, SEQ)
    mbs = layout.microbatches // slices
    opts = check_options(stages=layout.stages, microbatches=mbs, seq_len=SEQ, batch=mbs * rows * dp,
                         slices=str(slices), schedule="gpipe", dp=dp, ranks=None)
    ranges = [tuple(r) for r in sliced.partition_by_params(layout.stages)]
    header = build_header(model_path=model_path, sha256=file_sha256(model_path), factory="model", opts=opts,
                          vocab=vocab, unit_labels=sliced.unit_labels, ranges=ranges, ties=sliced.ties(ranges))
    return plan_from_schedule(sched, place(header, layout, "--schedule-file")).plan, model, sliced


def run_and_check(plan, model, sliced):
    result = interpret(plan, model=copy.deepcopy(model), sliced=sliced)
    h = plan.header
    ref_loss, ref_grads, _ = batch_reference(copy.deepcopy(model),
                                              RandomTokens(0, h.shape.batch, SEQ, h.shape.vocab).get(0))
    worst, where = gradient_error(result.first_grads, ref_grads)
    assert worst <= TOL, (worst, where)
    assert abs(result.losses[0] - ref_loss) <= TOL * abs(ref_loss)


GRID = [(cls, case) for cls, cases in CASES.items() if cls is not S.Schedule1F1B for case in cases]


@pytest.mark.parametrize("cls,case", GRID, ids=lambda p: p.__name__ if isinstance(p, type) else "x".join(map(str, p)))
def test_torch_schedule_runs_exactly(tmp_path, cls, case):
    schedule = build(cls, *case)
    forms = ["compute_only"] + (["compute_comms"] if isinstance(schedule, S._PipelineScheduleRuntime) else [])
    for fmt in forms:
        run_and_check(*torch_plan(dump(schedule, tmp_path / f"{fmt}.csv", fmt)))


def test_data_parallel_replicas_reduce_where_the_csv_says(tmp_path):
    path = dump(build(S.ScheduleInterleavedZeroBubble, 2, 2, 4), tmp_path / "zb.csv", "compute_comms")
    plan, model, sliced = torch_plan(path, dp=2, rows=2)
    assert sum(i.op.value == "allreduce" for p in plan.ranks for i in p.instrs) == 4  # the CSV's REDUCE_GRAD
    run_and_check(plan, model, sliced)


def test_token_slices_under_a_torch_schedule(tmp_path):
    # LoopedBFS back-propagates micro-batches in reverse: flattened (micro-batch, slice) units in
    # reverse are each micro-batch's slices in reverse token order, as the KV gradients need
    path = dump(build(S.ScheduleLoopedBFS, 2, 2, 4), tmp_path / "bfs.csv")
    plan, model, sliced = torch_plan(path, slices=2)
    assert [len(m.slices) for m in plan.header.microbatches] == [2, 2]
    run_and_check(plan, model, sliced)
    # GPipe back-propagates in forward order: slice 0 before slice 1, which tpc refuses
    with pytest.raises(TpirError) as e:
        torch_plan(dump(build(S.ScheduleGPipe, 2, 1, 4), tmp_path / "gpipe.csv"), slices=2)
    assert "slices are back-propagated in reverse token order" in e.value.render()


def test_compile_a_torch_schedule_and_run_it_from_the_command_line(tmp_path, capsys, monkeypatch):
    from tpc.cli.main import main

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    csv = dump(build(S.ScheduleZBVZeroBubble, 2, 2, 4), tmp_path / "zbv.csv", "compute_comms")
    plan = tmp_path / "zbv.tpir"
    assert main(["compile", model_file("gpt"), "--schedule-file", str(csv), "-o", str(plan), "--seq-len",
                 str(SEQ), "--batch", "4"]) == 0
    out, err = capsys.readouterr()
    assert "4 stages x 1 data replica, 4 micro-batches x 1 slices, schedule torch csv zbv.csv" in out
    assert "the CSV's own sends and receives; dropped 4 REDUCE_GRAD" in err
    text = plan.read_text()
    assert "stage 3 rank 0 units 3:4" in text and "# torch 3F0 at 1:" in text  # V-shape; where each came from
    assert main(["run", "--interpret", str(plan), "--verify-grads"]) == 0
    assert ": ok" in capsys.readouterr().out
    # the plan's schedule back out, with 2 token slices per micro-batch, and in again with its map
    sliced_plan = tmp_path / "sliced.tpir"
    assert main(["compile", model_file("gpt"), "--schedule", "seq1f1b", "--stages", "4", "--microbatches", "2",
                 "--slices", "2", "-o", str(sliced_plan), "--seq-len", str(SEQ), "--batch", "4", "-q"]) == 0
    assert main(["export-schedule", str(sliced_plan), "-o", str(tmp_path / "s.csv")]) == 0
    again = tmp_path / "again.tpir"
    assert main(["compile", model_file("gpt"), "--schedule-file", str(tmp_path / "s.csv"), "-o", str(again),
                 "--seq-len", str(SEQ), "--batch", "4"]) == 0
    capsys.readouterr()
    from tpc.ir.parse import parse

    original, back = (parse(p.read_text(), file=str(p)) for p in (sliced_plan, again))
    assert back.header.microbatches == original.header.microbatches
    assert [p.instrs for p in back.ranks] == [p.instrs for p in original.ranks]
    assert main(["compile", model_file("gpt"), "--schedule-file", str(tmp_path / "s.csv"), "-o", str(again),
                 "--seq-len", "16", "--batch", "4"]) == 1
    assert "--seq-len 16, but the slice map" in capsys.readouterr().err
