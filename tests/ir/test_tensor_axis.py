"""The mesh's tensor axis in the format (version 4: `mesh pipe P data D tensor T`): parsed,
printed, checked by rules T1-T2, and simulated (docs/ir.md, "The tensor axis"; the executors
run it: tests/executors/test_tensor_parallel.py)."""

from __future__ import annotations

from pathlib import Path

from tpc.ir.parse import parse
from tpc.ir.printer import print_plan
from tpc.ir.verify import verify

GOLDEN = (Path(__file__).resolve().parents[1] / "compiler" / "golden" / "seq1f1b_k2_s3_m2.tpir").read_text()


def with_mesh(mesh: str, version: int = 4) -> str:
    head, rest = GOLDEN.split("\n", 1)
    assert head == "tpir 6"
    return f"tpir {version}\n" + rest.replace("mesh pipe 2 data 1\n", mesh + "\n")


def test_a_tensor_axis_is_read_printed_and_verified():
    plan = parse(with_mesh("mesh pipe 2 data 1 tensor 2"), file="p.tpir")
    assert plan.header.mesh.tensor == 2
    assert plan.header.mesh.value.size == 4
    assert verify(plan) == []
    text = print_plan(plan)
    assert "\nmesh pipe 2 data 1 tensor 2\n" in text
    assert parse(text).header.mesh == plan.header.mesh


def test_tensor_1_is_no_tensor_axis_and_older_plans_read_as_before():
    one = parse(with_mesh("mesh pipe 2 data 1 tensor 1", version=3), file="p.tpir")
    assert one.header.mesh.tensor == 1 and verify(one) == []
    assert "tensor" not in print_plan(one)
    old = parse(with_mesh("mesh pipe 2 data 1", version=3), file="p.tpir")
    assert old.header.version == 3 and verify(old) == [] and print_plan(old).startswith("tpir 3\n")


def test_t1_a_tensor_axis_needs_version_4():
    (d,) = verify(parse(with_mesh("mesh pipe 2 data 1 tensor 2", version=3), file="p.tpir"))
    assert d.message == "`tensor 2` needs format version 4, and this plan says `tpir 3`"
    assert d.loc.line == 4 and "tpir 4" in d.hint


def test_t2_the_tensor_degree_divides_the_vocabulary():
    (d,) = verify(parse(with_mesh("mesh pipe 2 data 1 tensor 3"), file="p.tpir"))
    assert "tensor 3 does not divide the vocabulary of 16" in d.message and d.loc.line == 4
    assert "divides 16" in d.hint


def test_sequence_parallel_is_read_printed_and_verified():
    plan = parse(with_mesh("mesh pipe 2 data 1 tensor 2 sequence-parallel", version=5), file="p.tpir")
    assert plan.header.mesh.sequence and plan.header.mesh.tensor == 2 and verify(plan) == []
    text = print_plan(plan)
    assert "\nmesh pipe 2 data 1 tensor 2 sequence-parallel\n" in text
    assert parse(text).header.mesh == plan.header.mesh
    assert not parse(with_mesh("mesh pipe 2 data 1 tensor 2"), file="p.tpir").header.mesh.sequence


def test_t3_sequence_parallel_needs_version_5_and_a_tensor_axis():
    (d,) = verify(parse(with_mesh("mesh pipe 2 data 1 tensor 2 sequence-parallel", version=4), file="p.tpir"))
    assert d.message == "`sequence-parallel` needs format version 5, and this plan says `tpir 4`" and d.loc.line == 4
    (d,) = verify(parse(with_mesh("mesh pipe 2 data 1 tensor 1 sequence-parallel", version=5), file="p.tpir"))
    assert "this mesh has none (tensor 1)" in d.message and d.loc.line == 4
    assert "tensor 2 sequence-parallel" in d.hint


def test_t4_every_slice_splits_evenly_over_the_tensor_ranks():
    text = with_mesh("mesh pipe 2 data 1 tensor 2 sequence-parallel", version=5)
    text = text.replace("microbatch 1 size 2 slices 0:8 8:16 16:24", "microbatch 1 size 2 slices 0:9 9:16 16:24")
    (d,) = [d for d in verify(parse(text, file="p.tpir")) if "sequence-parallel" in d.message]
    assert d.message == ("micro-batch 1's slice 0:9 has 9 tokens, which the 2 tensor ranks of `sequence-parallel` "
                         "cannot split evenly")
    assert d.loc.line == 11 and "multiples of 2" in d.hint


def test_the_simulator_runs_a_tensor_axis(tmp_path, capsys):
    """The tensor ranks of a stage run the same stream: under unit costs the timeline is the
    plan's without the axis; a cost model prices the split (tests/compiler/test_tensor_compile.py)."""
    from tpc.cli.main import main

    reports = []
    for mesh in ("mesh pipe 2 data 1", "mesh pipe 2 data 1 tensor 2"):
        path = tmp_path / "plan.tpir"
        path.write_text(with_mesh(mesh))
        assert main(["simulate", str(path), "--unit"]) == 0
        reports.append(capsys.readouterr().out)
    assert reports[0] == reports[1] and "iteration time" in reports[0]
