"""`tpc compile --seq-len L1,L2,...`: a plan bundle whose plans share the longest length's mesh and
stage split while the optimiser chooses each length's slices, micro-batches and schedule; every
mistake in the options is refused before the model is traced."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.executors.real import model_file
from tpc.cli.main import main
from tpc.ir.verify.bundle import load_bundle


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """A bundle of the tiny GPT compiled with a cost model: everything 'auto' but the stages."""
    out = tmp_path_factory.mktemp("bundle") / "plans"
    assert main(["compile", model_file("gpt"), "-o", str(out), "--seq-len", "8,16,32", "--batch", "8",
                 "--stages", "2", "--microbatches", "auto", "--slices", "auto", "--schedule", "auto",
                 "--device-model", "h100", "--constant-tokens", "-q"]) == 0
    return out


def test_the_plans_share_the_split_the_index_records(searched):
    bundle = load_bundle(str(searched))
    assert bundle.lengths == (8, 16, 32)
    index = bundle.index
    for plan in bundle.plans:
        h = plan.header
        assert [(s.index, s.rank, s.units) for s in h.stages] == [(s.index, s.rank, s.units) for s in index.stages]
        assert (h.model, h.mesh, h.units, h.ties) == (index.model, index.mesh, index.units, index.ties)
    # --constant-tokens: batch x length is the longest plan's
    assert [p.header.shape.batch * p.header.shape.seq for p in bundle.plans] == [8 * 32] * 3
    assert [m.batch for m in index.members] == [32, 16, 8]


def test_verify_show_and_simulate_take_the_bundle(searched, capsys):
    assert main(["verify", str(searched)]) == 0
    out = capsys.readouterr().out
    assert f"{searched}: ok (a plan bundle of 3 lengths, 8, 16, 32; one stage split)" in out
    assert main(["show", str(searched / "index.tpir")]) == 0
    out = capsys.readouterr().out
    assert out.count("== ") == 3 and f"== {searched / 'seq16.tpir'}: seq 16, batch 16" in out
    assert main(["simulate", str(searched), "--unit"]) == 0
    out = capsys.readouterr().out
    table = out[out.index(f"{searched}: 3 plans, one stage split"):].splitlines()
    assert table[1].split()[:3] == ["seq", "batch", "schedule"]
    assert [row.split()[0] for row in table[2:5]] == ["8", "16", "32"]
    assert main(["simulate", str(searched), "--unit", "--png", "x.png"]) == 1
    assert "--png draws one plan" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag, message", [
    (["--seq-len", "16,8"], "--seq-len", "lengths must be distinct and increasing"),
    (["--seq-len", "8,x"], "--seq-len", "is not a length or a list of lengths"),
    (["--seq-len", "8,16", "--slices", "8,8"], "--slices", "--slices with lengths fits one sequence length"),
    (["--seq-len", "8,12,16", "--constant-tokens"], "--constant-tokens", "does not reshape into whole sequences of 12"),
    # a list with a length too short for the slices is the list's mistake (it was blamed on --slices)
    (["--seq-len", "4,16", "--slices", "8"], "--seq-len", "--seq-len 4,16: the length 4 is shorter than --slices 8"),
    (["--seq-len", "-4,16"], "--seq-len", "--seq-len -4,16: the length -4 is not a positive number of tokens"),
    (["--seq-len", "-4,16", "--slices", "2"], "--seq-len", "the length -4 is not a positive number of tokens"),
    (["--seq-len", "0,16"], "--seq-len", "the length 0 is not a positive number of tokens"),
    # lengths that fit no length of the list (they were checked against the longest alone)
    (["--seq-len", "8,16", "--slices", "2,2"], "--slices", "--slices with lengths fits one sequence length"),
])
def test_bad_options_are_refused_before_tracing(tmp_path, capsys, argv, flag, message):
    out = tmp_path / "plans"
    assert main(["compile", str(tmp_path / "no_such_model.py"), "-o", str(out), "--batch", "4", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{flag}: error: ") and message in err, err
    assert not out.exists()


def test_a_bundle_for_gloo_is_written_and_checked_under_gloo(tmp_path, capsys):
    """`--comm gloo` holds for every plan of a bundle: each is lowered, re-read and verified under
    gloo's rules (1F1B without exchanges is valid there and not under NCCL's), and `tpc verify
    --comm gloo` accepts the folder."""
    from tpc.ir.semantics import GLOO, NCCL
    from tpc.ir.verify import verify

    out = tmp_path / "plans"
    assert main(["compile", model_file("gpt"), "-o", str(out), "--seq-len", "16,32", "--batch", "4",
                 "--stages", "2", "--microbatches", "3", "--schedule", "1f1b", "--comm", "gloo",
                 "-q"]) == 0, capsys.readouterr().err
    bundle = load_bundle(str(out), comm=GLOO)
    assert bundle.lengths == (16, 32)
    assert all(verify(plan, NCCL) for plan in bundle.plans)  # the case in point: gloo's plans only
    assert main(["verify", str(out), "--comm", "gloo"]) == 0
    assert main(["verify", str(out), "--comm", "nccl"]) == 1
    assert "deadlock under NCCL's rules" in capsys.readouterr().err
