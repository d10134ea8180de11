"""`tpc show`: the steps x ranks grid."""

from __future__ import annotations

from pathlib import Path

from tpc.cli.main import main
from tpc.ir.nodes import Instr, Op
from tpc.ir.parse import parse
from tpc.ir.show import LEGEND, cell, render_grid

GOLDEN = Path(__file__).parent / "golden"


def _plan(name: str):
    return parse((GOLDEN / name).read_text(), file=name)


def test_cells_name_op_stage_mb_slice():
    assert cell(Instr(Op.FORWARD, stage=0, mb=1, slice=2)) == "F0.1.2"
    assert cell(Instr(Op.FORWARD, stage=3, mb=0, slice=10, checkpoint=True)) == "F3.0.10*"
    assert cell(Instr(Op.RECOMPUTE, stage=0, mb=1, slice=2)) == "R0.1.2"
    assert cell(Instr(Op.BACKWARD, stage=1, mb=0, slice=0)) == "B1.0.0"
    assert cell(Instr(Op.BACKWARD_INPUT, stage=1, mb=0, slice=0)) == "Bi1.0.0"
    assert cell(Instr(Op.BACKWARD_WEIGHT, stage=1, mb=0, slice=0)) == "Bw1.0.0"
    assert cell(Instr(Op.STEP)) == "step"


def test_docs_example_grid_exactly():
    grid = render_grid(_plan("terapipe_two_stages.tpir"))
    assert grid == (
        "step  rank 0  rank 1\n"
        "   0  F0.0.0  F1.0.0\n"
        "   1  F0.0.1  F1.0.1\n"
        "   2  B0.0.1  B1.0.1\n"
        "   3  B0.0.0  B1.0.0\n"
        "   4  step    step\n"
        "\n" + LEGEND
    )


def test_uneven_ranks_are_padded_with_idle_cells_and_checkpoint_is_marked():
    lines = render_grid(_plan("gpipe_checkpoint_dp2.tpir")).splitlines()
    assert lines[1] == "   0  F0.0.0*  F1.0.0"
    # rank 0 recomputes 4 slices, so rank 1 runs out of compute 4 rows earlier
    assert lines[5].split() == ["4", "R0.0.1", "B1.0.1"]
    assert lines[9].split() == ["8", "R0.1.1", "step"]
    assert lines[10] == "   9  B0.1.1   ."
    assert lines[13].split() == ["12", "step", "."]
    assert lines[14] == ""


def test_fixed_width_clips_and_shortens_titles():
    lines = render_grid(_plan("gpipe_checkpoint_dp2.tpir"), width=5).splitlines()
    assert lines[0] == "step  r0     r1"
    assert lines[1] == "   0  F0.0~  F1.0~"
    wide = render_grid(_plan("gpipe_checkpoint_dp2.tpir"), width=12).splitlines()
    assert wide[1] == "   0  F0.0.0*       F1.0.0"


def test_grid_is_deterministic_and_omits_communication():
    plan = _plan("two_stages_one_rank_tied.tpir")
    grid = render_grid(plan)
    assert grid == render_grid(parse((GOLDEN / "two_stages_one_rank_tied.tpir").read_text()))
    body = grid.split("\n\n")[0]
    for word in ("send", "recv", "load", "free", "reduce"):
        assert word not in body
    rows = body.splitlines()[1:]
    computes = [sum(i.op in (Op.FORWARD, Op.BACKWARD, Op.STEP) for i in r.instrs) for r in plan.ranks]
    assert len(rows) == max(computes)


def test_cli_show_prints_the_grid(tmp_path, capsys):
    path = tmp_path / "p.tpir"
    path.write_text((GOLDEN / "zero_bubble_three_ranks.tpir").read_text())
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "step  rank 0   rank 1   rank 2"
    assert out.splitlines()[6] == "   5  Bi0.0.0  Bw1.0.2  Bw2.0.2"


def test_cli_show_bad_plan_is_a_located_error(tmp_path, capsys):
    path = tmp_path / "p.tpir"
    path.write_text("tpir 1\nmodle\n")
    assert main(["show", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}:2:1: error:" in err and "did you mean 'model'?" in err


def test_a_v_shaped_plan_marks_the_way_down_and_the_way_up():
    from tests.compiler import make_header
    from tpc.compiler.lowering.lower import lower
    from tpc.compiler.schedules import build_schedule
    from tpc.compiler.schedules.placement import looped, vshape
    from tpc.ir.show import directions

    h = make_header(6, mbs=6, schedule="dualpipev", stage_ranks=vshape(6, 3))
    assert directions(h) == {0: "dn", 1: "dn", 2: "dn", 3: "up", 4: "up", 5: "up"}
    text = render_grid(lower(h, build_schedule("dualpipev", h)))
    assert text.splitlines()[0].split() == ["step", "rank", "0", "[0,5]", "rank", "1", "[1,4]", "rank", "2", "[2,3]"]
    assert text.splitlines()[1].split() == ["0", "F0.0.0:dn", "F1.0.0:dn", "F2.0.0:dn"]
    assert "F5.0.0:up" in text and ":c1" not in text and ":up one of the way back" in text
    # one direction: a loop, or one stage per rank
    assert directions(make_header(4, stage_ranks=looped(4, 2))) is None
    assert directions(make_header(3)) is None
