"""`tpc --help` and every subcommand's --help explain their arguments; bad arguments exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tpc.cli.main import build_parser, main

SUBCOMMANDS = ["compile", "verify", "fmt", "show", "simulate", "run", "profile", "export", "export-schedule",
               "sample"]


def test_top_level_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out
    assert "torchrun" in out  # the usage example shows how to run a plan


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_subcommand_help_explains_each_argument(name, capsys):
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    sub = build_parser()._subparsers._group_actions[0].choices[name]
    for action in sub._actions:
        if action.dest == "help":
            continue
        assert action.help, f"`tpc {name}` option {action.option_strings or action.dest} has no help text"
        shown = action.option_strings[-1] if action.option_strings else action.dest
        assert shown in out


def test_missing_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    assert "usage: tpc" in capsys.readouterr().err


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "tpc.cli.main", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "usage: tpc" in out.stdout


def test_missing_plan_file_is_a_located_error_not_a_traceback(tmp_path, capsys):
    code = main(["fmt", str(tmp_path / "nope.tpir")])
    assert code == 1
    err = capsys.readouterr().err
    assert "no such file" in err and "Traceback" not in err


def test_output_cut_short_by_the_reader_is_not_an_error(tmp_path):
    """`tpc show plan | head -1`: the reader closes the pipe early; no traceback, status 0. The
    grid (8 ranks x ~1000 steps) is larger than a pipe's buffer, so the writer does meet the
    closed pipe."""
    from tests.ir.plans import simple_plan
    from tpc.ir.printer import print_plan

    plan = tmp_path / "big.tpir"
    plan.write_text(print_plan(simple_plan(8, 32, 16)))
    proc = subprocess.Popen([sys.executable, "-c", "from tpc.cli.main import entry; entry()", "show", str(plan)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()  # the reader goes away after one line
    err = proc.stderr.read().decode()
    assert proc.wait() == 0 and "Traceback" not in err, err


def test_compile_help_names_every_schedule():
    from tpc.compiler.schedules import SCHEDULES

    sub = build_parser()._subparsers._group_actions[0].choices["compile"]
    text = next(a.help for a in sub._actions if a.dest == "schedule")
    assert all(f" {name} " in f" {text} " for name in SCHEDULES), text
