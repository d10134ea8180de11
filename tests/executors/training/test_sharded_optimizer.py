"""`--shard-optimizer` (ZeRO-1, executors/training/sharded_optimizer.py) trains as the unsharded
optimizer does, holds 1/d of its state per rank, and its checkpoints re-shard:

- pp x dp in the interpreter: the losses, gradients and weights of a sharded run equal the
  unsharded run's (within 1e-6; in fact to the bit: the sums and AdamW's arithmetic per element
  are the same), with global clipping on; 50 steps in the slow tier, with a tie kept whole;
- the same in real gloo processes (reduce-scatter and all-gather over the data-parallel group),
  against the interpreter's unsharded run (slow tier);
- the optimizer state of each rank is 1/d of the unsharded one (bytes of the state tensors);
- a checkpoint saved sharded at dp=2 resumes at dp=1 and at dp=2 unsharded, equal to a run that
  never stopped; and an unsharded one resumes sharded;
- `range_boxes` tiles any flat range of a tensor with rectangles, exactly once.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.executors.real import fresh_model, real_plan
from tpc.executors.interpreter import interpret
from tpc.executors.options import RunOptions
from tpc.executors.training.batches import RandomTokens
from tpc.executors.training.optimizer import OptimSpec
from tpc.executors.training.run_checkpoints import RunCheckpoints
from tpc.executors.training.shard_pieces import range_boxes
from tpc.executors.training_loop import CheckpointHook

TOL = 1e-6
PLAN = dict(stages=2, microbatches=2, slices="2", schedule="1f1b", dp=2, batch=4)


def options(steps: int, shard: bool, **kw) -> RunOptions:
    return RunOptions(steps=steps, optim=OptimSpec("adamw", lr=3e-3, weight_decay=0.1), grad_clip=0.5,
                      lr_schedule="constant", device="cpu", quiet=True, shard_optimizer=shard, **kw)


def run(plan, opts: RunOptions, name: str = "gpt", checkpoints=None, engines: list | None = None):
    model, sliced = fresh_model(name)
    seen = []

    def on_step(step, loss, info):
        seen.append(info["grad_norm"])

    result = interpret(plan, opts, model=model, sliced=sliced, batches=RandomTokens(0, 4, 16, 256),
                       checkpoints=checkpoints, on_step=on_step)
    return result, seen


def assert_close(a: dict, b: dict, tol: float = TOL) -> None:
    assert a.keys() == b.keys()
    for k in a:
        scale = max(1.0, float(a[k].abs().max()))
        assert float((a[k] - b[k]).abs().max()) <= tol * scale, k


def same_training(steps: int, name: str = "gpt") -> None:
    plan = real_plan(name, **PLAN)
    want, norms = run(plan, options(steps, False), name)
    got, norms_sharded = run(plan, options(steps, True), name)
    assert got.losses == pytest.approx(want.losses, rel=TOL, abs=0)
    assert norms_sharded == pytest.approx(norms, rel=TOL)
    assert_close(got.grads, want.grads)
    assert_close(got.state_dict, want.state_dict)


def test_sharded_training_equals_unsharded_pp2_dp2():
    same_training(4)


def test_sharded_training_equals_unsharded_over_50_steps():
    same_training(50)


def test_the_state_per_rank_is_halved_at_dp2():
    from tpc.executors.training.sharded_optimizer import optimizer_state_bytes

    plan = real_plan("gpt", **PLAN)
    sizes = {}
    for shard in (False, True):
        model, sliced = fresh_model("gpt")
        captured = []

        class Keep(CheckpointHook):  # the checkpoints hook sees the engines: keep them
            def start(self, engines):
                captured.extend(engines)
                return 0

        interpret(plan, options(1, shard), model=model, sliced=sliced, checkpoints=Keep())
        sizes[shard] = [(optimizer_state_bytes(e.optimizer.opt), e.optimizer) for e in captured]
    for (whole, _), (part, opt) in zip(sizes[False], sizes[True]):
        # the tie (embedding = head, on both pipeline ranks) is kept whole; the rest is halved
        # (AdamW's two fp32 moments, plus a step count per piece)
        kept = sum(8 * p.numel() + 4 for named in opt.whole.values() for _, p in named)
        pieces = sum(len(b.pieces) for b in opt.buckets.values())
        params = sum(len(b.params) for b in opt.buckets.values())
        assert part - kept - 4 * pieces == pytest.approx((whole - kept - 4 * params) / 2, abs=8 * 8)


# ------------------------------------------------------------------------------ checkpoints


def test_a_sharded_checkpoint_resumes_at_dp1_and_dp2_unsharded(tmp_path):
    """Saved sharded at dp=2 after 3 steps, resumed for 2 more at dp=1, at dp=2 unsharded and at
    dp=2 sharded: each equals 5 uninterrupted steps of the unsharded dp=2 run (the batch is the
    same; only how it is split over replicas differs)."""
    name = "gpt"
    dp2 = real_plan(name, **PLAN)
    dp1 = real_plan(name, **{**PLAN, "dp": 1})
    whole, _ = run(dp2, options(5, False), name)

    ck = tmp_path / "ck"
    saver = options(3, True, checkpoint_dir=str(ck))
    model, _ = fresh_model(name)
    run(dp2, saver, name, checkpoints=RunCheckpoints.from_options(dp2, saver, model=model))
    for plan, shard in ((dp1, False), (dp2, False), (dp2, True)):
        folder = tmp_path / f"{plan.header.mesh.data}-{shard}"
        import shutil

        shutil.copytree(ck, folder)
        resumed = options(5, shard, checkpoint_dir=str(folder), resume=True)
        got, _ = run(plan, resumed, name, checkpoints=RunCheckpoints.from_options(plan, resumed, model=model))
        assert got.losses == pytest.approx(whole.losses[3:], rel=1e-5)
        assert_close(got.state_dict, whole.state_dict, tol=1e-5)


def test_an_unsharded_checkpoint_resumes_sharded(tmp_path):
    name = "gpt"
    dp2 = real_plan(name, **PLAN)
    whole, _ = run(dp2, options(4, False), name)
    saver = options(2, False, checkpoint_dir=str(tmp_path))
    model, _ = fresh_model(name)
    run(dp2, saver, name, checkpoints=RunCheckpoints.from_options(dp2, saver, model=model))
    resumed = options(4, True, checkpoint_dir=str(tmp_path), resume=True)
    got, _ = run(dp2, resumed, name, checkpoints=RunCheckpoints.from_options(dp2, resumed, model=model))
    assert got.losses == pytest.approx(whole.losses[2:], rel=1e-6)
    assert_close(got.state_dict, whole.state_dict)


# ------------------------------------------------------------------------------ the pieces


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), (1, 7)])
def test_range_boxes_tile_every_range_once(shape):
    n = math.prod(shape)
    for lo in range(n):
        for hi in range(lo + 1, n + 1):
            hits = torch.zeros(shape)
            for offsets, sizes in range_boxes(shape, lo, hi):
                hits[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
            flat = hits.reshape(-1)
            assert flat[lo:hi].eq(1).all() and float(flat.sum()) == hi - lo, (lo, hi)


# ------------------------------------------------------------------------------ torchrun


def _rank(rank: int, out_dir: str, plan_path: str, steps: int) -> None:
    import sys

    from tpc.cli.main import main

    sys.stdout = open(Path(out_dir) / f"rank{rank}.out", "w")
    status = main(["run", plan_path, "--steps", str(steps), "--shard-optimizer", "--lr-schedule", "constant",
                   "--lr", "3e-3", "--weight-decay", "0.1", "--grad-clip", "0.5", "--device", "cpu",
                   "--metrics", str(Path(out_dir) / "m.jsonl"), "--checkpoint-dir", str(Path(out_dir) / "ck"),
                   "--timeout", "60", "-q"])
    sys.stdout.flush()
    sys.exit(status)


def test_gloo_ranks_pp2_dp2_sharded_equal_the_unsharded_interpreter(tmp_path):
    """Four gloo processes (2 pipeline x 2 data-parallel) with --shard-optimizer for 50 steps:
    their losses and the weights they save equal the interpreter's unsharded run."""
    import json

    from tests.executors.dist_harness import launch
    from tests.executors.training.test_reshard import read_checkpoint
    from tpc.ir.printer import print_plan

    steps = 50
    plan = real_plan("gpt", **PLAN)
    path = tmp_path / "plan.tpir"
    path.write_text(print_plan(plan))
    codes, errs = launch(4, tmp_path, _rank, str(path), steps, limit=400)
    assert codes == [0] * 4, errs
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    model, sliced = fresh_model("gpt")
    want = interpret(plan, options(steps, False), model=model, sliced=sliced)
    assert [r["loss"] for r in rows] == pytest.approx(want.losses, rel=TOL)
    params, _ = read_checkpoint(tmp_path / "ck" / f"step_{steps:06d}", "gpt")
    assert_close(params, {k: v for k, v in want.state_dict.items() if k in params})
