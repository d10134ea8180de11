"""The reference interpreter on the real example models (tiny GPT, nanoGPT, Llama) against plain
single-process autograd on the unsliced model: every schedule x stages x slices x micro-batches
on GPT, a sample on the others, several training steps, and the activation counts the schedules
promise."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from tests.executors.real import fresh_model, initial_model, real_plan
from tpc.executors.training.batches import RandomTokens
from tpc.executors.interpreter import interpret
from tpc.executors.oracle import gradient_error, batch_reference
from tpc.executors.options import RunOptions
from tpc.executors.training.optimizer import OptimSpec, build_optimizer

TOL = 1e-5
SEQ = 16


def run_and_check(name: str, **plan_kw):
    plan = real_plan(name, seq_len=SEQ, **plan_kw)
    model, sliced = fresh_model(name, SEQ)
    reference = copy.deepcopy(model)
    result = interpret(plan, model=model, sliced=sliced)
    h = plan.header
    ref_loss, ref_grads, _ = batch_reference(reference, RandomTokens(0, h.shape.batch, SEQ, h.shape.vocab).get(0))
    worst, where = gradient_error(result.first_grads, ref_grads)
    assert worst <= TOL, (worst, where)
    assert abs(result.losses[0] - ref_loss) <= TOL * abs(ref_loss)
    return result


GPT_CASES = list(itertools.product(["gpipe", "1f1b", "terapipe", "seq1f1b"], [1, 2, 4], ["1", "3", "8", "2,9,5"], [1, 4]))


@pytest.mark.parametrize("schedule,stages,slices,mbs", GPT_CASES)
def test_gpt_every_schedule_matches_autograd(schedule, stages, slices, mbs):
    run_and_check("gpt", schedule=schedule, stages=stages, slices=slices, microbatches=mbs)


@pytest.mark.parametrize("name", ["llama", "nanogpt"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "terapipe", "seq1f1b"])
def test_other_models_match_autograd(name, schedule):
    run_and_check(name, schedule=schedule, stages=2, slices="2,9,5", microbatches=2)


@pytest.mark.parametrize("name,schedule,stages,slices", [
    ("long_conv", "1f1b", 3, "1,1,2,1,3,8"),  # kernel 7: the carried state spans several slices
    ("rwkv", "seq1f1b", 2, "3,5,8"),
    ("alibi", "terapipe", 2, "1,7,8"),
])
def test_carried_state_and_position_biases_match_autograd(name, schedule, stages, slices):
    """Short causal mixers' state and ALiBi's rebuilt bias through the plan's own instructions
    (receives, frees, the step), not only a stage's runtime."""
    run_and_check(name, schedule=schedule, stages=stages, slices=slices, microbatches=2)


@pytest.mark.parametrize("schedule", ["1f1b", "seq1f1b"])
def test_gpt_data_parallel(schedule):
    run_and_check("gpt", schedule=schedule, stages=2, slices="3", microbatches=2, batch=8, dp=2)


def test_seq1f1b_holds_fewer_activations_than_terapipe():
    peak = {s: run_and_check("gpt", schedule=s, stages=2, slices="8", microbatches=4).peak_live
            for s in ("terapipe", "seq1f1b")}
    assert max(peak["seq1f1b"]) < max(peak["terapipe"]), peak
    assert max(peak["terapipe"]) == 4 * 8  # every slice of every micro-batch is live at once


def test_executors_build_the_same_initial_weights():
    a, _ = fresh_model("gpt", SEQ)
    b = initial_model("gpt", SEQ)
    for (n, p), (m, q) in zip(a.named_parameters(), b.named_parameters()):
        assert n == m and torch.equal(p, q)


def test_weights_after_several_steps_match_plain_training():
    # SGD: in GPT the gradient of the attention key bias is zero in exact arithmetic (softmax
    # ignores a shift shared by all keys) and ~1e-11 of rounding noise in practice; AdamW divides
    # by sqrt(v) and turns any such noise into a full-size step of random sign, in the plain run
    # as much as in the sliced one. (AdamW's equality is checked on the fake model, whose
    # gradients have no exact zeros.)
    spec = OptimSpec("sgd", lr=0.5)
    plan = real_plan("gpt", schedule="seq1f1b", stages=2, slices="2,9,5", microbatches=2, seq_len=SEQ)
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
    # the whole model's state: a tie's every name, and the buffers, load into the model
    ref.load_state_dict(result.state_dict)
    assert torch.equal(result.state_dict["lm_head.weight"], result.state_dict["transformer.wte.weight"])
    assert not torch.allclose(final["transformer.h.0.attn.c_attn.weight"],
                              model.transformer.h[0].attn.c_attn.weight)  # it trained


def test_bf16_autocast_reaches_the_compute():
    """`interpret(bf16=True)` (what `tpc run --interpret --bf16` passes) computes under bf16
    autocast: the loss moves off the fp32 one by bf16 rounding, and no further. (CPU autocast
    stands in for CUDA's here.)"""
    plan = real_plan("gpt", seq_len=SEQ, schedule="terapipe", stages=2, slices="3", microbatches=2)
    losses = {}
    for bf16 in (False, True):
        model, sliced = fresh_model("gpt", SEQ)
        losses[bf16] = interpret(plan, RunOptions(bf16=bf16), model=model, sliced=sliced).losses[0]
    assert losses[True] != losses[False]
    assert abs(losses[True] - losses[False]) <= 2e-2 * abs(losses[False])


def test_kv_gradients_are_summed_in_fp32_under_bf16():
    """Under bf16 autocast the KV cache is bf16; the gradients later slices send into earlier
    slices' keys/values are still summed in an fp32 buffer."""
    from tpc.executors.stage_runtime import StageRuntime

    _, sliced = fresh_model("gpt", SEQ)
    stage = sliced.stage_module(1, sliced.num_units)
    rt = StageRuntime(stage, 1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for i, lo in enumerate((0, 5, 11)):
            hi = (5, 11, SEQ)[i]
            rt.forward(0, i, torch.randn(2, hi - lo, sliced.hidden_size), lo,
                       targets=torch.randint(0, 256, (2, hi - lo)), capacity=SEQ)
        assert {t.dtype for t in rt.kv_buffers(0)} == {torch.bfloat16}
        rt.backward(0, 2)
    assert {acc.g.dtype for acc in rt._caches[0].grad} == {torch.float32}
