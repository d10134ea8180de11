"""Chrome trace, Gantt picture, predicted-vs-measured comparison and `tpc simulate`."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from tests.compiler.simulate.plans import make_plan
from tpc.cli.main import main
from tpc.compiler.costmodel.unit import UnitCosts
from tpc.compiler.predict.simulate import simulate
from tpc.compiler.predict.chrome_trace import TimedInstr, read_trace
from tpc.compiler.predict.timeline import compare, predicted_trace, write_gantt
from tpc.ir.semantics import GLOO
from tpc.ir.diagnostics import TpirError
from tpc.ir.nodes import Op
from tpc.ir.parse import parse
from tpc.ir.printer import print_plan


@pytest.fixture
def plan_file(tmp_path):
    path = tmp_path / "plan.tpir"
    path.write_text(print_plan(make_plan("1f1b", 3, 4, 2)), encoding="utf-8")
    return path


def test_trace_has_one_event_per_instruction_and_a_flow_per_message(plan_file):
    text = plan_file.read_text()
    plan = parse(text, file=str(plan_file))
    result = simulate(plan, UnitCosts(p2p=0.25), GLOO)
    trace = json.loads(json.dumps(predicted_trace(result, str(plan_file))))  # valid JSON
    events = trace["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == sum(len(r.instrs) for r in plan.ranks)
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    lines = text.splitlines()
    for x in xs:
        assert x["pid"] == x["args"]["rank"]
        assert lines[x["args"]["line"] - 1].strip() == x["args"]["instr"]
        assert x["dur"] >= 0

    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    sends = [x for x in xs if x["cat"] == "send"]
    recvs = [x for x in xs if x["cat"] == "recv"]
    assert len(starts) == len(ends) == len(sends) == len(recvs) > 0
    send_at = {(x["pid"], x["ts"]) for x in sends}
    recv_end = {(x["pid"], x["ts"] + x["dur"]) for x in recvs}
    # an exchange's receive does not hold its rank: its data is there when the compute using
    # it starts its work (the simulator's `arrival`)
    recv_end |= {(e.rank, e.arrival * 1e3) for e in result.events if e.arrival is not None}
    for k, s in starts.items():
        f = ends[k]
        assert (s["pid"], s["ts"]) in send_at and (f["pid"], f["ts"]) in recv_end
        # the data is there one transfer (0.25 units, written as 250 us) after the send
        assert f["ts"] >= s["ts"] + 250 - 1e-6
        assert f["bp"] == "e" and s["name"] == f["name"] in ("act", "grad")
    assert any(f["ts"] == pytest.approx(starts[k]["ts"] + 250) for k, f in ends.items())


def test_trace_pairs_each_send_with_its_receive(plan_file):
    from tpc.compiler.predict.timeline import message_pairs

    result = simulate(parse(plan_file.read_text(), file="p"), UnitCosts(), GLOO)
    pairs = message_pairs(result.events)
    assert len(pairs) == sum(e.instr.op is Op.SEND for e in result.events)
    for send, recv in pairs:
        a, b = send.instr, recv.instr
        assert (a.payload, a.mb, a.slice) == (b.payload, b.mb, b.slice)
        assert a.peer == recv.rank and b.peer == send.rank
        assert b.stage == a.stage + (1 if a.payload.value == "act" else -1)


def test_gantt_png_is_written_and_shows_forward_and_backward(tmp_path):
    import matplotlib.image

    result = simulate(make_plan("terapipe", 4, 1, 8), UnitCosts(), GLOO)
    out = tmp_path / "t.png"
    write_gantt(result, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(str(out))[..., :3]
    h, w, _ = img.shape
    assert w > 1000 and h > 300

    def share(rgb_hex):
        rgb = [int(rgb_hex[i:i + 2], 16) / 255 for i in (1, 3, 5)]
        return (abs(img - rgb).max(axis=-1) < 0.02).mean()

    # each rank computes 8 forwards of 1 and 8 backwards of 2: backward boxes cover about
    # twice the area of forward boxes (less the white box edges); idle shows as grey
    assert share("#4C72B0") > 0.05
    assert share("#DD8452") > 2 * share("#4C72B0") * 0.8
    assert share("#EEEEEE") > 0.02


def _measured(tmp_path, events, name="measured.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def _x(rank, instr, ts_ms, dur_ms, step=0):
    return {"ph": "X", "pid": rank, "tid": 0, "name": instr, "ts": ts_ms * 1e3,
            "dur": dur_ms * 1e3, "args": {"rank": rank, "instr": instr, "line": None, "step": step}}


GPIPE_2x1 = [  # (rank, instr, ts ms, dur ms): measured run of a 2-stage, 1 micro-batch plan
    (0, "forward stage 0 mb 0 slice 0", 0.0, 1.2),
    (1, "recv act stage 1 mb 0 slice 0 from 0", 0.0, 1.2),  # waiting: not compute
    (1, "forward stage 1 mb 0 slice 0", 1.2, 1.0),
    (1, "backward stage 1 mb 0 slice 0", 2.2, 2.0),
    (0, "recv grad stage 0 mb 0 slice 0 from 1", 1.2, 3.0),
    (0, "backward stage 0 mb 0 slice 0", 4.2, 3.3),
]


def test_compare_fits_the_unit_and_reports_relative_errors():
    """Unit costs predict 6 units and 3 of compute per rank. The measured step spans 7.5 ms;
    rank 0 computes 4.5 ms, rank 1 3.0 ms: 7.5 ms of compute for 6 predicted units, so one
    unit is fitted to 1.25 ms and the prediction reads 7.5 ms, 3.75 ms and 3.75 ms."""
    result = simulate(make_plan("gpipe", 2, 1), UnitCosts(), GLOO)
    measured = [TimedInstr(r, i, ts * 1e3, d * 1e3) for r, i, ts, d in GPIPE_2x1]
    comparison = compare(result, measured)
    assert comparison.ms_per_unit == pytest.approx(1.25)
    rows = comparison.rows
    assert [r.what for r in rows] == ["iteration time", "rank 0 compute", "rank 1 compute"]
    assert [r.predicted for r in rows] == pytest.approx([7.5, 3.75, 3.75])
    assert [r.measured for r in rows] == pytest.approx([7.5, 4.5, 3.0])
    assert [r.error for r in rows] == pytest.approx([0.0, 3.75 / 4.5 - 1, 0.25])


@dataclass(frozen=True)
class Seconds(UnitCosts):
    """Forward 1 ms, backward 2 ms: a cost model in seconds, compared without fitting."""

    forward: float = 1e-3
    backward: float = 2e-3
    time_unit: str = "s"


def test_compare_takes_a_prediction_in_seconds_as_it_is():
    result = simulate(make_plan("gpipe", 2, 1), Seconds(), GLOO)
    measured = [TimedInstr(r, i, ts * 1e3, d * 1e3) for r, i, ts, d in GPIPE_2x1]
    comparison = compare(result, measured)
    assert comparison.ms_per_unit is None
    assert [r.error for r in comparison.rows] == pytest.approx([6 / 7.5 - 1, 3 / 4.5 - 1, 0.0])


def test_compare_on_the_cli_skips_the_warm_up_step(tmp_path, capsys):
    plan = tmp_path / "plan.tpir"
    plan.write_text(print_plan(make_plan("gpipe", 2, 1)))
    events = [_x(r, i, ts * 10, d * 10, step=0) for r, i, ts, d in GPIPE_2x1]  # slow warm-up
    for step in (1, 2):
        events += [_x(r, i, 100 * step + ts, d, step=step) for r, i, ts, d in GPIPE_2x1]
    measured = _measured(tmp_path, events)
    assert main(["simulate", str(plan), "--unit", "--compare", measured]) == 0
    out = capsys.readouterr().out
    table = out[out.index("predicted vs measured"):].splitlines()
    assert table[2].split() == ["iteration", "time", "7.500", "ms", "7.500", "ms", "+0.0%"]
    assert table[3].split() == ["rank", "0", "compute", "3.750", "ms", "4.500", "ms", "-16.7%"]
    assert table[4].split() == ["rank", "1", "compute", "3.750", "ms", "3.000", "ms", "+25.0%"]
    assert table[5].startswith("unit costs: 1 unit fitted to 1.25 ms")


def test_a_file_that_is_not_a_trace_is_a_located_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [{"ph": "X", "ts": 0, "dur": 1, "args": {"rank": 0}}]}')
    with pytest.raises(TpirError) as err:
        read_trace(str(bad))
    assert "args.instr" in str(err.value) and str(bad) in str(err.value)
    assert err.value.diagnostics[0].hint


def test_simulate_cli_prints_the_table_and_writes_trace_and_picture(plan_file, tmp_path, capsys):
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    assert main(["simulate", str(plan_file), "--trace", str(trace), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    result = simulate(parse(plan_file.read_text(), file="p"), UnitCosts(), GLOO)
    assert f"iteration time: {result.iteration_time:.4g} units" in out
    for r in result.ranks:
        row = next(line for line in out.splitlines() if line.split()[:1] == [str(r.rank)])
        assert f"{r.bubble:.1%}" in row and f"{r.peak_memory.total:.4g} act" in row
    assert "critical path:" in out
    assert json.loads(trace.read_text())["otherData"]["tpc"]["schedule"] == "1f1b"
    assert png.stat().st_size > 10_000


def test_simulate_cli_refuses_a_plan_that_does_not_verify(plan_file, capsys):
    lines = plan_file.read_text().splitlines(keepends=True)
    first_send = next(i for i, line in enumerate(lines) if line.strip().startswith("send act"))
    del lines[first_send]
    plan_file.write_text("".join(lines))
    assert main(["simulate", str(plan_file)]) == 1
    err = capsys.readouterr().err
    assert f"{plan_file}:" in err and "error:" in err and "hint:" in err


def test_device_model_prices_a_compiled_plan_in_seconds(tmp_path, repo_root, capsys):
    plan = tmp_path / "gpt.tpir"
    model = repo_root / "tests" / "compiler" / "models" / "tiny_gpt.py"
    assert main(["compile", str(model), "-o", str(plan), "--stages", "2", "--seq-len", "16",
                 "--batch", "2", "--slices", "2", "-q"]) == 0
    capsys.readouterr()
    assert main(["simulate", str(plan), "--device-model", "v100"]) == 0
    out = capsys.readouterr().out
    assert "analytic v100" in out and "iteration time:" in out and " ms" in out


def test_a_profile_of_another_model_is_refused(plan_file, tmp_path, capsys):
    missing = tmp_path / "costs.msgpack"
    assert main(["simulate", str(plan_file), "--cost", str(missing)]) == 1
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_an_output_that_cannot_be_written_is_a_clear_error(plan_file, tmp_path, capsys):
    missing = tmp_path / "no" / "such" / "dir" / "t.png"
    assert main(["simulate", str(plan_file), "--png", str(missing)]) == 1
    err = capsys.readouterr().err
    assert f"--png: error: cannot write {missing}" in err and "hint:" in err


def test_gantt_draws_the_way_up_of_a_v_in_a_second_palette(tmp_path):
    from tests.compiler import make_header
    from tpc.compiler.lowering.lower import lower
    from tpc.compiler.schedules import build_schedule
    from tpc.compiler.schedules.placement import vshape
    from tpc.compiler.predict.timeline import COLOURS, UP_COLOURS, _chunk_of, box_colour
    from tpc.ir.show import direction_of

    h = make_header(4, mbs=4, schedule="zbv", stage_ranks=vshape(4, 2))
    result = simulate(lower(h, build_schedule("zbv", h)), UnitCosts(), GLOO)
    ways, chunk_of = direction_of(h), _chunk_of(h)
    colours = {(e.instr.op, e.instr.stage): box_colour(e.instr, chunk_of, ways)
               for e in result.events if e.instr.op in UP_COLOURS}
    assert colours[(Op.FORWARD, 0)] == COLOURS[Op.FORWARD] != colours[(Op.FORWARD, 3)] == UP_COLOURS[Op.FORWARD]
    assert colours[(Op.BACKWARD_WEIGHT, 2)] == UP_COLOURS[Op.BACKWARD_WEIGHT]
    assert set(UP_COLOURS.values()).isdisjoint(COLOURS.values())
    write_gantt(result, str(tmp_path / "v.png"))
    assert (tmp_path / "v.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gantt_draws_chimeras_up_pipeline_in_a_second_palette(tmp_path):
    """Chimera: the direction is the micro-batch's (its weight replica), not the stage's."""
    from tests.compiler import make_header
    from tpc.compiler.lowering.lower import lower
    from tpc.compiler.schedules import build_schedule, with_replicas
    from tpc.compiler.predict.timeline import COLOURS, UP_COLOURS, _chunk_of, box_colour
    from tpc.ir.show import direction_of, render_grid

    h = with_replicas(make_header(4, mbs=4, schedule="chimera"))
    plan = lower(h, build_schedule("chimera", h))
    result = simulate(plan, UnitCosts(), GLOO)
    ways, chunk_of = direction_of(h), _chunk_of(h)
    colours = {(e.instr.op, e.instr.mb): box_colour(e.instr, chunk_of, ways)
               for e in result.events if e.instr.op in (Op.FORWARD, Op.BACKWARD)}
    assert colours[(Op.FORWARD, 0)] == COLOURS[Op.FORWARD] and colours[(Op.FORWARD, 1)] == UP_COLOURS[Op.FORWARD]
    assert colours[(Op.BACKWARD, 2)] == COLOURS[Op.BACKWARD] and colours[(Op.BACKWARD, 3)] == UP_COLOURS[Op.BACKWARD]
    grid = render_grid(plan)
    assert "F0.0.0:dn" in grid and "F0.1.0:up" in grid and "Two pipelines run in opposite directions" in grid
    write_gantt(result, str(tmp_path / "chimera.png"))
    assert (tmp_path / "chimera.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
