"""`tpc compile` as a pipeline of named passes (compiler/passes.py, compiler/pipeline.py): the
pass lists the options make, the driver's verification between passes, `--print-after`, and
one set of defaults for the command line and the library (compiler/options.py)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.compiler import make_header
from tests.executors.real import model_file
from tpc.cli.main import build_parser, main
from tpc.compiler.options import DEFAULTS, CompileOptions, check_options
from tpc.compiler.passes import CompileState, Pass, PassManager
from tpc.compiler.pipeline import PASS_NAMES, PASSES, compile_passes
from tpc.ir.diagnostics import TpirError
from tpc.ir.nodes import Op
from tpc.ir.parse import parse
from tpc.ir.printer import print_plan
from tpc.ir.semantics import DEFAULT_COMM, GLOO, NCCL
from tpc.ir.verify import verify

BASE = dict(stages=2, microbatches=2, seq_len=16, batch=4, slices=2)
FRONT = ("load", "trace", "partition", "header")
BACK = ("self-check", "schedule", "lower", "eval")


def _names(**change):
    return tuple(p.name for p in compile_passes(check_options(**{**BASE, **change})))


def test_the_pass_lists_the_options_make():
    assert _names() == FRONT + BACK
    assert _names(recompute="full") == FRONT + ("self-check", "schedule", "recompute", "lower", "eval")
    assert _names(device_model="h100") == ("load", "trace", "costs", "search", "eval-dp") + BACK
    # every pass has a name of its own and says what it does in a line
    assert len(set(PASS_NAMES)) == len(PASS_NAMES) == len(PASSES)
    assert all(p.name and p.summary and "\n" not in p.summary for p in PASSES)
    # the options of a pass are its fields: lowering for the compile's rules
    lower = next(p for p in compile_passes(check_options(**BASE, comm="gloo")) if p.name == "lower")
    assert lower.comm is GLOO and [f.name for f in dataclasses.fields(lower)] == ["comm", "exchanges", "pairs"]
    assert not lower.pairs
    paired = [p for p in compile_passes(check_options(**BASE, tensor=2, tensor_overlap=True)) if p.name in ("lower", "eval")]
    assert [p.pairs for p in paired] == [True, True]  # --tensor-overlap: both programs' forwards paired


def _dumps(text: str) -> dict[str, str]:
    """`--print-after` output: the IR after each pass, by pass name."""
    out: dict[str, str] = {}
    for block in text.split("# after ")[1:]:
        name, _, body = block.partition("\n")
        out[name.split(":")[0]] = body
    return out


def test_print_after_prints_canonical_ir_that_parses(tmp_path, capsys):
    out = tmp_path / "plan.tpir"
    assert main(["compile", model_file("gpt"), "-o", str(out), *[f"--{k.replace('_', '-')}={v}" for k, v in BASE.items()],
                 "--print-after", "all", "-q"]) == 0
    dumps = _dumps(capsys.readouterr().out)
    assert tuple(dumps) == FRONT + BACK + ("write",)
    assert dumps["load"] == dumps["trace"] == dumps["partition"] == ""  # no IR before the header
    # a header pass: the header alone, a plan with no rank sections
    header = parse(dumps["header"], file="header")
    assert print_plan(header) == dumps["header"] and header.ranks == () and header.eval is None
    # the compute order: each rank's computes under the header, before any message
    schedule = parse(dumps["schedule"], file="schedule")
    assert print_plan(schedule) == dumps["schedule"]
    assert {i.op for r in schedule.ranks for i in r.instrs} <= {Op.FORWARD, Op.BACKWARD}
    # lowering: the training program, verified; the evaluation program comes next
    lowered = parse(dumps["lower"], file="lower")
    assert print_plan(lowered) == dumps["lower"] and lowered.eval is None and verify(lowered, NCCL) == []
    written = parse(out.read_text(), file=str(out))
    assert lowered.ranks == written.ranks and lowered.header == written.header
    assert dumps["eval"] == dumps["write"] == out.read_text()


def test_print_after_names_passes(tmp_path, capsys):
    """Several passes, by repeating the flag or with commas; only those are printed."""
    assert main(["compile", model_file("gpt"), "-o", str(tmp_path / "p.tpir"), "--seq-len", "16", "--batch", "2",
                 "--print-after", "header,schedule", "--print-after", "lower", "-q"]) == 0
    assert tuple(_dumps(capsys.readouterr().out)) == ("header", "schedule", "lower")


@pytest.mark.parametrize("argv, message", [
    (["--print-after", "lowr"], "--print-after lowr: no such pass"),
    (["--print-after", "header,search"], "--print-after search: no such pass: this compile runs load, trace, "
                                         "partition, header, self-check, schedule, lower, eval, write"),
])
def test_an_unknown_pass_is_refused_before_tracing(tmp_path, capsys, argv, message):
    out = tmp_path / "plan.tpir"
    # the model file does not exist: the refusal comes before anything reads it
    assert main(["compile", str(tmp_path / "missing.py"), "-o", str(out), "--seq-len", "16", "--batch", "2",
                 *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("--print-after: error: ") and message in err, err
    assert "choose among load, trace, partition, header" in err and "or all" in err
    assert not out.exists()


class _DropStep(Pass):
    """A broken pass: the plan loses rank 0's `step`."""

    name = "drop-step"
    summary = "removes rank 0's step"

    def __init__(self, changes_plan: bool):
        self.changes_plan = changes_plan

    def run(self, state, note):
        plan = state.plan
        r0 = plan.ranks[0]
        r0 = dataclasses.replace(r0, instrs=tuple(i for i in r0.instrs if i.op is not Op.STEP))
        return state.but(plan=dataclasses.replace(plan, ranks=(r0, *plan.ranks[1:])))


