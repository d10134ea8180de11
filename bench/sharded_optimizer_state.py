"""Optimizer-state bytes per rank with and without `--shard-optimizer` (ZeRO-1), measured.

Runs one training step of a plan in the reference interpreter (every rank its own engine and
optimizer, as separate processes would have) twice, unsharded and sharded, and sums the bytes
of the optimizer's state tensors on each rank (`ShardedOptimizer.state_bytes`: AdamW's two fp32
moments, and its step counts). Beside them: the memory model's prediction of the same part
(compiler/predict/memory.py) and whether the two runs' weights after the step agree.
Target (issue 33): at data-parallel 2 the state per rank halves.

    OMP_NUM_THREADS=1 python bench/sharded_optimizer_state.py [--dp 2] [--stages 2]

The model is bench/models/gpt_untied.py's `model` (no tie, so every parameter is sharded; a
tie held by two pipeline ranks would be kept whole).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

MODEL = str(Path(__file__).resolve().parent / "models" / "gpt_untied.py")


def measure(plan, shard: bool):
    """(state bytes per global rank, parameter bytes per global rank, final state_dict)."""
    from tpc.executors.interpreter import interpret
    from tpc.executors.options import RunOptions
    from tpc.executors.training.sharded_optimizer import optimizer_state_bytes
    from tpc.executors.training_loop import CheckpointHook

    engines = []

    class Keep(CheckpointHook):  # the run's checkpoint hook: sees every engine, saves nothing
        def start(self, es):
            engines.extend(es)
            return 0

    opts = RunOptions(steps=1, device="cpu", quiet=True, shard_optimizer=shard, grad_clip=1.0)
    result = interpret(plan, opts, checkpoints=Keep(), keep_grads=False)
    state = {e.global_rank: optimizer_state_bytes(e.optimizer.opt) for e in engines}
    params = {e.global_rank: sum(p.numel() * p.element_size() for _, p in e.named_parameters) for e in engines}
    return state, params, result.state_dict


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--factory", default="model")
    args = ap.parse_args(argv)

    from tpc.cli.compile import check_options
    from tpc.compiler.compile import compile_plan
    from tpc.compiler.costmodel.resolve import plan_cost_model
    from tpc.compiler.predict.quantities import format_bytes
    from tpc.compiler.predict.simulate import simulate

    opts = check_options(stages=str(args.stages), microbatches=2, seq_len=64, batch=4 * args.dp,
                         slices="2", schedule="seq1f1b", dp=args.dp, ranks=None, factory=args.factory,
                         quiet=True)
    plan = compile_plan(MODEL, opts)
    with tempfile.TemporaryDirectory():
        whole, params, sd_whole = measure(plan, False)
        sharded, _, sd_sharded = measure(plan, True)
    costs = plan_cost_model(plan.header, device_model="h100", source=MODEL)
    mesh = plan.header.mesh.value
    predicted = {s: {r.rank: r.peak_memory.optimizer for r in simulate(plan, costs, shard_optimizer=s).ranks}
                 for s in (False, True)}
    print(f"{MODEL}:{args.factory}, {args.stages} stages x {args.dp} data-parallel replicas, AdamW; "
          f"optimizer state bytes per rank, measured (the state tensors) and predicted (memory model)")
    print(f"{'rank':>4} {'pipe':>4} {'data':>4} {'params':>12} {'state':>12} {'sharded':>12} {'ratio':>6}"
          f" {'predicted':>12} {'sharded':>12}")
    for g in sorted(whole):
        p = mesh.pipe_rank(g)
        print(f"{g:>4} {p:>4} {mesh.data_rank(g):>4} {format_bytes(params[g]):>12} {format_bytes(whole[g]):>12} "
              f"{format_bytes(sharded[g]):>12} {sharded[g] / whole[g]:>6.3f} {format_bytes(predicted[False][p]):>12} "
              f"{format_bytes(predicted[True][p]):>12}")
    diff = max(float((sd_whole[k] - sd_sharded[k]).abs().max()) for k in sd_whole)
    print(f"total state: {format_bytes(sum(whole.values()))} unsharded, {format_bytes(sum(sharded.values()))} "
          f"sharded; weights after the step differ by at most {diff:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
