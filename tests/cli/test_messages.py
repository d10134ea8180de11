"""Messages of bad command lines and bad files that said the wrong thing: each one now names
the flag (or file:line:col) at fault and what would be right."""

from __future__ import annotations

import pytest

from tpc.cli.main import main, negative_values


def test_a_value_that_begins_like_a_negative_number_stays_its_flags():
    assert negative_values(["compile", "m.py", "--seq-len", "-5,64", "--lr", "-1e-3", "--x", "-5GiB"]) == \
        ["compile", "m.py", "--seq-len=-5,64", "--lr=-1e-3", "--x=-5GiB"]
    # options, plain words, `--` and a flag already given its value are left alone
    assert negative_values(["run", "-o", "-5", "--debug", "--steps=3", "-5", "--", "-5x"]) == \
        ["run", "-o", "-5", "--debug", "--steps=3", "-5", "--", "-5x"]
    assert negative_values(["--steps", "--lr", "3"]) == ["--steps", "--lr", "3"]


@pytest.mark.parametrize("argv, flag, message", [
    # argparse took each of these values for an option: "argument --seq-len: expected one argument"
    (["--seq-len", "-5,64"], "--seq-len", "the length -5 is not a positive number of tokens"),
    (["--seq-len", "64", "--slices", "-2,66"], "--slices", "slice length -2 in '-2,66' is not positive"),
    (["--seq-len", "64", "--memory-per-rank", "-5GiB"], "--memory-per-rank", "'-5GiB' is not a memory size"),
    (["--seq-len", "-5"], "--seq-len", "--seq-len must be a positive whole number, got -5"),
])
def test_a_negative_value_is_said_negative_at_its_flag_not_missing(tmp_path, capsys, argv, flag, message):
    out = tmp_path / "plan.tpir"
    assert main(["compile", str(tmp_path / "no_such_model.py"), "-o", str(out), "--batch", "4", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{flag}: error: ") and message in err, err
    assert "expected one argument" not in err


def test_a_negative_learning_rate_is_refused_as_negative(tmp_path, capsys):
    assert main(["run", "--interpret", str(tmp_path / "p.tpir"), "--lr", "-1e-3"]) == 1
    assert "--lr: error: learning rate must be a finite number > 0, got -0.001" in capsys.readouterr().err


GOLDEN = "tests/ir/golden/one_f_one_b_exchange.tpir"


@pytest.mark.parametrize("command", [["verify"], ["fmt"], ["show"], ["simulate", "--unit"], ["fmt", "--check"]])
def test_a_byte_that_is_not_utf8_is_reported_at_its_line_and_column(tmp_path, capsys, command):
    """It was "cannot read p.tpir: 'utf-8' codec can't decode byte 0xff in position 461" (a byte
    offset, no line), and a traceback from `tpc fmt` and `tpc show`."""
    from pathlib import Path

    lines = Path(GOLDEN).read_bytes().split(b"\n")
    lines[9] += b" \xff"
    plan = tmp_path / "p.tpir"
    plan.write_bytes(b"\n".join(lines))
    col = len(lines[9])  # the byte is the line's last character (the line is ASCII before it)
    args = [command[0], str(plan), *command[1:]]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert f"{plan}:10:{col}: error: byte 0xff is not UTF-8 text (invalid start byte)" in err, err
    assert "   10 | stage 1 rank 1" in err and "Traceback" not in err
    assert "re-save the file as UTF-8" in err


def test_a_schedule_csv_byte_that_is_not_utf8_is_reported_at_its_cell(tmp_path, capsys):
    csv = tmp_path / "s.csv"
    csv.write_bytes("0F0,0B0\r\n1F0,é\r\n".encode("latin-1"))
    assert main(["verify", str(csv)]) == 1
    err = capsys.readouterr().err
    assert f"{csv}:2:5: error: byte 0xe9 is not UTF-8 text" in err and "    2 | 1F0," in err


def test_a_huge_line_is_shown_around_its_caret_not_whole(tmp_path, capsys):
    """A 1 MB line (the report had 50 MB) was echoed whole, in the source line and in the
    message; now the line is shown around the caret and a quoted word is cut."""
    from pathlib import Path

    lines = Path(GOLDEN).read_text().split("\n")
    lines[9] += " " + "x" * 1_000_000
    plan = tmp_path / "p.tpir"
    plan.write_text("\n".join(lines))
    assert main(["verify", str(plan)]) == 1
    err = capsys.readouterr().err
    assert len(err) < 2000, len(err)
    assert f"{plan}:10:34: error: expected the end of the line" in err
    assert "… (1000033 characters)" in err
    caret = err.splitlines()[2]
    assert caret.index("^") == err.splitlines()[1].index("x")  # the caret still under the word

    csv = tmp_path / "s.csv"
    csv.write_text("0F0,0B0\r\n1F0,1B0," + "9" * 1_000_000 + "Q\r\n")
    assert main(["verify", str(csv)]) == 1
    err = capsys.readouterr().err
    assert len(err) < 2000, len(err)
    assert f"{csv}:2:9: error: `{'9' * 60}… (1000001 characters)` is not a torch pipelining action" in err


def test_a_caret_far_into_a_long_line_is_shown_with_the_text_around_it():
    from tpc.ir.diagnostics import Diagnostic
    from tpc.ir.nodes import Loc

    line = "a" * 5000 + "HERE" + "b" * 5000
    out = Diagnostic("bad word", loc=Loc("f.tpir", 1, 5001)).render(line).splitlines()
    assert out[1].startswith("    1 | …") and "HERE" in out[1] and out[1].endswith("… (10004 characters)")
    assert out[2].index("^") == out[1].index("HERE")


def test_only_the_first_errors_of_a_long_list_are_rendered():
    from tpc.ir.diagnostics import ERRORS_SHOWN, Diagnostic, TpirError

    e = TpirError([Diagnostic(f"error {k}", where="f") for k in range(ERRORS_SHOWN + 7)])
    text = e.render()
    assert "error 99" in text and "error 100" not in text
    assert text.endswith("... and 7 more errors (the first 100 are shown: fix them and run again)")
    assert len(e.diagnostics) == ERRORS_SHOWN + 7


def test_a_model_build_that_runs_out_of_memory_says_so(tmp_path, capsys):
    """It was `model()` raised RuntimeError: [enforce fail at alloc_cpu.cpp:127] ..." or, for a
    config.json, "transformers cannot build a causal LM ... check \"model_type\"": the
    configuration was fine, the memory ran out."""
    model = tmp_path / "big.py"
    model.write_text("import torch\n\n\ndef model():\n    raise MemoryError()\n")
    assert main(["compile", str(model), "-o", str(tmp_path / "p.tpir"), "--seq-len", "8", "--batch", "2"]) == 1
    err = capsys.readouterr().err
    assert f"{model}:5:" in err and "error: building the model ran out of memory (MemoryError)" in err, err
    assert "try a smaller configuration" in err


def test_a_hugging_face_model_that_runs_out_of_memory_is_not_blamed_on_its_model_type(tmp_path, capsys, monkeypatch):
    transformers = pytest.importorskip("transformers")

    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 8405385216 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", no_memory)
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, '
                      '"num_attention_heads": 4, "vocab_size": 256}')
    assert main(["compile", str(config), "-o", str(tmp_path / "p.tpir"), "--seq-len", "8", "--batch", "2"]) == 1
    err = capsys.readouterr().err
    assert (f"{config}:1:1: error: building the model ran out of memory (a tensor of 7.8 GiB could not be "
            "allocated)") in err, err
    assert "model_type" not in err.split("hint:")[1]
