"""Models the front end must refuse, each with the model file's location and a hint."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tpc.compiler.frontend import SlicedModel, file_sha256, load_model
from tpc.ir.diagnostics import TpirError

MODELS = Path(__file__).resolve().parent / "models"


def line_of(path: Path, needle: str) -> int:
    for i, text in enumerate(path.read_text().splitlines(), 1):
        if needle in text:
            return i
    raise AssertionError(f"{needle!r} not in {path}")


def refusal(fn) -> TpirError:
    with pytest.raises(TpirError) as info:
        fn()
    err = info.value
    assert err.diagnostics[0].hint, "every refusal says what would be right"
    return err


def slice_model(name: str, vocab: int = 64):
    return SlicedModel.from_model(load_model(str(MODELS / name)), seq_len=16, vocab=vocab)


@pytest.mark.parametrize("fixture,file,needle,words", [
    ("mean_over_sequence.py", "mean_over_sequence.py", "x.mean(dim=1", "mixes tokens"),
    ("cumsum_over_sequence.py", "cumsum_over_sequence.py", "cumsum(dim=1)", "mixes tokens"),
    # the construct is in a helper module the model file imports: its line, then the model's
    ("bidirectional.py", "_base.py", "F.scaled_dot_product_attention(", "bidirectional"),
    ("wrong_shape.py", "wrong_shape.py", "self.head(x[:, -1])", "(batch, seq, vocab=64)"),
])
def test_unsliceable_models_are_refused_at_their_source_line(fixture, file, needle, words):
    err = refusal(lambda: slice_model(fixture))
    loc = err.diagnostics[0].loc
    assert loc is not None and Path(loc.file).name == file
    assert loc.line == line_of(MODELS / file, needle)
    text = str(err)
    assert f"{file}:{loc.line}:" in text and words in text
    if file != fixture:  # a note at the model file's own line that called the helper
        note = err.diagnostics[1]
        assert note.severity == "note" and Path(note.loc.file).name == fixture
        assert note.loc.line == line_of(MODELS / fixture, "x = self.attend(")


def test_data_dependent_control_flow_is_located():
    err = refusal(lambda: slice_model("data_dependent.py"))
    loc = err.diagnostics[0].loc
    assert Path(loc.file).name == "data_dependent.py"
    assert loc.line == line_of(MODELS / "data_dependent.py", "if x.sum() > 0")


def test_missing_factory_lists_the_callables_found():
    err = refusal(lambda: load_model(str(MODELS / "no_factory.py")))
    text = str(err)
    assert "no_factory.py:1:1" in text and "`model`" in text and "build" in text and "Net" in text


def test_syntax_error_points_at_line_and_column():
    err = refusal(lambda: load_model(str(MODELS / "syntax_error.py")))
    loc = err.diagnostics[0].loc
    assert Path(loc.file).name == "syntax_error.py" and loc.line == 5 and loc.col >= 1
    assert "syntax error" in str(err)


def test_factory_that_raises_shows_its_frame():
    err = refusal(lambda: load_model(str(MODELS / "factory_raises.py")))
    loc = err.diagnostics[0].loc
    assert loc.line == line_of(MODELS / "factory_raises.py", "32 // width")
    assert "ZeroDivisionError" in str(err)


def test_factory_must_return_a_module():
    err = refusal(lambda: load_model(str(MODELS / "not_a_module.py")))
    assert "not a torch.nn.Module" in str(err) and "not_a_module.py:1:" in str(err)


def test_missing_file_and_custom_factory():
    err = refusal(lambda: load_model(str(MODELS / "absent.py")))
    assert "no such model file" in str(err)
    net = load_model(str(MODELS / "no_factory.py"), factory="build")
    assert type(net).__name__ == "Net"
    assert re.fullmatch(r"[0-9a-f]{64}", file_sha256(str(MODELS / "no_factory.py")))


def test_more_stages_than_units_is_refused(tmp_path):
    from .harness import tiny_model

    sm = SlicedModel.from_model(tiny_model("gpt"), seq_len=16, vocab=256)
    err = refusal(lambda: sm.partition_by_params(sm.num_units + 1))
    assert f"between 1 and {sm.num_units}" in err.diagnostics[0].hint


def test_unbind_of_a_fused_projection_is_not_a_refusal():
    """unbind(0) traced with its default dim left out: the analysis reads the schema default,
    so the unbound size-3 axis is not mistaken for the sequence."""
    sliced = slice_model("fused_qkv_unbind.py")
    assert sliced.num_units >= 1


def test_a_python_loop_over_the_tokens_is_refused_at_the_loop_quoting_the_seq_len():
    """torch.export's own text ("Constraints violated (seq)! ... specialized it to be a constant
    (14)") quotes a length the front end chose; the refusal names the loop, at its line, and
    the --seq-len given."""
    err = refusal(lambda: slice_model("scan_loop.py"))
    d = err.diagnostics[0]
    assert Path(d.loc.file).name == "scan_loop.py"
    assert d.loc.line == line_of(MODELS / "scan_loop.py", "for t in range(x.size(1))")
    assert "a Python loop over the tokens (`for t in range(x.size(1)):" in d.message
    assert "1..16 (--seq-len 16)" in d.message and "Constraints violated" not in d.message
