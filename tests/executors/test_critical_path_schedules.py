"""Merak's critical-path 1F1B (1f1b-pre-recompute, 1f1b-last-no-recompute, 1f1b-critical-path)
under both executors: the first step's loss and gradients equal plain autograd on the unsliced
model (<= 1e-5), in the interpreter for 2 and 4 stages and 1 slice or unequal slices, and in
one torchrun launch (gloo, 4 ranks, also under NCCL's rules), equal to the interpreter's too."""

from __future__ import annotations

import itertools

import pytest

from tests.executors.test_distributed_models import _check, _launch
from tests.executors.test_interpreter_schedules import run_and_check
from tpc.ir.nodes import Op

VARIANTS = ("1f1b-pre-recompute", "1f1b-last-no-recompute", "1f1b-critical-path")


@pytest.mark.parametrize("schedule,stages,slices", list(itertools.product(VARIANTS, [2, 4], ["1", "2,9,5"])))
def test_interpreter_matches_autograd(schedule, stages, slices):
    plan, _ = run_and_check(schedule=schedule, stages=stages, slices=slices, microbatches=4)
    last = plan.ranks[-1].instrs
    recomputes_last = any(i.op is Op.RECOMPUTE for i in last)
    assert recomputes_last == (schedule == "1f1b-pre-recompute")
    assert any(i.op is Op.RECOMPUTE for i in plan.ranks[0].instrs)


FOUR = [
    dict(plan=dict(schedule="1f1b-critical-path", stages=4, slices="2,9,5", microbatches=4, seq_len=16)),
    dict(plan=dict(schedule="1f1b-critical-path", stages=4, slices="1", microbatches=4, seq_len=16), comm="nccl"),
    dict(plan=dict(schedule="1f1b-last-no-recompute", stages=4, slices="3", microbatches=4, seq_len=16)),
]


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _launch(tmp_path_factory, 4, FOUR)


@pytest.mark.parametrize("i", range(len(FOUR)))
def test_torchrun_gloo_matches_autograd_and_the_interpreter(four, i):
    _check(FOUR[i], four[i])
