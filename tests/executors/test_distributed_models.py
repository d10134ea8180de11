"""The distributed executor on the tiny example GPT (gloo, one process per rank): 2 ranks and
4 ranks (pipe 2 x data 2, and pipe 4) give the interpreter's loss and gradients and plain
autograd's within 1e-5, and the weights of plain training after several steps; and the real
command line, `torchrun ... tpc run PLAN --verify-grads`, end to end."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest

from tests.executors.dist_harness import free_port, tpc_command
from tests.executors.dist_harness import run_cases as harness_run_cases
from tests.executors.fake_ranks import run_real_cases
from tests.executors.real import fresh_model, real_plan
from tpc.executors.training.batches import RandomTokens
from tpc.executors.interpreter import interpret
from tpc.executors.oracle import gradient_error, batch_reference
from tpc.executors.options import RunOptions
from tpc.executors.training.optimizer import OptimSpec, build_optimizer
from tpc.ir.printer import print_plan

pytestmark = pytest.mark.slow

TOL = 1e-5
SEQ = 16


def _plan(schedule, **kw):
    return dict(schedule=schedule, slices="2,9,5", microbatches=2, seq_len=SEQ) | kw


TWO = [dict(plan=_plan(s, stages=2)) for s in ("1f1b", "terapipe", "seq1f1b")]
TWO.append(dict(plan=_plan("seq1f1b", stages=2), steps=3, optim=("sgd", 0.5)))
FOUR = [dict(plan=_plan(s, stages=2, dp=2, batch=8)) for s in ("1f1b", "terapipe", "seq1f1b")]
FOUR += [dict(plan=_plan(s, stages=4, microbatches=4)) for s in ("1f1b", "terapipe", "seq1f1b")]


def _launch(tmp_path_factory, world, cases):
    out = tmp_path_factory.mktemp(f"gpt{world}")
    return harness_run_cases(out, world, run_real_cases, cases, 60.0, limit=240)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _launch(tmp_path_factory, 2, TWO)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _launch(tmp_path_factory, 4, FOUR)


def _check(case, ranks):
    name = case.get("model", "gpt")
    plan = real_plan(name, **case["plan"])
    model, sliced = fresh_model(name, SEQ)
    reference = copy.deepcopy(model)
    interp = interpret(plan, RunOptions(steps=case.get("steps", 1), optim=OptimSpec(*case.get("optim", ("sgd", 0.1))),
                                          lr_schedule="constant"),
                       model=model, sliced=sliced)
    h = plan.header.shape
    ref_loss, ref_grads, _ = batch_reference(reference, RandomTokens(0, h.batch, SEQ, h.vocab).get(0))
    held = {}
    for outcome in ranks:
        assert outcome["losses"] == pytest.approx(interp.losses, rel=1e-6)  # global loss on every rank
        assert abs(outcome["losses"][0] - ref_loss) <= TOL * abs(ref_loss)
        mine = outcome["first_grads"]
        assert gradient_error(mine, {n: ref_grads[n] for n in mine})[0] <= TOL
        assert gradient_error(mine, {n: interp.first_grads[n] for n in mine})[0] <= 1e-6
        held |= mine
    assert set(held) == set(ref_grads)  # every parameter is trained by some rank
    return interp


@pytest.mark.parametrize("i", range(3))
def test_two_ranks(two, i):
    _check(TWO[i], two[i])


def test_two_ranks_weights_after_several_steps(two):
    case, ranks = TWO[3], two[3]
    _check(case, ranks)
    ref, _ = fresh_model("gpt", SEQ)
    opt = build_optimizer(ref.named_parameters(), OptimSpec(*case["optim"]))
    for step in range(case["steps"]):
        _, grads, _ = batch_reference(ref, RandomTokens(0, 4, SEQ, 256).get(step))
        for n, p in ref.named_parameters():
            p.grad = grads[n]
        opt.step()
    final = dict(ref.named_parameters(remove_duplicate=False))
    for outcome in ranks:
        got = outcome["params"]
        assert gradient_error(got, {n: final[n].detach() for n in got})[0] <= TOL


@pytest.mark.parametrize("i", range(len(FOUR)))
def test_four_ranks(four, i):
    _check(FOUR[i], four[i])


def test_torchrun_command_line(tmp_path):
    plan = tmp_path / "plan.tpir"
    plan.write_text(print_plan(real_plan("gpt", **_plan("seq1f1b", stages=2))), encoding="utf-8")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "--no-python", tpc_command(), "run", str(plan), "--verify-grads", "--steps", "2",
           "--timeout", "60"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 2/2  loss" in done.stdout
    assert done.stdout.count("verify-grads:") == 1 and ": ok" in done.stdout  # printed by rank 0 only


def test_a_rank_that_never_comes_is_reported_not_waited_for(tmp_path):
    plan = tmp_path / "plan.tpir"
    plan.write_text(print_plan(real_plan("gpt", **_plan("1f1b", stages=2))), encoding="utf-8")
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", RANK="0", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = subprocess.run([tpc_command(), "run", str(plan), "--timeout", "3"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 1
    assert "rank 0: could not join the other 1 rank(s) within 3 s" in done.stderr
