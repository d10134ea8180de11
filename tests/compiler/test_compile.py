"""`tpc compile`: option checks, --slices parsing, and end to end on a tiny GPT."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tpc.cli.compile import check_options
from tpc.compiler.compile import compile_plan, compile_to_file
from tpc.compiler.header import microbatch_sizes
from tpc.compiler.optimise.slicing import equal_slices, ranges_of
from tpc.ir.diagnostics import TpirError

TINY = str(Path(__file__).parent / "models" / "tiny_gpt.py")
BASE = dict(stages="2", microbatches=2, seq_len=16, batch=4, slices="1", schedule="seq1f1b", dp=1, ranks=None)


def _err(fn, *args, **kw) -> str:
    with pytest.raises(TpirError) as e:
        fn(*args, **kw)
    text = e.value.render()
    assert "hint:" in text, text
    return text


# ------------------------------------------------------------------------------ --slices


def cuts(spec, seq_len: int):
    """`--slices SPEC` as the header's ranges, read and checked as `tpc compile` reads it."""
    return check_options(stages="1", microbatches=1, seq_len=seq_len, batch=1, slices=spec).cuts


def test_equal_slices_spread_the_remainder_over_the_first():
    assert cuts("3", 10) == ((0, 4), (4, 7), (7, 10)) == equal_slices(3, 10)
    assert cuts("1", 10) == ((0, 10),)
    assert cuts("10", 10) == tuple((i, i + 1) for i in range(10))


def test_explicit_lengths():
    assert cuts("6, 3,1", 10) == ((0, 6), (6, 9), (9, 10)) == ranges_of((6, 3, 1))
    for spec in ("auto", "AUTO"):
        assert check_options(stages="1", microbatches=1, seq_len=10, batch=1, slices=spec).slices_auto


@pytest.mark.parametrize(
    "spec, words",
    [
        ("6,3", "sum to 9, not to the sequence length 10"),
        ("0", "0 slices cannot cut a sequence of 10 tokens"),
        ("11", "11 slices cannot cut"),
        ("5,0,5", "slice length 0"),
        ("5,-1,6", "slice length -1"),
        ("five", "'five'"),
        ("5,,5", "empty slice length"),
        ("", "empty slice length"),
        ("2.5", "'2.5'"),
    ],
)
def test_bad_slices_say_what_and_how(spec, words):
    text = _err(cuts, spec, 10)
    assert words in text
    assert "--slices" in text


# ----------------------------------------------------------------------- option checks


def test_microbatch_sizes_are_as_even_as_possible():
    assert microbatch_sizes(7, 3) == [3, 2, 2]
    assert microbatch_sizes(4, 4) == [1, 1, 1, 1]


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(batch=5, dp=2), "does not split evenly over 2 data-parallel replicas"),
        (dict(microbatches=5), "5 micro-batches but each replica has only 4"),
        (dict(batch=4, dp=2, microbatches=3), "3 micro-batches but each replica has only 2"),
        (dict(stages="auto"), "--stages auto compares pipeline depths by their predicted step time, which needs a cost model"),
        (dict(stages="two"), "--stages 'two' is not a number"),
        (dict(stages="0"), "--stages must be a positive whole number"),
        (dict(schedule="auto"), "--schedule auto compares schedules by their simulated step time, which needs a cost model"),
        (dict(schedule="zigzag"), "unknown schedule 'zigzag'"),
        (dict(ranks=3), "--ranks 3 does not match --stages 2 x --dp 1 = 2"),
        (dict(seq_len=0), "--seq-len must be a positive whole number"),
        (dict(slices="7,7"), "sum to 14, not to the sequence length 16"),
    ],
)
def test_bad_options_are_refused_before_tracing(change, words):
    text = _err(check_options, **{**BASE, **change})
    assert words in text


def test_auto_slices_fall_back_to_eight_equal_slices():
    opts = check_options(**{**BASE, "slices": "auto", "seq_len": 20})
    assert opts.slices_auto and [hi - lo for lo, hi in opts.cuts] == [3, 3, 3, 3, 2, 2, 2, 2]


def test_options_mistakes_surface_from_compile_without_loading_the_model(tmp_path):
    # the model path does not exist: the option error must come first, not the file error
    text = _err(lambda: compile_plan(str(tmp_path / "missing.py"), check_options(**{**BASE, "slices": "3,3"})))
    assert "sum to 6" in text


# -------------------------------------------------------------------------- end to end


