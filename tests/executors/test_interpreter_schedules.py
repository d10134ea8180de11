"""Every schedule added for interleaved, looped, zero-bubble and token-sliced pipelines, and
activation recomputation, run by the reference interpreter on the real example models: the
loss and every gradient equal plain single-process autograd on the unsliced model (<= 1e-5),
for 1 slice, 3 equal slices and unequal slices, with several chunks per rank and with one."""

from __future__ import annotations

import copy
import itertools

import pytest

from tests.executors.real import fresh_model, real_plan
from tpc.executors.training.batches import RandomTokens
from tpc.executors.interpreter import interpret
from tpc.executors.options import RunOptions
from tpc.executors.oracle import batch_reference, gradient_error
from tpc.executors.training.optimizer import OptimSpec, build_optimizer

TOL = 1e-5
SEQ = 16
NEW = ["interleaved", "looped-bfs", "zb-h1", "zb-h2", "seq-zb", "seq-interleaved"]
SLICES = ["1", "3", "2,9,5"]


def run_and_check(name: str = "gpt", options: RunOptions | None = None, **plan_kw):
    """Interpret the plan of tiny_NAME (as `options` say) and check its first step against plain
    autograd on the unsliced model (<= 1e-5)."""
    plan = real_plan(name, seq_len=SEQ, **plan_kw)
    model, sliced = fresh_model(name, SEQ)
    reference = copy.deepcopy(model)
    result = interpret(plan, options, model=model, sliced=sliced)
    h = plan.header
    ref_loss, ref_grads, _ = batch_reference(reference, RandomTokens(0, h.shape.batch, SEQ, h.shape.vocab).get(0))
    worst, where = gradient_error(result.first_grads, ref_grads)
    assert worst <= TOL, (worst, where)
    assert abs(result.losses[0] - ref_loss) <= TOL * abs(ref_loss)
    return plan, result


@pytest.mark.parametrize("schedule,slices", list(itertools.product(NEW, SLICES)))
def test_two_chunks_per_rank_match_autograd(schedule, slices):
    """4 stages on 2 ranks, stage s on rank s mod 2: two chunks per rank."""
    plan, _ = run_and_check(schedule=schedule, stages=4, ranks=2, slices=slices, microbatches=2)
    assert [len(plan.header.stages_of_rank(r)) for r in range(2)] == [2, 2]


@pytest.mark.parametrize("schedule,slices", list(itertools.product(["zb-h1", "zb-h2", "seq-zb"], SLICES)))
def test_split_backward_one_stage_per_rank_matches_autograd(schedule, slices):
    plan, _ = run_and_check(schedule=schedule, stages=2, slices=slices, microbatches=3, batch=6)
    ops = {i.op.value for p in plan.ranks for i in p.instrs}
    assert {"backward-input", "backward-weight"} <= ops and "backward" not in ops


@pytest.mark.parametrize("name", ["llama", "nanogpt"])
@pytest.mark.parametrize("schedule", ["interleaved", "seq-zb"])
def test_other_models_match_autograd(name, schedule):
    run_and_check(name, schedule=schedule, stages=4, ranks=2, slices="2,9,5", microbatches=2)


@pytest.mark.parametrize("schedule", ["seq-zb", "interleaved"])
def test_data_parallel(schedule):
    run_and_check(schedule=schedule, stages=4, ranks=2, slices="3", microbatches=2, batch=8, dp=2)


@pytest.mark.parametrize("schedule,slices", [("1f1b", "2,9,5"), ("seq-zb", "2,9,5"), ("interleaved", "3"),
                                             ("seq1f1b", "1")])
def test_full_recomputation_matches_autograd_and_holds_one_graph(schedule, slices):
    ranks = 2 if schedule == "interleaved" else None
    stages = 4 if ranks else 2
    plan, result = run_and_check(schedule=schedule, stages=stages, ranks=ranks, slices=slices,
                                 microbatches=2, recompute="full")
    ops = [i for p in plan.ranks for i in p.instrs]
    assert sum(i.op.value == "recompute" for i in ops) == sum(i.checkpoint for i in ops) > 0
    if schedule != "seq-zb":  # a split backward keeps its recomputed graph until its W
        assert max(result.peak_live) == 1


def test_stage_aware_recomputation_matches_autograd():
    plan, result = run_and_check(schedule="1f1b", stages=2, slices="2,9,5", microbatches=3, batch=6,
                                 recompute={0: "full", 1: "none"})
    _, plain = run_and_check(schedule="1f1b", stages=2, slices="2,9,5", microbatches=3, batch=6)
    assert all(i.checkpoint for i in plan.ranks[0].instrs if i.op.value == "forward")
    assert not any(i.checkpoint for i in plan.ranks[1].instrs)
    assert result.peak_live[0] == 1 < plain.peak_live[0] and result.peak_live[1] == plain.peak_live[1]


