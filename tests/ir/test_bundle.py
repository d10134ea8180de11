"""Plan bundles (format version 2): the index round-trips byte for byte, is told apart from a
plan in both directions, needs `tpir 2` (rule H1), and rules B1-B4 refuse a bundle whose plans
disagree with its index, each error located in its own file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tpc.cli.main import main
from tpc.ir.diagnostics import TpirError
from tpc.ir.nodes import Bundle, BundleMember
from tpc.ir.parse import parse, parse_bundle, parse_document
from tpc.ir.printer import print_bundle, print_document
from tpc.ir.verify.bundle import is_bundle, load_bundle

GOLDEN = Path(__file__).parent / "golden" / "bundle"
INDEX = GOLDEN / "index.tpir"


def _diags(call):
    with pytest.raises(TpirError) as info:
        call()
    return info.value.diagnostics


def test_the_index_reprints_byte_for_byte_and_reads_back_equal():
    text = INDEX.read_text()
    bundle = parse_bundle(text, file=str(INDEX))
    assert isinstance(bundle, Bundle) and print_bundle(bundle) == text and print_document(bundle) == text
    assert parse_bundle(print_bundle(bundle)) == bundle
    assert bundle.lengths == (32, 64) and bundle.members[0] == BundleMember(path="seq32.tpir", seq=32, batch=4)
    assert bundle.members[0].note == "slices 0:20 20:32" and bundle.trailing_comments == ("the plans are in this folder",)
    assert isinstance(parse_document((GOLDEN / "seq32.tpir").read_text()), type(parse((GOLDEN / "seq32.tpir").read_text())))
    assert is_bundle(str(GOLDEN)) and is_bundle(str(INDEX)) and not is_bundle(str(GOLDEN / "seq32.tpir"))


def test_a_plan_and_an_index_are_not_taken_for_each_other():
    (d,) = _diags(lambda: parse(INDEX.read_text(), file="i.tpir"))
    assert (str(d.loc), d.message) == ("i.tpir:2:1", "this is a plan bundle's index (its second line is `bundle`), not a plan")
    (d,) = _diags(lambda: parse_bundle((GOLDEN / "seq32.tpir").read_text(), file="p.tpir"))
    assert (str(d.loc), d.message) == ("p.tpir:2:1", "this is a plan, not a plan bundle's index")


def test_lines_that_belong_to_the_other_kind_of_file_are_refused_where_they_are():
    text = INDEX.read_text()
    shaped = text.replace("mesh pipe", "shape batch 4 seq 64 vocab 256 dtype float32\nmesh pipe")
    (d,) = _diags(lambda: parse_bundle(shaped, file="i.tpir"))
    assert (str(d.loc), d.message) == ("i.tpir:5:1", "a plan bundle's index has no 'shape' line")
    ranked = text + "\nrank 0\n  step\n"
    (d,) = _diags(lambda: parse_bundle(ranked, file="i.tpir"))
    assert d.message == "a plan bundle's index has no rank sections" and d.loc.line == 14
    plan = (GOLDEN / "seq32.tpir").read_text().replace("microbatch 0", 'plan "x.tpir" seq 8 batch 4\nmicrobatch 0')
    (d,) = _diags(lambda: parse(plan, file="p.tpir"))
    assert (str(d.loc), d.message) == ("p.tpir:11:1", "a 'plan' line belongs to a plan bundle's index, not to a plan")
    late = text.replace("bundle\n", "").replace("units 6\n", "units 6\nbundle\n")
    diags = _diags(lambda: parse_bundle(late, file="i.tpir"))
    assert any(d.loc.line == 6 and d.message.startswith("'bundle' line out of order") for d in diags), diags


def _copy(tmp_path: Path) -> Path:
    out = tmp_path / "bundle"
    shutil.copytree(GOLDEN, out)
    return out


def test_a_version_1_index_is_refused_by_rule_h1(tmp_path):
    b = _copy(tmp_path)
    index = b / "index.tpir"
    index.write_text(index.read_text().replace("tpir 2", "tpir 1"))
    (d,) = _diags(lambda: load_bundle(str(b)))
    assert (str(d.loc), d.message) == (f"{index}:3:1", "a plan bundle's index needs format version 2, and this plan says `tpir 1`")


def test_plans_listed_out_of_order_or_missing_are_refused_at_the_index(tmp_path):
    b = _copy(tmp_path)
    index = b / "index.tpir"
    text = index.read_text()
    index.write_text(text.replace('plan "seq32.tpir" seq 32 batch 4  # slices 0:20 20:32\nplan "seq64.tpir" seq 64 batch 4',
                                  'plan "seq64.tpir" seq 64 batch 4\nplan "seq32.tpir" seq 32 batch 4'))
    (d,) = _diags(lambda: load_bundle(str(b)))
    assert (str(d.loc), d.message) == (f"{index}:11:1", "a plan of length 32 listed after one of length 64 (line 10)")
    index.write_text(text.replace("seq64.tpir", "seq128.tpir"))
    (d,) = _diags(lambda: load_bundle(str(b)))
    assert d.loc.line == 11 and d.message.startswith("the plan file 'seq128.tpir' does not exist")


@pytest.mark.parametrize("old, new, line, message", [
    ('sha256 "6b8', 'sha256 "7b8', 3, "this plan's model (examples/gpt.py, sha256 7b86b273ff34..., factory model) is "
                                    "not the bundle's (examples/gpt.py, sha256 6b86b273ff34..., factory model) (the index's line 4)"),
    ("units 0:3", "units 0:2", 8, "this plan's stage split (stage 0 rank 0 units 0:2, stage 1 rank 1 units 2:6) is not the "
                                  "bundle's (stage 0 rank 0 units 0:3, stage 1 rank 1 units 3:6) (the index's line 7)"),
    ("shape batch 4", "shape batch 8", 4, "this plan is of length 32 and batch 8, its plan line says seq 32 batch 4"),
])
def test_a_plan_that_disagrees_with_the_index_is_refused_in_its_own_file(tmp_path, old, new, line, message):
    b = _copy(tmp_path)
    member = b / "seq32.tpir"
    text = member.read_text().replace(old, new, 1)
    if old == "units 0:3":
        text = text.replace("units 3:6", "units 2:6", 1)
    if old == "shape batch 4":
        text = text.replace("microbatch 0 size 4", "microbatch 0 size 8", 1)
    member.write_text(text)
    (d,) = _diags(lambda: load_bundle(str(b)))
    assert (str(d.loc), d.message) == (f"{member}:{line}:1", f"{message}; this plan is listed at {b / 'index.tpir'}:10:1")


def test_a_broken_plan_is_reported_with_the_plan_rules(tmp_path, capsys):
    b = _copy(tmp_path)
    member = b / "seq64.tpir"
    member.write_text(member.read_text().replace("  step\n", "", 1))
    assert main(["verify", str(b)]) == 1
    err = capsys.readouterr().err
    assert f"{member}:" in err and "step" in err