def test_compile_tiny_gpt_to_file_and_verify(tmp_path, capsys):
    from tpc.compiler.frontend import file_sha256
    from tpc.ir.parse import parse
    from tpc.ir.printer import print_plan
    from tpc.ir.verify import verify_file

    out = tmp_path / "plan.tpir"
    plan = compile_to_file(TINY, str(out), check_options(stages="2", microbatches=2, seq_len=16, batch=4, slices="3", dp=2))
    text = out.read_text()
    assert text == print_plan(plan) and verify_file(str(out)) == plan == parse(text)
    h = plan.header
    assert (h.model.path, h.model.sha256, h.model.factory) == (TINY, file_sha256(TINY), "model")
    assert (h.shape.batch, h.shape.seq, h.shape.vocab, h.shape.dtype) == (4, 16, 64, "float32")
    assert (h.mesh.pipe, h.mesh.data, h.schedule.name) == (2, 2, "seq1f1b")
    assert [m.size for m in h.microbatches] == [1, 1]
    assert all(m.slices == ((0, 6), (6, 11), (11, 16)) for m in h.microbatches)
    assert [s.rank for s in h.stages] == [0, 1]
    assert h.stages[0].units[0] == 0 and h.stages[-1].units[1] == h.units.count
    assert h.stages[0].units[1] == h.stages[1].units[0]
    assert " .. " in h.stages[0].label
    captured = capsys.readouterr()
    assert f"wrote {out}" in captured.out
    for step in ("trace", "partition", "schedule", "lower", "verify"):
        assert step in captured.err
    assert [p.name for p in tmp_path.iterdir()] == ["plan.tpir"]  # no temporary left behind


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "terapipe"])
def test_compile_each_schedule(schedule):
    plan = compile_plan(TINY, check_options(stages="2", microbatches=2, seq_len=8, batch=2, slices="5,3",
                        schedule=schedule, quiet=True))  # fmt: skip
    assert plan.header.schedule.name == schedule
    assert plan.header.microbatches[0].slices == ((0, 5), (5, 8))


def test_cli_compile_then_verify(tmp_path, capsys):
    from tpc.cli.main import main

    out = tmp_path / "plan.tpir"
    argv = ["compile", TINY, "-o", str(out), "--stages", "2", "--microbatches", "2",
            "--seq-len", "16", "--batch", "4", "--slices", "2", "-q"]  # fmt: skip
    assert main(argv) == 0
    assert capsys.readouterr().out == ""  # quiet
    assert main(["verify", str(out)]) == 0
    assert "ok" in capsys.readouterr().out


def test_cli_bad_slices_is_a_clear_error(tmp_path, capsys):
    from tpc.cli.main import main

    out = tmp_path / "plan.tpir"
    argv = ["compile", TINY, "-o", str(out), "--stages", "2", "--seq-len", "16", "--batch", "4",
            "--slices", "8,4"]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "sum to 12, not to the sequence length 16" in err and "hint:" in err
    assert "Traceback" not in err
    assert not out.exists()


def test_a_failed_compile_leaves_an_existing_plan_untouched(tmp_path):
    out = tmp_path / "plan.tpir"
    out.write_text("previous plan\n")
    with pytest.raises(TpirError):
        compile_to_file(TINY, str(out), check_options(stages="9", microbatches=1, seq_len=8, batch=1, quiet=True))
    assert out.read_text() == "previous plan\n"
    assert os.listdir(tmp_path) == ["plan.tpir"]


def test_compiled_plan_trains_like_plain_autograd(tmp_path, capsys):
    """The oracle: the compiled seq1f1b plan (unequal slices, 2 replicas, a tied embedding)
    run by the reference interpreter gives plain autograd's loss and gradients."""
    from tpc.cli.main import main

    out = tmp_path / "plan.tpir"
    argv = ["compile", TINY, "-o", str(out), "--stages", "2", "--microbatches", "2",
            "--seq-len", "16", "--batch", "4", "--slices", "5,3,8", "--dp", "2", "-q"]  # fmt: skip
    assert main(argv) == 0
    from tpc.ir.parse import parse

    assert [t.name for t in parse(out.read_text()).header.ties] == ["transformer.wte.weight"]
    assert main(["run", "--interpret", str(out), "--verify-grads", "-q"]) == 0
    assert "tolerance 1e-05: ok" in capsys.readouterr().out


