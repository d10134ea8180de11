"""The `random-ltd units ... min-value K0 max-value K1 require-steps N seq-per-step Q` header line
(format version 6) and rule H8: it round-trips, needs `tpir 6`, names distinct ascending middle
units and min-value <= max-value, and is refused with a tensor axis, packed documents and a split
backward; a plan of format version 5 still reads and verifies."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tpc.compiler.lowering.lower import lower
from tpc.compiler.schedules import build_schedule
from tpc.ir.diagnostics import TpirError
from tpc.ir.nodes import DocumentsLine, RandomLTDLine
from tpc.ir.parse import parse
from tpc.ir.printer import print_plan
from tpc.ir.verify import verify

GOLDEN = (Path(__file__).resolve().parents[1] / "compiler" / "golden" / "1f1b_k3_unequal_m3_dp2.tpir").read_text()
LINE = "random-ltd units 1 min-value 4 max-value 24 require-steps 10 seq-per-step 2"


def dropping(schedule: str = "1f1b", **fields):
    plan = parse(GOLDEN)
    line = RandomLTDLine(**{"units": (1,), "min_value": 4, "max_value": 24, "require_steps": 10,
                            "seq_per_step": 2, **fields})
    header = dataclasses.replace(plan.header, random_ltd=line, schedule=dataclasses.replace(
        plan.header.schedule, name=schedule))
    return lower(header, build_schedule(schedule, header))


def test_random_ltd_plan_round_trips_after_the_units_line():
    text = print_plan(dropping())
    lines = text.splitlines()
    assert lines[5] == "units 3" and lines[6] == LINE
    again = parse(text)
    assert again.header.random_ltd == RandomLTDLine(units=(1,), min_value=4, max_value=24, require_steps=10,
                                                    seq_per_step=2)
    assert print_plan(again) == text
    assert verify(again) == []
    # the line changes no instruction: the same program as without it
    assert [str(i) for r in again.ranks for i in r.instrs] == [str(i) for r in parse(GOLDEN).ranks for i in r.instrs]


def _messages(text: str) -> list[str]:
    return [d.message for d in verify(parse(text, file="p.tpir"))]


def test_rule_h8_refusals_are_located_at_the_line():
    text = print_plan(dropping())
    old = verify(parse(text.replace("tpir 6", "tpir 5", 1), file="p.tpir"))
    assert len(old) == 1 and "`random-ltd` needs format version 6" in old[0].message and old[0].loc.line == 7
    for units, says in (("0", "only the middle units 1..1"), ("2", "only the middle units 1..1"),
                        ("1 1", "not distinct and ascending")):
        [d] = verify(parse(text.replace("units 1 min", f"units {units} min", 1), file="p.tpir"))
        assert says in d.message and d.loc.line == 7, d.message
    [m] = _messages(text.replace("min-value 4 max-value 24", "min-value 30 max-value 24", 1))
    assert "min-value 30 is above max-value 24" in m
    with pytest.raises(TpirError, match="must be >= 1"):
        parse(text.replace("seq-per-step 2", "seq-per-step 0", 1), file="p.tpir")


def test_rule_h8_refuses_a_tensor_axis_documents_and_a_split_backward():
    plan = dropping()
    with_docs = dataclasses.replace(plan, header=dataclasses.replace(plan.header, documents=DocumentsLine(eos=3, mean=8)))
    assert any("random-ltd over packed documents" in d.message for d in verify(with_docs))
    tensor = dataclasses.replace(plan, header=dataclasses.replace(
        plan.header, mesh=dataclasses.replace(plan.header.mesh, tensor=2)))
    assert any("random-ltd on a mesh with a tensor axis" in d.message for d in verify(tensor))
    plain = parse(GOLDEN)
    header = dataclasses.replace(plain.header, schedule=dataclasses.replace(plain.header.schedule, name="zb-h1"))
    split = lower(header, build_schedule("zb-h1", header))  # lowered (and checked) without the line
    split = dataclasses.replace(split, header=dataclasses.replace(split.header, random_ltd=plan.header.random_ltd))
    assert any("in a plan with random-ltd: a split backward" in d.message for d in verify(split))


def test_a_version_5_plan_still_reads_and_verifies():
    text = GOLDEN.replace("tpir 6", "tpir 5", 1)
    plan = parse(text, file="old.tpir")
    assert plan.header.version == 5 and plan.header.random_ltd is None
    assert verify(plan) == [] and print_plan(plan) == text
