"""The `documents eos ID mean M` header line (format version 6) and rule H7: it round-trips,
needs `tpir 6`, names a separator inside the vocabulary and a mean within the row; every rank
that runs a stage of a micro-batch loads it (its boundaries), and lowering puts those loads."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tpc.compiler.lowering.lower import lower
from tpc.compiler.schedules import build_schedule
from tpc.ir.nodes import DocumentsLine, Op
from tpc.ir.parse import parse
from tpc.ir.printer import print_plan
from tpc.ir.verify import verify

GOLDEN = (Path(__file__).resolve().parents[1] / "compiler" / "golden" / "1f1b_k3_unequal_m3_dp2.tpir").read_text()


def packed(eos: int = 3, mean: int = 8):
    plan = parse(GOLDEN)
    header = dataclasses.replace(plan.header, documents=DocumentsLine(eos=eos, mean=mean))
    return lower(header, build_schedule("1f1b", header))


def test_documents_plan_round_trips_and_every_stage_loads():
    plan = packed()
    text = print_plan(plan)
    assert text.splitlines()[3] == "documents eos 3 mean 8"
    assert print_plan(parse(text)) == text
    assert verify(parse(text)) == []
    middle = plan.ranks[1].instrs
    assert [i.mb for i in middle if i.op is Op.LOAD] == [0, 1, 2]
    first = next(k for k, i in enumerate(middle) if i.op is Op.FORWARD and i.mb == 0)
    assert any(i.op is Op.LOAD and i.mb == 0 for i in middle[:first])
    # without documents the middle rank loads nothing
    assert not any(i.op is Op.LOAD for i in parse(GOLDEN).ranks[1].instrs)


def test_a_middle_stage_without_its_load_is_refused():
    text = print_plan(packed())
    lines = text.splitlines()
    rank1 = lines.index("rank 1")
    drop = next(k for k in range(rank1, len(lines)) if lines[k].strip() == "load mb 1")
    bad = "\n".join(lines[:drop] + lines[drop + 1:]) + "\n"
    msgs = [d.message for d in verify(parse(bad, file="p.tpir"))]
    assert any("rank 1 never loads micro-batch 1" in m for m in msgs), msgs


def test_documents_need_version_6_a_separator_in_the_vocabulary_and_a_mean_within_the_row():
    text = print_plan(packed())
    old = parse(text.replace("tpir 6", "tpir 5", 1), file="p.tpir")
    [d] = verify(old)
    assert "`documents` needs format version 6" in d.message and d.loc.line == 4
    [d] = verify(parse(text.replace("documents eos 3", "documents eos 16", 1), file="p.tpir"))
    assert "separator id 16 is outside the vocabulary of 16" in d.message and d.loc.line == 4
    [d] = verify(parse(text.replace("mean 8", "mean 25", 1), file="p.tpir"))
    assert "longer than the row of 24" in d.message


def test_a_plan_without_documents_reads_as_before():
    plan = parse(GOLDEN)
    assert plan.header.documents is None and print_plan(plan) == GOLDEN