def test_auto_slices_without_a_cost_model_says_it_falls_back(capsys):
    plan = compile_plan(TINY, check_options(stages="2", microbatches=1, seq_len=16, batch=2, slices="auto"))
    assert plan.header.microbatches[0].slices == tuple((2 * i, 2 * i + 2) for i in range(8))
    assert "--slices auto: 8 equal slices of ~2 tokens" in capsys.readouterr().err


def test_auto_slices_take_the_optimisers_choice(capsys):
    """With --device-model, --slices auto uses what `optimise` chooses under the device model
    of the tiny GPT's traced graph (2 layers, width 32, 2 heads, vocabulary 64)."""
    from tpc.compiler.costmodel.resolve import load_cost_model
    from tpc.compiler.frontend import SlicedModel, load_model
    from tpc.compiler.optimise.slice_optimiser import optimise

    plan = compile_plan(TINY, check_options(stages="2", microbatches=2, seq_len=64, batch=4, slices="auto",
                        device_model="h100", explain=True))  # fmt: skip
    h = plan.header
    sliced = SlicedModel.from_model(load_model(TINY, "model"), seq_len=64, vocab=64)
    units = [s.units for s in h.stages]
    costs = load_cost_model(device_model="h100", sliced=sliced, stage_units=units)
    want = optimise(costs, 2, 64, 4, microbatches=2)
    assert tuple(m.size for m in h.microbatches) == want.mb_sizes
    assert tuple(m.slices for m in h.microbatches) == want.slices
    err = capsys.readouterr().err
    assert "optimise" in err and "optimiser: 2 stages, sequence 64" in err


def test_compile_lowers_and_verifies_for_the_backend_it_targets(tmp_path, capsys):
    """`tpc compile` targets NCCL unless told `--comm gloo`: the NCCL plan pairs 1F1B's
    steady-state sends and receives into exchanges and passes NCCL's rules; the gloo plan has
    none, passes gloo's rules, and is refused under NCCL's by `tpc verify` and by
    `tpc run --comm nccl`, at both ranks' lines."""
    from tpc.cli.main import main
    from tpc.ir.parse import parse
    from tpc.ir.verify import verify

    common = ["--stages", "2", "--microbatches", "3", "--seq-len", "8", "--batch", "3",
              "--schedule", "1f1b", "-q"]
    nccl, gloo = tmp_path / "nccl.tpir", tmp_path / "gloo.tpir"
    assert main(["compile", TINY, "-o", str(nccl), *common]) == 0
    assert main(["compile", TINY, "-o", str(gloo), *common, "--comm", "gloo"]) == 0
    text = {p: p.read_text() for p in (nccl, gloo)}
    assert "exchange 2" in text[nccl] and "exchange" not in text[gloo]
    assert verify(parse(text[nccl]), "nccl") == [] and verify(parse(text[gloo]), "gloo") == []
    assert main(["verify", str(nccl)]) == 0
    assert main(["verify", "--comm", "gloo", str(gloo)]) == 0
    capsys.readouterr()
    located = re.compile(rf"{re.escape(str(gloo))}:(\d+):3: error: deadlock under NCCL's rules: rank (\d)")
    assert main(["verify", str(gloo)]) == 1
    said = located.findall(capsys.readouterr().err)
    assert sorted(r for _, r in said) == ["0", "1"], said
    assert main(["run", "--interpret", "--comm", "nccl", str(gloo)]) == 1
    assert located.findall(capsys.readouterr().err) == said  # refused before any rank runs
    assert main(["run", "--interpret", "--comm", "nccl", str(nccl), "--verify-grads", "-q"]) == 0


def test_a_length_the_model_cannot_run_is_refused_at_the_models_line(tmp_path, capsys):
    """examples/gpt.py has a position table of block_size 256: at --seq-len 512 its embedding
    lookup fails. The compile is refused at the model's own line (file:line:col, the line shown),
    saying the length, not with a traceback from inside torch."""
    from tpc.cli.main import main

    example = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"
    out = tmp_path / "long.tpir"
    assert main(["compile", str(example), "-o", str(out), "--stages", "2", "--seq-len", "512",
                 "--batch", "2", "--slices", "2", "-q"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "the model does not run at the plan's length of 512 tokens: IndexError" in err
    line = next(i for i, text in enumerate(example.read_text().splitlines(), 1) if "self.transformer.wpe(pos)" in text)
    assert f"{example}:{line}:9: error:" in err, err
    assert "--seq-len" in err and not out.exists()
