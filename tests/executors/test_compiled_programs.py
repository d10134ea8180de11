"""`--compile`: every stage runs its programs compiled by inductor (tpc.compiler.programs), on
the CPU here (inductor's C++ backend), and trains as plain single-process autograd does: the
loss and every gradient within 1e-5 of the unsliced model's, whole and split backward,
evaluation and recomputation, in the interpreter and over gloo. Inductor fuses and reorders
floating-point sums, so the numbers are close, not bitwise (the eager programs are bitwise:
test_stage_programs.py)."""

from __future__ import annotations

import pytest
import torch

from tests.executors.real import fresh_model, real_plan
from tests.executors.test_interpreter_schedules import run_and_check
from tpc.compiler.programs import stage_programs
from tpc.executors.interpreter import interpret
from tpc.executors.options import RunOptions

TOL = 1e-5
SEQ = 16


def compiled_run(name: str = "gpt", options: RunOptions | None = None, **plan_kw):
    """`run_and_check` of the interpreter's schedule tests, with every stage compiled."""
    return run_and_check(name, options or RunOptions(compile=True, quiet=True), **plan_kw)


def _compiled_shapes() -> set:
    return {key[1] for key, progs in stage_programs._DERIVED.items() if key[3].compile}


def test_a_split_backward_plan_runs_compiled_and_exact():
    """zb-h1 splits every backward: the input and weight halves run compiled, each slice shape
    compiled before step 1 (no shape is first met in a step)."""
    plan, _ = compiled_run(schedule="zb-h1", stages=2, slices="2", microbatches=2)
    ops = {i.op.value for p in plan.ranks for i in p.instrs}
    assert {"backward-input", "backward-weight"} <= ops
    shapes = _compiled_shapes()
    assert {(s.tokens, s.offset) for s in shapes} >= {(8, 0), (8, 8)}


def test_a_shape_the_plan_does_not_have_is_compiled_apart_not_reused():
    """A slice of another length gets programs of its own: a program runs only the shape it
    was compiled for (numbers are never those of another shape)."""
    from tpc.compiler.programs.joint import Shape

    a = Shape.of(torch.zeros(2, 8, dtype=torch.long), 0, [], [])
    b = Shape.of(torch.zeros(2, 4, dtype=torch.long), 0, [], [])
    c = Shape.of(torch.zeros(2, 8, dtype=torch.long), 8, [], [])
    assert len({a, b, c}) == 3


# the slow tier: every schedule family compiled, on unequal slices. Programs are compiled once
# a process for each stage and slice shape and shared by the runs that have them (the 2-stage
# schedules share theirs, the 4-stage ones theirs): compiling is what costs here
GRID = {
    "1f1b": dict(schedule="1f1b", stages=2, microbatches=2),
    "seq1f1b": dict(schedule="seq1f1b", stages=2, microbatches=2),
    "zb-h2": dict(schedule="zb-h2", stages=2, microbatches=3, batch=6),
    "interleaved": dict(schedule="interleaved", stages=4, ranks=2, microbatches=2),
    "zbv": dict(schedule="zbv", stages=4, ranks=2, microbatches=2),
}
UNEQUAL = "5,11"


@pytest.mark.parametrize("case", list(GRID))
def test_every_schedule_runs_compiled_and_exact(case):
    compiled_run(slices=UNEQUAL, **GRID[case])


def test_chimera_runs_compiled_and_exact():
    """Two pipelines over weight replicas (llama: chimera refuses tied weights)."""
    compiled_run("llama", schedule="chimera", stages=2, slices=UNEQUAL, microbatches=2)


def test_recomputation_and_data_parallel_run_compiled_and_exact():
    compiled_run(schedule="1f1b", stages=2, slices=UNEQUAL, microbatches=2, recompute="full", dp=2, batch=8)


def test_code_nobody_here_wrote_runs_compiled_and_exact():
    """Llama in torchtitan's style (complex rotary table, grouped-query attention) with its
    backward split, and nanoGPT, compiled."""
    compiled_run("llama", schedule="zb-h1", stages=2, slices=UNEQUAL, microbatches=2)
    compiled_run("nanogpt", schedule="1f1b", stages=2, slices="3", microbatches=2)


