"""`simulate(plan, costs, comm="nccl")` (`tpc simulate --comm nccl`): NCCL's rules priced. Each
rank's sends and receives run in issue order on one stream, and a message moves only once both
its ends have started; gloo's buffered sends let a transfer overlap the receiver's work."""

from __future__ import annotations

import pytest

from tests.compiler.simulate.plans import make_header
from tpc.cli.main import main
from tpc.compiler.costmodel.unit import UnitCosts
from tpc.compiler.lowering.lower import lower
from tpc.compiler.schedules import build_schedule, stages_per_rank
from tpc.compiler.schedules.placement import looped, place, vshape
from tpc.compiler.predict.simulate import simulate
from tpc.ir.semantics import GLOO
from tpc.ir.nodes import Op
from tpc.ir.printer import print_plan

SCHEDULES = ["gpipe", "1f1b", "terapipe", "seq1f1b", "zb-h1", "zb-h2", "seq-zb",
             "interleaved", "looped-bfs", "seq-interleaved", "zbv", "dualpipev"]


def plan_for(schedule: str, p: int = 2, m: int = 4, slices: int = 2):
    v = 2 if schedule in ("interleaved", "looped-bfs", "seq-interleaved") else stages_per_rank(schedule)
    header = make_header(p * v, m, slices, schedule=schedule)
    if stages_per_rank(schedule) == 2:
        header = place(header, vshape(p * v, p))
    elif v > 1:
        header = place(header, looped(p * v, p))
    return lower(header, build_schedule(schedule, header))


def test_a_message_moves_only_once_its_receive_has_started():
    """GPipe on 2 ranks, 1 micro-batch of 1 slice, transfers of 5. Rank 1 posts its receive at
    0 and rank 0 sends at 1: the activation arrives at 6 under both rules. Rank 1 computes its
    forward [6, 7] and backward [7, 9] and sends the input gradient at 9; rank 0 has waited at
    its receive since 1, so it arrives at 14 and rank 0's backward ends at 16. Each receive was
    posted before its send, so the rendezvous costs nothing here."""
    plan = plan_for("gpipe", m=1, slices=1)
    costs = UnitCosts(p2p=5.0)
    gloo, nccl = simulate(plan, costs, GLOO), simulate(plan, costs, "nccl")
    assert gloo.iteration_time == nccl.iteration_time == 1 + 5 + 1 + 2 + 5 + 2


def test_a_late_receive_delays_the_transfer():
    """With 2 micro-batches, rank 1 posts its second forward receive only after its first
    forward: under gloo the second activation was on its way since rank 0 sent it; under NCCL it
    moves only from the receive on."""
    plan = plan_for("gpipe", m=2, slices=1)
    costs = UnitCosts(p2p=5.0)
    gloo, nccl = simulate(plan, costs, GLOO), simulate(plan, costs, "nccl")
    recv = lambda res: next(e for e in res.events_of(1) if e.instr.op is Op.RECV and e.instr.mb == 1)  # noqa: E731
    # rank 0: F0 [0,1], F1 [1,2]; rank 1: recv0 ends 6, F0 [6,7], then recv1 posted at 7
    assert recv(gloo).end == 7  # arrived at 2 + 5, before rank 1 asked
    assert recv(nccl).end == 7 + 5  # rank 0's send started at 2, the receive at 7
    assert nccl.iteration_time > gloo.iteration_time


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_runs_and_nccl_only_adds_waits(schedule):
    """Every schedule's NCCL plan runs under NCCL's timing, and every event ends no earlier
    than under gloo's: the rules only add waits."""
    plan = plan_for(schedule)
    for p2p in (0.0, 0.5, 3.0):
        costs = UnitCosts(p2p=p2p)
        gloo, nccl = simulate(plan, costs, GLOO), simulate(plan, costs, "nccl")
        ends = {(e.rank, e.index): e.end for e in gloo.events}
        assert all(e.end >= ends[(e.rank, e.index)] - 1e-9 for e in nccl.events), schedule
        assert nccl.iteration_time >= gloo.iteration_time - 1e-9
        # every compute still costs its own time
        assert [r.compute for r in nccl.ranks] == pytest.approx([r.compute for r in gloo.ranks])


def test_the_command_line_option(tmp_path, capsys):
    path = tmp_path / "p.tpir"
    path.write_text(print_plan(plan_for("1f1b")), encoding="utf-8")
    assert main(["simulate", str(path), "--unit"]) == 0
    gloo = capsys.readouterr().out
    assert main(["simulate", str(path), "--unit", "--comm", "nccl"]) == 0
    nccl = capsys.readouterr().out
    assert "iteration time" in gloo and "iteration time" in nccl


def test_an_unknown_rule_set_is_refused():
    with pytest.raises(ValueError, match="unknown communication rules .mpi.: use gloo or nccl"):
        simulate(plan_for("1f1b"), UnitCosts(), "mpi")


def test_a_rank_with_hundreds_of_sends_in_flight():
    """terapipe on 2 ranks, 8 micro-batches of 64 slices: rank 0 issues 512 sends before any of
    their ends is asked for. They are resolved in order, not by recursion down the stream."""
    header = make_header(2, 8, 64, seq=256, schedule="terapipe")
    plan = lower(header, build_schedule("terapipe", header))
    costs = UnitCosts(p2p=0.5)
    gloo, nccl = simulate(plan, costs, GLOO), simulate(plan, costs, "nccl")
    assert nccl.iteration_time >= gloo.iteration_time
