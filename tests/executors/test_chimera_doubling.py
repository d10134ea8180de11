"""Chimera with forward doubling is exact: the forwards of two micro-batches run back to back on
every rank of both pipelines, and loss and gradients still equal plain autograd's (<= 1e-5) on
the tied examples/gpt.py (its embedding and head tie stages 0 and D-1 across the replicas), a
tied Hugging Face GPT-2 and the untied tiny Llama, in the interpreter (sliced and not, an odd
number of micro-batches included) and under torchrun on gloo."""

from __future__ import annotations

import copy

import pytest

from tests.executors.dist_harness import torchrun_verified
from tests.executors.real import real_plan
from tests.executors.test_chimera_ties import SEQ, TOL, fresh, paths, plan_for  # noqa: F401  (paths: a fixture)
from tpc.compiler.schedules.chimera import forward_groups
from tpc.executors.interpreter import interpret
from tpc.executors.oracle import batch_reference, gradient_error
from tpc.executors.options import RunOptions
from tpc.executors.training.batches import RandomTokens
from tpc.ir.nodes import COMPUTE_OPS, Op

NAME = "chimera-doubling"


def assert_doubled(plan) -> None:
    """Every pair's forwards are adjacent among its rank's compute instructions."""
    h = plan.header
    pairs = [g for g in forward_groups(h, doubling=True) if len(g) == 2]
    assert pairs and h.replicas == 2
    for prog in plan.ranks:
        fwd = [(i.stage, i.mb, i.slice) for i in prog.instrs if i.op in COMPUTE_OPS and i.op is not Op.RECOMPUTE]
        for a, b in pairs:
            for s, m, i in fwd:
                if m == a:
                    assert fwd[fwd.index((s, a, i)) + 1] == (s, b, i), (prog.rank, a, b)


def check_exact(plan, model, sliced) -> None:
    h = plan.header
    reference = copy.deepcopy(model)
    result = interpret(plan, RunOptions(steps=1), model=model, sliced=sliced)
    ref_loss, ref_grads, _ = batch_reference(reference, RandomTokens(0, h.shape.batch, SEQ, h.shape.vocab).get(0))
    assert set(result.first_grads) == set(ref_grads)
    worst, where = gradient_error(result.first_grads, ref_grads)
    assert worst <= TOL, (worst, where)
    assert abs(result.losses[0] - ref_loss) <= TOL * abs(ref_loss)


@pytest.mark.parametrize("name,slices,dp,mbs", [("gpt", "1", 1, 8), ("gpt", "2,9,5", 1, 8), ("hf-gpt2", "3", 2, 5)])
def test_tied_models_match_autograd_in_the_interpreter(name, slices, dp, mbs, paths):  # noqa: F811
    plan = plan_for(name, paths, stages=4, microbatches=mbs, slices=slices, schedule=NAME, dp=dp,
                    batch=2 * mbs * dp)
    assert [t.stages for t in plan.header.ties] == [(0, 3)]
    assert_doubled(plan)
    check_exact(plan, *fresh(name, paths))


@pytest.mark.parametrize("stages,slices,mbs", [(2, "1", 4), (4, "2,9,5", 7)])
def test_an_untied_model_matches_autograd_in_the_interpreter(stages, slices, mbs):
    from tests.executors.real import fresh_model

    plan = real_plan("llama", seq_len=SEQ, stages=stages, microbatches=mbs, slices=slices, schedule=NAME, batch=2 * mbs)
    assert not plan.header.ties
    assert_doubled(plan)
    check_exact(plan, *fresh_model("llama", SEQ))


@pytest.mark.parametrize("which", ["gpt", "llama"])
def test_torchrun_gloo_matches_autograd_and_the_interpreter(which, paths, tmp_path):  # noqa: F811
    """`tpc run` under torchrun, one process per rank: --verify-grads on the first step and 3
    clipped steps' losses equal the interpreter's; the tied examples/gpt.py on 4 ranks and the
    untied tiny Llama on 2."""
    if which == "gpt":
        plan = plan_for("gpt", paths, stages=4, microbatches=8, slices="2", schedule=NAME, batch=16)
        model, sliced = fresh("gpt", paths)
    else:
        from tests.executors.real import fresh_model

        plan = real_plan("llama", seq_len=SEQ, stages=2, microbatches=4, slices="2,9,5", schedule=NAME, batch=8)
        model, sliced = fresh_model("llama", SEQ)
    assert_doubled(plan)
    rows = torchrun_verified(plan, tmp_path)
    res = interpret(plan, RunOptions(steps=3, grad_clip=0.5), model=model, sliced=sliced)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(abs(r["loss"] - b) <= TOL * b for r, b in zip(rows, res.losses)), (rows, res.losses)
