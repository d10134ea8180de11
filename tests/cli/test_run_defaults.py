"""`tpc run` and the library have one set of defaults: a flag not given takes RunOptions' own
value, and each flag's help says that value."""

from __future__ import annotations

import dataclasses
import re

from tpc.cli.main import build_parser
from tpc.cli.run import options_from_args
from tpc.executors.options import RunOptions

# flag -> the RunOptions field it sets (optimizer flags set RunOptions.optim's fields)
FLAGS = {"--steps": "steps", "--seed": "seed", "--lr-schedule": "lr_schedule", "--warmup": "warmup",
         "--grad-clip": "grad_clip", "--device": "device", "--timeout": "timeout",
         "--save-every": "save_every", "--tolerance": "tolerance", "--eval-every": "eval_every",
         "--eval-batches": "eval_batches", "--optimizer": "optim.kind", "--lr": "optim.lr",
         "--weight-decay": "optim.weight_decay"}


def _field(options: RunOptions, path: str):
    value = options
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _run_parser():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return parser, sub.choices["run"]


def test_no_flag_gives_the_library_defaults():
    parser, _ = _run_parser()
    options = options_from_args(parser.parse_args(["run", "plan.tpir"]))
    assert options == RunOptions()
    for field in dataclasses.fields(RunOptions):
        assert getattr(options, field.name) == getattr(RunOptions(), field.name), field.name


def test_each_help_says_the_library_default():
    _, run = _run_parser()
    defaults = RunOptions()
    for action in run._actions:
        flag = next((o for o in action.option_strings if o in FLAGS), None)
        if flag is None:
            continue
        said = re.search(r"\(default: ([^),;:]+)", action.help or "")
        assert said, f"{flag}: its help does not say its default"
        value = _field(defaults, FLAGS[flag])
        text = said.group(1).strip()
        if isinstance(value, str):
            assert text.split()[0] == value, f"{flag}: help says {text!r}, the library {value!r}"
        else:
            assert float(text.split()[0]) == float(value), f"{flag}: help says {text!r}, the library {value!r}"


def test_a_given_flag_wins():
    parser, _ = _run_parser()
    options = options_from_args(parser.parse_args(["run", "p.tpir", "--lr-schedule", "constant", "--lr", "0.01",
                                                   "--steps", "7"]))
    assert (options.lr_schedule, options.optim.lr, options.steps) == ("constant", 0.01, 7)


def test_no_slice_pairs_turns_the_pairs_off():
    parser, _ = _run_parser()
    assert options_from_args(parser.parse_args(["run", "p.tpir", "--no-slice-pairs"])).slice_pairs is False
    assert options_from_args(parser.parse_args(["run", "p.tpir"])).slice_pairs is True
