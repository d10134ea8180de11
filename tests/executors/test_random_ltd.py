"""Random layerwise token dropping run by the executors: every rank draws each dropped unit's
kept tokens per (step, replica, micro-batch, slice) from the seeded generator
(tpc.compiler.random_ltd), its stages run those units on them (a dropped unit's KV cache holds the
kept tokens only), and the first step's loss and gradients equal the plain-PyTorch oracle's
(executors/random_ltd_oracle.py, <= 1e-5): nanoGPT (examples/nanogpt.py), the tiny Llama and a
Hugging Face Llama from a config (RoPE), unsliced and sliced, data-parallel, with recomputation,
under chimera and under the sequence-length curriculum, in the interpreter and under torchrun on
gloo (`tpc run --random-ltd ... --verify-grads`)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from tests.executors.dist_harness import free_port, tpc_command
from tests.executors.real import model_file, real_plan, traced
from tpc.compiler.random_ltd import RandomLTD
from tpc.executors.interpreter import interpret
from tpc.executors.options import RunOptions
from tpc.executors.oracle import batch_reference, gradient_error
from tpc.executors.random_ltd_oracle import ltd_reference
from tpc.executors.training.batches import RandomTokens
from tpc.ir.diagnostics import TpirError
from tpc.ir.printer import print_plan

SEQ, TOL = 16, 1e-5


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory) -> str:
    from tests.compiler.frontend.hf_models import config_dict

    config = tmp_path_factory.mktemp("llama") / "config.json"
    config.write_text(json.dumps(config_dict("llama", num_hidden_layers=3)))
    return str(config)


def ltd_for(sliced, **kw) -> RandomLTD:
    last = sliced.num_units - 1
    return RandomLTD(units=tuple(range(1, last)), min_value=5, max_value=13, require_steps=4, seq_per_step=2,
                     **kw)


def check(plan, path, ltd=None, recompute=False):
    model, sliced, _ = traced(path, SEQ)
    ltd = ltd or ltd_for(sliced)
    reference = copy.deepcopy(model)
    result = interpret(plan, RunOptions(steps=1, random_ltd=ltd), model=copy.deepcopy(model), sliced=sliced)
    h = plan.header
    tokens = RandomTokens(0, h.shape.batch, SEQ, h.shape.vocab).get(0)
    rows = [(r * h.replica_batch + h.microbatch_rows(m)[0], mb.size, r, mb.lengths)
            for r in range(h.mesh.data) for m, mb in enumerate(h.microbatches)]
    want = ltd_reference(reference, tokens, ltd, sliced.unit_labels, 0, rows)
    plain = batch_reference(copy.deepcopy(model), tokens)
    assert gradient_error(plain.grads, want.grads)[0] > 1e-2  # the dropping changed the step
    worst, where = gradient_error(result.first_grads, want.grads, want.unused)
    assert worst <= TOL, (worst, where)
    assert abs(result.losses[0] - want.loss) <= TOL * abs(want.loss)


@pytest.mark.parametrize("name", ["nanogpt", "llama"])
@pytest.mark.parametrize("slices,dp", [("1", 1), ("3", 1), ("2,9,5", 2)])
def test_interpreter_matches_the_oracle(name, slices, dp):
    plan = real_plan(name, seq_len=SEQ, stages=2, microbatches=2, slices=slices, schedule="1f1b", batch=4 * dp, dp=dp)
    check(plan, model_file(name))


def test_a_hugging_face_llama_with_rope_matches_the_oracle(hf_llama):
    plan = real_plan("hf-llama", path=hf_llama, seq_len=SEQ, stages=3, microbatches=2, slices="2,9,5",
                     schedule="1f1b", batch=4)
    check(plan, hf_llama)


def test_recomputed_and_chimera_stages_draw_the_same_tokens():
    path = model_file("nanogpt")
    plan = real_plan("nanogpt", seq_len=SEQ, stages=2, microbatches=2, slices="3", schedule="1f1b", batch=4,
                     recompute="full")
    check(plan, path)
    check(real_plan("nanogpt", seq_len=SEQ, stages=2, microbatches=4, slices="2,9,5", schedule="chimera", batch=8),
          path)


def test_a_split_backward_is_refused():
    path = model_file("nanogpt")
    model, sliced, _ = traced(path, SEQ)
    plan = real_plan("nanogpt", seq_len=SEQ, stages=2, microbatches=2, slices="1", schedule="zb-h1", batch=4)
    with pytest.raises(TpirError) as e:
        interpret(plan, RunOptions(steps=1, random_ltd=ltd_for(sliced)), model=copy.deepcopy(model), sliced=sliced)
    assert "eager autograd" in e.value.render()


def test_torchrun_gloo_verify_grads(tmp_path):
    """`tpc run --random-ltd 1:3 --random-ltd-schedule 5,13,4,2 --verify-grads` on 2 gloo ranks."""
    plan = real_plan("nanogpt", seq_len=SEQ, stages=2, microbatches=2, slices="2,9,5", schedule="1f1b", batch=4)
    path = tmp_path / "plan.tpir"
    path.write_text(print_plan(plan), encoding="utf-8")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "--no-python", tpc_command(), "run", str(path), "--steps", "2", "--verify-grads", "--timeout", "60",
           "--device", "cpu", "--random-ltd", "1:3", "--random-ltd-schedule", "5,13,4,2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "verify-grads: loss" in done.stdout and ": ok" in done.stdout, done.stdout[-2000:]


def test_with_the_sequence_length_curriculum_two_steps_equal_the_oracles(tmp_path):
    """DeepSpeed's CL + LTD: a bundle of lengths 8 and 16 under `fixed_linear:8:16:2`, so step 0
    runs 8 tokens and step 1 16, the kept count growing too (capped at the step's length). Each
    step's loss equals the oracle's on the same truncated batch, the oracle's weights updated by
    plain SGD in between."""
    import torch

    from tpc.cli.main import main
    from tpc.executors.run import CurriculumRun
    from tpc.executors.training.optimizer import OptimSpec
    from tpc.executors.training_loop import PlanSet

    path = model_file("nanogpt")
    bundle = tmp_path / "plans"
    assert main(["compile", path, "-o", str(bundle), "--seq-len", "8,16", "--batch", "4", "--stages", "2",
                 "--microbatches", "2", "--slices", "2", "-q"]) == 0
    model, sliced, _ = traced(path, SEQ)
    ltd = RandomLTD(units=(1, 2), min_value=6, max_value=12, require_steps=1, seq_per_step=2)
    lr = 0.5
    options = RunOptions(steps=2, optim=OptimSpec("sgd", lr, 0.0), lr_schedule="constant", random_ltd=ltd)
    run = CurriculumRun(str(bundle), options, "fixed_linear:8:16:2", "seqlen_truncate")
    batches = run.batches(options)
    result = interpret(PlanSet(run.plans, run.length_of, curriculum=True), options, model=copy.deepcopy(model),
                       batches=batches)
    oracle = copy.deepcopy(model)
    for step in range(2):
        h = run.plans[run.length_of(step)].header
        tokens = batches.get(step)
        assert tokens.shape[1] == h.shape.seq + 1 and h.shape.seq == (8 if step == 0 else 16)
        rows = [(h.microbatch_rows(m)[0], mb.size, 0, mb.lengths) for m, mb in enumerate(h.microbatches)]
        want = ltd_reference(oracle, tokens, ltd, sliced.unit_labels, step, rows)
        assert abs(result.losses[step] - want.loss) <= TOL * abs(want.loss), (step, result.losses, want.loss)
        with torch.no_grad():
            for n, p in oracle.named_parameters():
                p -= lr * want.grads[n]