def test_weights_after_several_steps_match_plain_training():
    spec = OptimSpec("sgd", lr=0.5)
    plan = real_plan("gpt", schedule="seq-zb", stages=4, ranks=2, slices="2,9,5", microbatches=2, seq_len=SEQ,
                     recompute={0: "full", 1: "none", 2: "full", 3: "none"})
    model, sliced = fresh_model("gpt", SEQ)
    ref = copy.deepcopy(model)
    result = interpret(plan, RunOptions(steps=3, optim=spec, lr_schedule="constant"), model=model, sliced=sliced)
    opt = build_optimizer(ref.named_parameters(), spec)
    losses = []
    for step in range(3):
        loss, grads, _ = batch_reference(ref, RandomTokens(0, 4, SEQ, plan.header.shape.vocab).get(step))
        for n, p in ref.named_parameters():
            p.grad = grads[n]
        opt.step()
        losses.append(loss)
    assert result.losses == pytest.approx(losses, rel=TOL)
    final = dict(ref.named_parameters())
    worst, where = gradient_error({n: result.state_dict[n] for n in final}, {n: final[n].detach() for n in final})
    assert worst <= TOL, (worst, where)


# ------------------------------------------------------------------- V-shaped: zbv, dualpipev

V_SHAPED = [("zbv", 2), ("dualpipev", 4)]  # (schedule, micro-batches: DualPipeV needs 2 x ranks)


@pytest.mark.parametrize("schedule,mbs", V_SHAPED)
@pytest.mark.parametrize("slices", SLICES)
def test_v_shaped_schedules_match_autograd(schedule, mbs, slices):
    """4 stages on 2 ranks in a V (stage i and 3-i on rank i), 1, 3 and unequal slices."""
    plan, _ = run_and_check(schedule=schedule, stages=4, ranks=2, slices=slices, microbatches=mbs, batch=4)
    assert [plan.header.stages_of_rank(r) for r in range(2)] == [(0, 3), (1, 2)]


@pytest.mark.parametrize("schedule,mbs", V_SHAPED)
def test_v_shaped_schedules_data_parallel(schedule, mbs):
    run_and_check(schedule=schedule, stages=4, ranks=2, slices="2,9,5", microbatches=mbs, batch=8, dp=2)


def test_v_shaped_schedule_on_another_model():
    run_and_check("llama", schedule="zbv", stages=4, ranks=2, slices="2,9,5", microbatches=3, batch=6)


@pytest.mark.parametrize("stages,dp,mbs", [(2, 1, 2), (4, 1, 4), (4, 2, 6), (2, 2, 3)])
@pytest.mark.parametrize("slices", SLICES)
def test_chimera_matches_autograd(stages, dp, mbs, slices):
    """Two pipelines over weight replicas (the untied tiny Llama): pp x dp x {1, 3, unequal slices},
    an odd number of micro-batches included (one pipeline runs one more)."""
    plan, result = run_and_check("llama", schedule="chimera", stages=stages, dp=dp, slices=slices,
                                 microbatches=mbs, batch=2 * mbs * dp)
    assert plan.header.replicas == 2 and plan.header.mesh.data == dp
    assert sorted(result.first_grads) == sorted(n for n, _ in fresh_model("llama", SEQ)[0].named_parameters())


@pytest.mark.parametrize("slices", ["1", "2,9,5"])
def test_chimera_clips_by_the_global_norm_of_one_copy_of_each_weight(slices):
    """Chimera keeps two replicas of every stage; the global gradient norm counts each weight
    once, so it, the loss and the weights after a clipped step equal 1F1B's."""
    out = {}
    for schedule in ("1f1b", "chimera"):
        plan = real_plan("llama", stages=4, microbatches=4, slices=slices, schedule=schedule, batch=8)
        model, sliced = fresh_model("llama")
        norms = []
        result = interpret(plan, RunOptions(steps=2, grad_clip=0.05, optim=OptimSpec("sgd", 0.5)), model=model,
                           sliced=sliced, on_step=lambda step, loss, info: norms.append(info["grad_norm"]))
        out[schedule] = (result.losses, norms, result.state_dict)
    (l1, n1, p1), (l2, n2, p2) = out["1f1b"], out["chimera"]
    assert l2 == pytest.approx(l1, rel=1e-6) and n2 == pytest.approx(n1, rel=1e-5) and n1[0] > 0.05
    assert gradient_error(p2, p1)[0] <= 1e-5
