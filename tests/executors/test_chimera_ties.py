"""Chimera on the models it was built for (issue #37): GPT-2, whose embedding and head share one
weight, so stages 0 and D-1 tie a parameter while each has two weight replicas (on ranks 0 and
D-1, crosswise). The tie's one `reduce-tied` covers every rank holding a replica of a tied stage
and `reduce-replicas` leaves the tied parameter out: loss and gradients equal plain autograd's
(<= 1e-5) on examples/gpt.py and a Hugging Face GPT-2 built from a config, in the interpreter
and under torchrun on gloo, and with a tensor axis; 3 clipped steps equal 1F1B's losses, gradient
norms and weights."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from tests.executors.dist_harness import torchrun_verified
from tests.executors.real import real_plan, traced
from tpc.executors.interpreter import interpret
from tpc.executors.oracle import batch_reference, gradient_error
from tpc.executors.options import RunOptions
from tpc.executors.training.batches import RandomTokens
from tpc.executors.training.export import export_state_dict
from tpc.executors.training.optimizer import OptimSpec
from tpc.ir.nodes import Op

TOL = 1e-5
SEQ = 16
GPT = str(Path(__file__).resolve().parents[2] / "examples" / "gpt.py")


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    from tests.compiler.frontend.hf_models import config_dict

    config = tmp_path_factory.mktemp("gpt2") / "config.json"
    config.write_text(json.dumps(config_dict("gpt2")))
    return {"gpt": GPT, "hf-gpt2": str(config)}


def plan_for(name, paths, **kw):
    return real_plan(name, path=paths[name], seq_len=SEQ, **kw)


def fresh(name, paths):
    model, sliced, _ = traced(paths[name], SEQ)
    return copy.deepcopy(model), sliced


def check_tied_plan(plan) -> None:
    """Stages 0 and 3 tie the embedding and the head; ranks 0 and 3 reduce the tie once and each
    replicated stage's other parameters once."""
    h = plan.header
    assert h.replicas == 2 and [t.stages for t in h.ties] == [(0, 3)]
    assert h.tie_ranks(h.ties[0].name) == (0, 3)
    for prog in plan.ranks:
        ops = [i.op for i in prog.instrs]
        assert ops.count(Op.REDUCE_TIED) == (prog.rank in (0, 3)) and ops.count(Op.REDUCE_REPLICAS) == 2


@pytest.mark.parametrize("name", ["gpt", "hf-gpt2"])
@pytest.mark.parametrize("slices,dp,mbs", [("1", 1, 4), ("2,9,5", 1, 4), ("3", 2, 6)])
def test_interpreter_matches_autograd(name, slices, dp, mbs, paths):
    plan = plan_for(name, paths, stages=4, microbatches=mbs, slices=slices, schedule="chimera", dp=dp,
                    batch=2 * mbs * dp)
    check_tied_plan(plan)
    model, sliced = fresh(name, paths)
    reference = copy.deepcopy(model)
    result = interpret(plan, RunOptions(steps=1), model=model, sliced=sliced)
    h = plan.header
    ref_loss, ref_grads, _ = batch_reference(reference, RandomTokens(0, h.shape.batch, SEQ, h.shape.vocab).get(0))
    assert set(result.first_grads) == set(ref_grads)
    worst, where = gradient_error(result.first_grads, ref_grads)
    assert worst <= TOL, (worst, where)
    assert abs(result.losses[0] - ref_loss) <= TOL * abs(ref_loss)


@pytest.mark.parametrize("name", ["gpt", "hf-gpt2"])
def test_three_clipped_steps_equal_1f1b(name, paths):
    """The global norm counts the tied weight once (not once per copy on ranks 0 and 3): the
    losses, norms and weights of 3 clipped steps are 1F1B's."""
    out = {}
    for schedule in ("1f1b", "chimera"):
        plan = plan_for(name, paths, stages=4, microbatches=4, slices="2,9,5", schedule=schedule, batch=8)
        model, sliced = fresh(name, paths)
        norms = []
        result = interpret(plan, RunOptions(steps=3, grad_clip=0.05, optim=OptimSpec("sgd", 0.5)), model=model,
                           sliced=sliced, on_step=lambda step, loss, info: norms.append(info["grad_norm"]))
        out[schedule] = (result.losses, norms, result.state_dict)
    (l1, n1, p1), (l2, n2, p2) = out["1f1b"], out["chimera"]
    assert l2 == pytest.approx(l1, rel=TOL) and n2 == pytest.approx(n1, rel=TOL) and n1[0] > 0.05
    assert set(p2) == set(p1) and gradient_error(p2, p1)[0] <= TOL


def test_torchrun_gloo_matches_autograd_and_the_interpreter(paths, tmp_path):
    """`tpc run` of chimera on the Hugging Face GPT-2 under torchrun, 4 processes: --verify-grads
    on the first step, 3 clipped steps' losses equal the interpreter's, and the checkpoint
    (the tied weight written once, by whichever ranks hold it) exported whole is the
    interpreter's model."""
    plan = plan_for("hf-gpt2", paths, stages=4, microbatches=4, slices="2,9,5", schedule="chimera", batch=8)
    check_tied_plan(plan)
    rows = torchrun_verified(plan, tmp_path)
    model, sliced = fresh("hf-gpt2", paths)
    norms = []
    res = interpret(plan, RunOptions(steps=3, grad_clip=0.5), model=model, sliced=sliced,
                    on_step=lambda step, loss, info: norms.append(info["grad_norm"]))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(abs(r["loss"] - b) <= TOL * b for r, b in zip(rows, res.losses)), (rows, res.losses)
    assert all(abs(r["grad_norm"] - n) <= TOL * n for r, n in zip(rows, norms)), (rows, norms)
    exported, _ = export_state_dict(tmp_path / "ck")
    assert set(exported) == set(res.state_dict)
    worst = max((float((exported[k] - w).abs().max()), k) for k, w in res.state_dict.items())
    assert worst[0] <= TOL, worst


def test_a_tensor_axis_matches_autograd():
    """Tied nanoGPT on pipe 2 x tensor 2: the tie, the replicas and the tensor parts together."""
    from tests.executors.real import model_file

    plan = real_plan("nanogpt", seq_len=SEQ, stages=2, slices="2", microbatches=2, schedule="chimera", tensor=2)
    h = plan.header
    assert h.replicas == 2 and h.mesh.tensor == 2 and [t.stages for t in h.ties] == [(0, 1)]
    model, sliced, _ = traced(model_file("nanogpt"), SEQ)
    result = interpret(plan, RunOptions(steps=1), model=copy.deepcopy(model), sliced=sliced)
    ref_loss, ref_grads, _ = batch_reference(copy.deepcopy(model),
                                             RandomTokens(0, h.shape.batch, SEQ, h.shape.vocab).get(0))
    worst, where = gradient_error(result.first_grads, ref_grads)
    assert worst <= TOL, (worst, where)
    assert abs(result.losses[0] - ref_loss) <= TOL * abs(ref_loss)
