"""nanoGPT's training loop pipelined with tpc (examples/nanogpt_train/train_tpc.py, a copy of
nanoGPT's train.py with the lines docs/library.md shows changed) against nanoGPT's own
train.py in one process: the same losses, validation loss and weights after the steps."""

from __future__ import annotations

import torch

from tests.library.nanogpt_runs import checkpoint, config, losses, run, workdir


def _compare(tmp_path, *, accumulation: int, eval_iters: int, slices: int, iters: int = 4):
    work = workdir(tmp_path)
    args = config(max_iters=iters, accumulation=accumulation, eval_iters=eval_iters)
    plain = run(work, "train.py", args)
    want, want_val = checkpoint(work)
    piped = run(work, "train_tpc.py", args + ([f"--slices={slices}"] if slices != 1 else []), ranks=2)
    got, got_val = checkpoint(work, ranks=2)
    # nanoGPT prints each iteration's loss to 4 decimals (with accumulation, its last micro-step's
    # loss; tpc's step gives the whole batch's); the saved validation loss is exact
    assert len(losses(piped)) == len(losses(plain)) == iters + 1, (piped[-1500:], plain[-1500:])
    if accumulation == 1:
        assert losses(piped) == losses(plain), (piped[-1500:], plain[-1500:])
    if eval_iters:
        assert abs(got_val - want_val) <= 1e-5 * abs(want_val), (got_val, want_val)
    names = {n for n, _ in _parameters(want)}
    assert names <= set(got), sorted(names - set(got))
    for name in names:
        assert torch.allclose(got[name], want[name], rtol=0, atol=1e-5), (name, (got[name] - want[name]).abs().max())


def _parameters(state):
    # the tied head (lm_head.weight) is saved under both names by nanoGPT; tpc keeps the first
    return [(n, v) for n, v in state.items() if n != "lm_head.weight" and not n.endswith(".attn.bias")]


def test_the_pipelined_nanogpt_loop_matches_nanogpt_in_one_process(tmp_path):
    """Two stages under torchrun (gloo), two token slices, one micro-batch: losses, the
    validation loss and the weights after 4 iterations equal nanoGPT's single-process run's."""
    _compare(tmp_path, accumulation=1, eval_iters=2, slices=2)


def test_gradient_accumulation_becomes_the_plans_micro_batches(tmp_path):
    """nanoGPT's 2 accumulation steps are the plan's 2 micro-batches: the same weights. (No
    evaluation: its batches would be the plan's whole batch, twice nanoGPT's.)"""
    _compare(tmp_path, accumulation=2, eval_iters=0, slices=1)
