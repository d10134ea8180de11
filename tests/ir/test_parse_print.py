"""Parser and printer: golden files round-trip byte for byte; comments land where docs/ir.md
says; bad input gives located diagnostics with hints, never another exception."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tests.ir.plans import simple_plan
from tpc.grammar import grammar_text
from tpc.ir.diagnostics import TpirError
from tpc.ir.nodes import Instr, Op, Payload, Plan
from tpc.ir.parse import parse
from tpc.ir.printer import print_plan

GOLDEN = Path(__file__).parent / "golden"
GOLDEN_FILES = sorted(GOLDEN.glob("*.tpir"))
DOCS_EXAMPLE = (Path(__file__).parents[2] / "docs" / "ir.md").read_text().split("```\n")[1]


def _golden(name: str) -> str:
    return (GOLDEN / name).read_text(encoding="utf-8")


def _error(text: str):
    """The one diagnostic parse raises for `text`."""
    with pytest.raises(TpirError) as info:
        parse(text, file="bad.tpir")
    (diag,) = info.value.diagnostics
    return diag


# ------------------------------------------------------------------------------ golden files


def test_there_are_golden_files_covering_every_op_and_flag():
    assert len(GOLDEN_FILES) >= 4
    plans = [parse(p.read_text(), file=str(p)) for p in GOLDEN_FILES]
    programs = plans + [plan.evaluation() for plan in plans if plan.eval is not None]
    ops = {i.op for plan in programs for r in plan.ranks for i in r.instrs}
    assert ops == set(Op)
    assert any(i.checkpoint for plan in plans for r in plan.ranks for i in r.instrs)
    assert {i.payload for plan in plans for r in plan.ranks for i in r.instrs} >= set(Payload)
    assert any(plan.header.mesh.data > 1 for plan in plans)
    assert any(plan.header.ties for plan in plans)
    assert any(len(set(m.lengths)) > 1 for plan in plans for m in plan.header.microbatches)
    assert any(len(plan.header.stages_of_rank(r.rank)) > 1 for plan in plans for r in plan.ranks)


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=lambda p: p.name)
def test_golden_file_reprints_byte_for_byte(path):
    text = path.read_text(encoding="utf-8")
    plan = parse(text, file=str(path))
    assert print_plan(plan) == text
    assert parse(print_plan(plan)) == plan
    assert plan.source == str(path)


def test_docs_example_is_a_golden_file():
    assert DOCS_EXAMPLE == _golden("terapipe_two_stages.tpir")


def test_grammar_ships_as_package_data():
    text = grammar_text()
    assert "rank_section" in text and "%ignore COMMENT" in text


# ------------------------------------------------------------------------- what parse builds


def test_fields_and_locations():
    plan = parse(DOCS_EXAMPLE, file="ex.tpir")
    h = plan.header
    assert h.version == 2 and h.version_loc.line == 2
    assert (h.model.path, h.model.factory) == ("examples/gpt.py", "model")
    assert (h.shape.batch, h.shape.seq, h.shape.vocab, h.shape.dtype) == (4, 64, 256, "float32")
    assert (h.mesh.pipe, h.mesh.data) == (2, 1)
    assert h.stages[1].units == (3, 6) and h.stages[1].label == "transformer.h.1 .. lm_head"
    assert h.ties[0].name == "transformer.wte.weight" and h.ties[0].stages == (0, 1)
    assert h.microbatches[0].slices == ((0, 40), (40, 64))
    r0 = plan.ranks[0]
    assert r0.rank == 0 and str(r0.loc) == "ex.tpir:13:1"
    send = r0.instrs[2]
    assert send == Instr(Op.SEND, stage=0, mb=0, slice=0, payload=Payload.ACT, peer=1)
    assert str(send.loc) == "ex.tpir:16:3"
    assert r0.instrs[-2] == Instr(Op.REDUCE_TIED, tie="transformer.wte.weight")
    assert plan.ranks[1].instrs[-1].op is Op.STEP


def test_comments_attach_to_the_line_below_or_their_own_line():
    plan = parse(_golden("two_stages_one_rank_tied.tpir"))
    h = plan.header
    assert h.version_comments == (
        "Three stages on two ranks: rank 0 holds stages 0 and 1, which pass activations locally.",
        "",
        "(an empty comment line above is written as a bare hash)",
    )
    assert h.version_note == "the format version"
    assert h.model.comments == ("what the plan was compiled from",)
    assert h.shape.note == "global batch"
    assert h.ties[0].comments == ("the embedding and the output head share one matrix",)
    assert plan.ranks[0].comments == ("the first two stages",)
    assert plan.ranks[0].note == "stages 0 and 1"
    assert plan.ranks[0].instrs[17].comments[0].startswith("backward in reverse token order")
    assert plan.ranks[0].instrs[-2].note == "waits for rank 1"
    assert plan.trailing_comments == (
        "end of the plan", "", "(comments after the last instruction stay at the end)")


def test_string_escapes():
    plan = parse(_golden("two_stages_one_rank_tied.tpir"))
    assert plan.header.model.path == 'examples/tied "gpt".py'
    assert plan.header.stages[0].label == "transformer.wte \\ embeddings"
    assert plan.header.stages[1].label == ""


def test_non_canonical_text_is_normalised():
    messy = (
        "\n\n#header\n   tpir   2\t#v\n"
        + DOCS_EXAMPLE.split("tpir 2\n", 1)[1]
        .replace("mesh pipe 2 data 1", "mesh   pipe 2   data 1#m   ")
        .replace("  load mb 0\n", "load mb 0\n\n\n", 1)
        .replace("units 0:3", "units 0 : 3")
        .replace("\n", "\r\n")
        .rstrip("\r\n")
    )
    plan = parse(messy)
    out = print_plan(plan)
    assert plan == parse(DOCS_EXAMPLE)
    assert out.startswith("# header\ntpir 2  # v\n")
    assert "mesh pipe 2 data 1  # m\n" in out
    assert "\nrank 0\n  load mb 0\n  forward" in out
    assert out.endswith("  step\n")
    assert print_plan(parse(out)) == out


def test_comment_on_rank_line_above_blank_line_keeps_its_blank_line():
    text = DOCS_EXAMPLE.replace("\nrank 1\n", "\n# second rank\nrank 1\n")
    out = print_plan(parse(text))
    assert "  step\n\n# second rank\nrank 1\n" in out


def test_printer_output_without_trailing_newline_parses_the_same():
    assert parse(DOCS_EXAMPLE.rstrip("\n")) == parse(DOCS_EXAMPLE)


def test_large_plan_round_trips_with_every_instruction_at_its_printed_line():
    plan = simple_plan(4, 9, 24, data=2, tie=True, checkpoint=True)
    # a comment above and at the end of every seventh instruction, so that lines and
    # instructions do not correspond one to one
    plan = Plan(
        header=plan.header,
        ranks=tuple(
            replace(r, instrs=tuple(
                i.with_trivia(comments=(f"above {n}",), note=f"at {n}") if n % 7 == 0 else i
                for n, i in enumerate(r.instrs)))
            for r in plan.ranks),
        trailing_comments=("the end",),
    )
    text = print_plan(plan)
    lines = text.splitlines()
    assert len(lines) >= 5000
    back = parse(text, file="big.tpir")
    assert back == plan
    assert print_plan(back) == text
    # instructions are the indented lines that are not comments, in order
    expected = [(n, 3) for n, line in enumerate(lines, 1)
                if line.startswith("  ") and not line.startswith("  #")]
    instrs = [i for r in back.ranks for i in r.instrs]
    assert [(i.loc.line, i.loc.col) for i in instrs] == expected
    assert all(i.loc.file == "big.tpir" for i in instrs)
    for i in instrs:
        assert lines[i.loc.line - 1].split("  #")[0] == "  " + str(i)
        n = i.loc.line
        if i.note is not None:
            assert lines[n - 1].endswith(f"  # {i.note}") and lines[n - 2] == f"  # {i.comments[0]}"
    for r in back.ranks:
        assert lines[r.loc.line - 1] == f"rank {r.rank}"
    assert back.trailing_comments == ("the end",)


# ------------------------------------------------------------------------------ bad input


def test_misspelt_instruction_suggests_the_closest():
    d = _error(DOCS_EXAMPLE.replace("  forward stage 0 mb 0 slice 1", "  fwd stage 0 mb 0 slice 1"))
    assert d.message.startswith("expected an instruction (load, forward")
    assert d.message.endswith("found 'fwd'")
    assert (d.loc.file, d.loc.line, d.loc.col) == ("bad.tpir", 17, 3)
    assert "did you mean 'forward'?" in d.hint
    assert "forward stage S mb M slice I [checkpoint]" in d.hint


def test_keyword_with_extra_letters_is_reported_as_one_word():
    d = _error(DOCS_EXAMPLE.replace("free-kv stage 0", "free-kvv stage 0"))
    assert d.message == "unknown word 'free-kvv'"
    assert (d.loc.line, d.loc.col) == (23, 3)
    assert "free-kv" in d.hint


def test_missing_operand_says_what_the_line_reads():
    d = _error(DOCS_EXAMPLE.replace("backward stage 0 mb 0 slice 1", "backward stage 0 mb 0"))
    assert d.message == "expected 'slice', found the end of the line"
    assert (d.loc.line, d.loc.col) == (20, 24)
    assert d.hint == "a 'backward' line reads: backward stage S mb M slice I"


def test_wrong_flag():
    d = _error(DOCS_EXAMPLE.replace("forward stage 0 mb 0 slice 0", "forward stage 0 mb 0 slice 0 ckpt"))
    assert d.message == "expected 'checkpoint' or the end of the line, found 'ckpt'"
    assert (d.loc.line, d.loc.col) == (15, 32)


def test_missing_version_line():
    d = _error(DOCS_EXAMPLE.replace("tpir 2\n", ""))
    assert d.message == "expected the version line `tpir 6`, found 'model'"
    assert (d.loc.line, d.loc.col) == (2, 1)


def test_empty_file():
    d = _error("")
    assert d.message == "expected the version line `tpir 6`, found the end of the file"
    assert (d.loc.line, d.loc.col) == (1, 1)


def test_unsupported_version():
    d = _error(DOCS_EXAMPLE.replace("tpir 2", "tpir 9"))
    assert d.message == "unsupported format version 9"
    assert (d.loc.line, d.loc.col) == (2, 6)
    assert "versions 1, 2, 3, 4, 5 and 6" in d.hint and "tpir 6" in d.hint


def test_header_line_out_of_order():
    text = DOCS_EXAMPLE.replace('schedule "terapipe"\n', "").replace(
        "units 6\n", 'units 6\nschedule "terapipe"\n')
    with pytest.raises(TpirError) as info:
        parse(text, file="bad.tpir")
    messages = [(d.message, d.loc.line) for d in info.value.diagnostics]
    # `schedule` after `units` is out of order, and so the header has no schedule before units
    assert ("the header has no 'schedule' line", 6) in messages
    assert ("'schedule' line out of order: it comes after a 'units' line (line 6)", 7) in messages
    assert all(d.hint for d in info.value.diagnostics)


def test_header_line_missing():
    d = _error(DOCS_EXAMPLE.replace("mesh pipe 2 data 1\n", ""))
    assert d.message == "the header has no 'mesh' line"
    assert (d.loc.line, d.loc.col) == (5, 1)
    assert "mesh pipe P data D" in d.hint


def test_header_line_twice():
    d = _error(DOCS_EXAMPLE.replace("units 6\n", "units 6\nunits 6\n"))
    assert d.message == "a second 'units' line (the first is at line 7)"
    assert d.loc.line == 8


def test_header_line_after_a_rank_line():
    d = _error(DOCS_EXAMPLE.replace("rank 1\n", "rank 1\nmesh pipe 2 data 1\n"))
    assert d.message.endswith("found 'mesh'")
    assert d.loc.line == 28
    assert "header lines come before the first `rank` line" in d.hint


def test_duplicate_rank_section():
    d = _error(DOCS_EXAMPLE.replace("rank 1\n", "rank 0\n"))
    assert d.message == "a second 'rank 0' section (the first is at line 13)"
    assert (d.loc.line, d.loc.col) == (27, 1)


def test_rank_sections_out_of_order():
    rank0, rank1 = DOCS_EXAMPLE.split("\nrank 0\n")[1].split("\nrank 1\n")
    head = DOCS_EXAMPLE.split("\nrank 0\n")[0]
    with pytest.raises(TpirError) as info:
        parse(f"{head}\nrank 1\n{rank1}\nrank 0\n{rank0}", file="bad.tpir")
    first = info.value.diagnostics[0]
    assert first.message == "rank sections out of order: expected 'rank 0' here, found 'rank 1'"
    assert first.loc.line == 13


def test_negative_index_is_located_at_the_number():
    d = _error(DOCS_EXAMPLE.replace("send act stage 0 mb 0 slice 1 to 1", "send act stage 0 mb 0 slice -1 to 1"))
    assert d.message == "slice must be >= 0, got -1"
    assert (d.loc.line, d.loc.col) == (18, 31)


def test_dataclass_check_becomes_a_located_diagnostic():
    d = _error(DOCS_EXAMPLE.replace("mesh pipe 2", "mesh pipe 0"))
    assert d.message == "mesh sizes must be >= 1"
    assert (d.loc.line, d.loc.col) == (5, 1)
    assert d.hint == "a 'mesh' line reads: mesh pipe P data D [tensor T]"


def test_bad_string_escape_and_unclosed_string():
    d = _error(DOCS_EXAMPLE.replace('factory "model"', 'factory "mo\\qdel"'))
    assert d.message == "unknown escape '\\q' in a string"
    assert d.loc.line == 3 and d.loc.col == DOCS_EXAMPLE.splitlines()[2].index('"model"') + 4
    d = _error(DOCS_EXAMPLE.replace('schedule "terapipe"', 'schedule "terapipe'))
    assert d.message == "a string with no closing quote"
    assert (d.loc.line, d.loc.col) == (6, 10)


def test_stray_character():
    d = _error(DOCS_EXAMPLE.replace("  step\n", "  step @\n", 1))
    assert d.message == "expected the end of the line, found '@'"
    assert (d.loc.line, d.loc.col) == (25, 8)


def test_rendered_error_shows_the_line_and_a_caret():
    with pytest.raises(TpirError) as info:
        parse(DOCS_EXAMPLE.replace("  step\n", "  stpe\n", 1), file="plan.tpir")
    text = str(info.value)
    assert "plan.tpir:25:3: error:" in text
    assert "   25 |   stpe\n      |   ^" in text
    assert "hint: did you mean 'step'?" in text


def test_comment_spelling_is_normalised():
    text = DOCS_EXAMPLE.replace("  step\n", "  step  #tight   \n", 1)
    plan = parse(text)
    assert plan.ranks[0].instrs[-1].note == "tight"
    assert "  step  # tight\n" in print_plan(plan)


def test_control_characters_are_errors_not_crashes():
    for bad in ("\f", "\x00", "\u2028", "\r\r"):  # (one "\r" before "\n" is a CRLF)
        d = _error(DOCS_EXAMPLE.replace("  step\n", f"  step {bad}\n", 1))
        assert (d.loc.line, d.loc.col) == (25, 8)


# ------------------------------------------------------------------------------- tpc fmt


def test_cli_fmt_check_and_rewrite(tmp_path, capsys):
    from tpc.cli.main import main

    good = tmp_path / "good.tpir"
    good.write_text(DOCS_EXAMPLE)
    messy = tmp_path / "messy.tpir"
    messy.write_text(DOCS_EXAMPLE.replace("  load mb 0", "load   mb 0 #x"))
    assert main(["fmt", "--check", str(good)]) == 0
    assert main(["fmt", "--check", str(messy)]) == 1
    assert "not canonical" in capsys.readouterr().out
    assert main(["fmt", str(messy)]) == 0
    assert messy.read_text() == DOCS_EXAMPLE.replace("  load mb 0", "  load mb 0  # x")
    assert main(["fmt", "--check", str(messy)]) == 0


def test_cli_fmt_of_several_files_rewrites_none_when_one_is_bad(tmp_path, capsys):
    """`tpc fmt a b c` reads and parses every file before it rewrites the first: one plan that
    does not parse leaves the others as they were (and says where the bad one is wrong)."""
    from tpc.cli.main import main

    messy = DOCS_EXAMPLE.replace("  load mb 0", "load   mb 0 #x")
    first, bad = tmp_path / "a.tpir", tmp_path / "b.tpir"
    first.write_text(messy)
    bad.write_text(DOCS_EXAMPLE.replace("  load mb 0", "  lod mb 0"))
    assert main(["fmt", str(first), str(bad)]) != 0
    assert first.read_text() == messy
    assert "b.tpir:" in capsys.readouterr().err
