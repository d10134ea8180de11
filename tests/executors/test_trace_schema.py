"""The predicted trace (`tpc simulate --trace`) and the measured one (`tpc run --trace`) are one
format (compiler/predict/chrome_trace.py): the same events with the same keys, pid the rank,
times in microseconds; and the comparison reads what the executors write."""

from __future__ import annotations

import json

import pytest

from tests.compiler.simulate.plans import make_plan
from tpc.compiler.costmodel.unit import UnitCosts
from tpc.compiler.predict.chrome_trace import read_trace, write_trace_file
from tpc.compiler.predict.simulate import simulate
from tpc.compiler.predict.timeline import compare, predicted_trace
from tpc.executors.engine import TraceEvent, measured_trace


@pytest.fixture(scope="module")
def both():
    """A prediction under unit costs (one unit written as 1 ms) and a 'measurement' that took
    exactly the predicted times, in seconds, as the engine records them."""
    result = simulate(make_plan("1f1b", 3, 4, 2), UnitCosts(p2p=0.25))
    events = [TraceEvent(e.rank, e.line, str(e.instr), 0, e.start * 1e-3, e.end * 1e-3)
              for e in result.events]
    return result, predicted_trace(result, "plan.tpir"), measured_trace(events)


def _by_phase(trace, ph):
    return [e for e in trace["traceEvents"] if e["ph"] == ph]


def test_the_same_events_with_the_same_keys(both):
    _, predicted, measured = both
    assert predicted.keys() == measured.keys()
    assert predicted["displayTimeUnit"] == measured["displayTimeUnit"] == "ms"
    assert predicted["otherData"]["tpc"].keys() == measured["otherData"]["tpc"].keys()
    assert (predicted["otherData"]["tpc"]["source"], measured["otherData"]["tpc"]["source"]) == ("simulate", "run")
    for ph in ("M", "X"):
        p, m = _by_phase(predicted, ph), _by_phase(measured, ph)
        assert len(p) == len(m) > 0
        assert {tuple(sorted(e)) for e in p} == {tuple(sorted(e)) for e in m}
        assert {tuple(sorted(e["args"])) for e in p} == {tuple(sorted(e["args"])) for e in m}
    # the metadata events are equal: one named, ordered process per rank
    assert _by_phase(predicted, "M") == _by_phase(measured, "M")


def test_pid_is_the_rank_and_times_are_microseconds(both):
    result, predicted, measured = both
    for trace in (predicted, measured):
        xs = _by_phase(trace, "X")
        assert all(x["pid"] == x["args"]["rank"] and x["tid"] == 0 for x in xs)
        assert all(x["name"] == x["args"]["instr"] and x["cat"] == x["name"].split()[0] for x in xs)
        assert {x["pid"] for x in xs} == {p.rank for p in result.plan.ranks}
    for p, m in zip(_by_phase(predicted, "X"), _by_phase(measured, "X")):
        assert (p["args"]["instr"], p["args"]["line"]) == (m["args"]["instr"], m["args"]["line"])
        assert m["ts"] == pytest.approx(p["ts"], abs=1e-3) and m["dur"] == pytest.approx(p["dur"], abs=1e-3)


def test_both_files_open_as_json_and_read_back_alike(both, tmp_path):
    result, predicted, measured = both
    read = {}
    for name, trace in (("predicted", predicted), ("measured", measured)):
        path = tmp_path / f"{name}.json"
        write_trace_file(path, trace)
        assert json.loads(path.read_text(encoding="utf-8")) == trace
        read[name] = read_trace(str(path))
    assert [(t.rank, t.instr, t.step, t.line) for t in read["predicted"]] == \
        [(t.rank, t.instr, t.step, t.line) for t in read["measured"]]
    assert all(t.index is None for t in read["measured"])
    # the comparison reads the measured file as it reads the predicted one
    rows = compare(result, read["measured"]).rows
    assert [r.what for r in rows] == ["iteration time"] + [f"rank {r.rank} compute" for r in result.ranks]
    assert [r.measured for r in rows] == pytest.approx([r.measured for r in compare(result, read["predicted"]).rows])