def test_the_driver_verifies_the_plan_after_every_pass_that_changes_it():
    from tpc.compiler.lowering.lower import lower
    from tpc.compiler.schedules import build_schedule

    header = make_header(2, mbs=2, schedule="gpipe")
    state = CompileState(model_path="m.py", header=header, plan=lower(header, build_schedule("gpipe", header)))
    with pytest.raises(TpirError, match="step"):
        PassManager((_DropStep(changes_plan=True),), quiet=True).run(state)
    # a pass that says it leaves the plan alone is taken at its word (the final check catches it)
    assert PassManager((_DropStep(changes_plan=False),), quiet=True).run(state).plan is not state.plan


def test_the_command_lines_defaults_are_the_librarys():
    """Every option `tpc compile` has a flag for defaults to `CompileOptions`' field: a flag left
    out is the field left out. Fails when one side's default changes without the other's."""
    from tpc.cli.compile import FLAGS, options_from_args

    fields = {f.name for f in dataclasses.fields(CompileOptions)}
    assert set(FLAGS) == fields - {"seq_len", "batch"}  # a new option gets a flag, or is listed here
    parser = build_parser()
    args = parser.parse_args(["compile", "m.py", "-o", "p.tpir", "--seq-len", "16", "--batch", "2"])
    for name in FLAGS:
        flag = getattr(args, name)
        assert flag is None or flag == DEFAULTS[name], (name, flag, DEFAULTS[name])
    assert options_from_args(args) == CompileOptions(seq_len=16, batch=2)
    # the flags the compile's defaults show are those of the dataclass
    assert (DEFAULTS["stages"], DEFAULTS["schedule"], DEFAULTS["comm"]) == (2, "seq1f1b", DEFAULT_COMM)
    # one default for the communication rules, whichever command reads them
    for command in (["verify", "p.tpir"], ["simulate", "p.tpir"]):
        assert parser.parse_args(command).comm is DEFAULT_COMM
    assert parser.parse_args(["run", "p.tpir"]).comm is None  # the backend's own rules


def test_the_schedule_file_runs_through_the_shared_passes(tmp_path, capsys):
    from torch.distributed.pipelining import schedules as S

    from tests.compiler.torch_schedules import build, dump

    csv = dump(build(S.ScheduleGPipe, 2, 1, 2), tmp_path / "gpipe.csv")
    out = tmp_path / "plan.tpir"
    assert main(["compile", model_file("gpt"), "--schedule-file", str(csv), "-o", str(out), "--seq-len", "16",
                 "--batch", "2", "--print-after", "all"]) == 0
    captured = capsys.readouterr()
    dumps = _dumps(captured.out)
    assert tuple(dumps) == FRONT + ("csv-place", "self-check", "csv-import", "eval")
    assert 'schedule "torch csv gpipe.csv"' in dumps["csv-place"] and 'schedule "gpipe"' in dumps["header"]
    assert dumps["eval"] == out.read_text() + captured.out[captured.out.index("wrote "):]  # then the summary
    for step in FRONT + ("csv-import", "verify"):
        assert f"  {step} " in captured.err
