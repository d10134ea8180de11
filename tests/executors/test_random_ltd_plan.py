"""A plan compiled with `--random-ltd` (its `random-ltd` line) runs the dropping it records: the
interpreter's first step equals random-LTD's oracle (<= 1e-5) with no run flag, as under torchrun
on gloo (`tpc run PLAN --verify-grads`); a run flag that disagrees with the plan is refused, one
that agrees is accepted, and a plan without the line still takes the run flags."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest

from tests.executors.dist_harness import free_port, tpc_command
from tests.executors.real import model_file, traced
from tpc.cli.main import main
from tpc.compiler.random_ltd import RandomLTD
from tpc.executors.interpreter import interpret
from tpc.executors.options import RunOptions
from tpc.executors.oracle import batch_reference, gradient_error
from tpc.executors.random_ltd_oracle import ltd_reference
from tpc.executors.training.batches import RandomTokens
from tpc.ir.diagnostics import TpirError
from tpc.ir.parse import parse


def parse_file(path: str):
    return parse(open(path, encoding="utf-8").read(), file=path)


SEQ, TOL = 16, 1e-5
FLAGS = ["--random-ltd", "1:3", "--random-ltd-schedule", "5,13,4,2"]
RECORDED = RandomLTD(units=(1, 2), min_value=5, max_value=13, require_steps=4, seq_per_step=2, seed=1234)


def compiled(tmp_path, *extra: str):
    out = tmp_path / "p.tpir"
    assert main(["compile", model_file("nanogpt"), "-o", str(out), "--seq-len", str(SEQ), "--batch", "4",
                 "--stages", "2", "--microbatches", "2", "--slices", "2,9,5", "--schedule", "1f1b", "-q",
                 *extra]) == 0
    return out


def test_a_plan_compiled_with_random_ltd_runs_its_dropping_exactly(tmp_path):
    plan = parse_file(str(compiled(tmp_path, *FLAGS)))
    assert plan.header.random_ltd is not None and plan.header.random_ltd.units == (1, 2)
    model, sliced, _ = traced(model_file("nanogpt"), SEQ)
    result = interpret(plan, RunOptions(steps=1), model=copy.deepcopy(model), sliced=sliced)
    h = plan.header
    tokens = RandomTokens(0, h.shape.batch, SEQ, h.shape.vocab).get(0)
    rows = [(h.microbatch_rows(m)[0], mb.size, 0, mb.lengths) for m, mb in enumerate(h.microbatches)]
    want = ltd_reference(copy.deepcopy(model), tokens, RECORDED, sliced.unit_labels, 0, rows)
    assert gradient_error(batch_reference(copy.deepcopy(model), tokens).grads, want.grads)[0] > 1e-2
    worst, where = gradient_error(result.first_grads, want.grads, want.unused)
    assert worst <= TOL, (worst, where)
    assert abs(result.losses[0] - want.loss) <= TOL * abs(want.loss)
    # the same run flags agree with the plan: the same step
    again = interpret(plan, RunOptions(steps=1, random_ltd=RECORDED), model=copy.deepcopy(model), sliced=sliced)
    assert again.losses == result.losses


def test_a_run_flag_that_disagrees_with_the_plan_is_refused(tmp_path):
    path = compiled(tmp_path, *FLAGS)
    model, sliced, _ = traced(model_file("nanogpt"), SEQ)
    other = RandomLTD(units=(1,), min_value=5, max_value=13, require_steps=4, seq_per_step=2)
    with pytest.raises(TpirError) as e:
        interpret(parse_file(str(path)), RunOptions(steps=1, random_ltd=other), model=copy.deepcopy(model),
                  sliced=sliced)
    text = e.value.render()
    assert "`--random-ltd 1 --random-ltd-schedule 5,13,4,2` disagrees with the plan, compiled with " \
           "`--random-ltd 1,2 --random-ltd-schedule 5,13,4,2`" in text and "p.tpir:7:1" in text, text


@pytest.mark.parametrize("extra,says", [
    (["--random-ltd", "0:3", "--random-ltd-schedule", "5,13,4,2"], "middle units (from 1 on) only, not [0]"),
    (["--random-ltd", "1:4", "--random-ltd-schedule", "5,13,4,2"], "middle units (1..2) only, not [3]"),
    (["--random-ltd", "1:3"], "--random-ltd needs --random-ltd-schedule"),
    (["--random-ltd", "1:3", "--random-ltd-schedule", "5,13,4,2", "--schedule", "zb-h1"], "splits each backward"),
])
def test_compile_refuses_what_cannot_drop(tmp_path, capsys, extra, says):
    out = tmp_path / "q.tpir"
    code = main(["compile", model_file("nanogpt"), "-o", str(out), "--seq-len", str(SEQ), "--batch", "4",
                 "--stages", "2", "-q", *extra])
    assert code != 0 and not out.exists()
    assert says in capsys.readouterr().err


def test_torchrun_gloo_verify_grads_of_a_compiled_plan(tmp_path):
    """`tpc run PLAN --verify-grads` on 2 gloo ranks, the dropping read from the plan alone."""
    path = compiled(tmp_path, *FLAGS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "--no-python", tpc_command(), "run", str(path), "--steps", "2", "--verify-grads", "--timeout", "60",
           "--device", "cpu"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "verify-grads: loss" in done.stdout and ": ok" in done.stdout, done.stdout[-2000:]


def test_plans_of_one_bundle_must_record_the_same_dropping():
    import dataclasses
    from pathlib import Path

    from tpc.compiler.random_ltd import to_line
    from tpc.executors.pipeline import PlanSet
    from tpc.executors.random_ltd_plan import run_options

    golden = Path(__file__).resolve().parents[1] / "compiler" / "golden" / "1f1b_k3_unequal_m3_dp2.tpir"
    plan = parse(golden.read_text(), file="g.tpir")
    line = to_line(RandomLTD(units=(1,), min_value=4, max_value=24, require_steps=10))
    dropping = dataclasses.replace(plan, header=dataclasses.replace(plan.header, random_ltd=line))
    got = run_options(PlanSet.single(dropping), RunOptions(seed=3))
    assert got.random_ltd.units == (1,) and got.random_ltd.seed == 1237  # the run's seed, as the flags draw
    assert run_options(PlanSet.single(plan), RunOptions()).random_ltd is None
    with pytest.raises(TpirError, match="the bundle's plan of length 12 drops no tokens"):
        run_options(PlanSet({12: plan, 24: dropping}, lambda step: 24), RunOptions())