def test_the_stride_of_a_dimension_of_one_row_does_not_make_another_shape():
    """One sequence per micro-batch: a slice of a longer activation and an activation received
    alone differ only in the stride of their row dimension, which no program steps along."""
    from tpc.compiler.programs.joint import Shape

    whole = torch.zeros(1, 64, 32)
    assert Shape.of(whole[:, 8:16], 8, [], []) == Shape.of(torch.zeros(1, 8, 32), 8, [], [])
    assert Shape.of(torch.zeros(2, 64, 32)[:, 8:16], 8, [], []) != Shape.of(torch.zeros(2, 8, 32), 8, [], [])


def test_torchrun_compiled_matches_autograd(tmp_path):
    """`torchrun ... tpc run PLAN --compile --verify-grads` on two gloo ranks: each rank compiles
    its stage's programs before step 1, says so, and the first step's gradients are autograd's."""
    import os
    import subprocess
    import sys

    from tests.executors.dist_harness import free_port, tpc_command
    from tpc.ir.printer import print_plan

    plan = tmp_path / "plan.tpir"
    plan.write_text(print_plan(real_plan("gpt", seq_len=SEQ, schedule="zb-h1", stages=2, slices="5,11",
                                         microbatches=2)), encoding="utf-8")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "--no-python", tpc_command(), "run", str(plan), "--compile", "--verify-grads",
           "--steps", "2", "--timeout", "300"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 2/2  loss" in done.stdout
    assert done.stdout.count("verify-grads:") == 1 and ": ok" in done.stdout
    assert "slice shapes compiled in" in done.stderr and "not one the plan prepared" not in done.stderr


def test_a_compiled_profile_times_the_compiled_programs(monkeypatch):
    """`tpc profile --compile`: every point's times are the compiled programs' (each point's
    shape compiled in its warm-up), and the profile says so. One point per unit here."""
    from tests.executors.real import model_file
    from tpc.executors import profile as profiling

    monkeypatch.setattr(profiling, "grid_lengths", lambda L: [L])
    monkeypatch.setattr(profiling, "grid_contexts", lambda L, l: [0])
    before = len(_compiled_shapes())
    prof = profiling.profile_model(model_file("gpt"), 8, [1], warmup=0, repeats=1, compile=True)
    assert any("compiled by inductor" in n for n in prof.notes)
    assert all(s[3] > 0 and s[4] > 0 for u in prof.units for s in u.samples)  # forward, backward timed
    assert len(_compiled_shapes()) > before  # the units' programs were compiled


def test_the_evaluation_program_runs_compiled_and_gives_the_eager_loss(tmp_path):
    """The plan's forward-only evaluation program through its compiled forward-only programs
    (prepared before the first evaluation): the validation loss is the eager one's."""
    import dataclasses

    import numpy as np

    from tpc.compiler.lowering.eval_program import eval_program
    from tpc.executors.training.eval_data import EvalBatches

    plan = real_plan("gpt", seq_len=SEQ, schedule="1f1b", stages=2, slices="2", microbatches=2)
    plan = dataclasses.replace(plan, eval=eval_program(plan.header))
    val = tmp_path / "val.bin"
    np.random.default_rng(1).integers(0, 256, 2000).astype(np.uint16).tofile(val)
    losses = {}
    for compiled in (False, True):
        model, sliced = fresh_model("gpt", SEQ)
        batches = EvalBatches(str(val), batch=4, seq=SEQ, vocab=256, count=2)
        result = interpret(plan, RunOptions(steps=1, eval_data=str(val), compile=compiled, quiet=True),
                           model=model, sliced=sliced, eval_batches=batches)
        losses[compiled] = [loss for _, loss in result.eval_losses]
    assert len(losses[True]) == 2
    for eager, compiled in zip(losses[False], losses[True]):
        assert abs(compiled - eager) <= TOL * abs(eager)
    assert any(not key[1].grad for key in stage_programs._DERIVED if key[3].compile)  # forward-only programs
