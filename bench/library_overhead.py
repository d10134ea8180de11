"""What the library's step costs against `tpc run`'s, on the same plan, measured side by side.

Both run examples/gpt.py's GPT (4 layers, width 128) on one plan (2 stages, 4 micro-batches, 2
token slices each) with every rank in this process (the reference interpreter), for the same
batches, alternating the two in each repeat:

- `tpc run`'s loop: `interpret(plan, RunOptions(...))`, AdamW inside the plan's `step`;
- the library: `tpc.pipeline(plan, model, interpret=True)`, then per step `pipe.step(x, y)`,
  and torch.optim.AdamW over `pipe.parameters()` outside it (no clipping in either).

Printed: the median step time of each and their ratio (library / tpc run). The library adds,
per step, the check of the batch's token range on the CPU and the optimizer's step pre-hook.

    OMP_NUM_THREADS=1 python bench/library_overhead.py [--steps 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = os.path.join(ROOT, "examples", "gpt.py")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import tpc
    from tpc.compiler.frontend import load_model
    from tpc.executors.interpreter import interpret
    from tpc.executors.options import RunOptions
    from tpc.executors.training.batches import RandomTokens
    from tpc.executors.training.optimizer import OptimSpec

    torch.manual_seed(0)
    model = load_model(GPT)
    plan = tpc.compile(GPT, seq_len=128, batch=8, stages=2, microbatches=4, slices=2, schedule="1f1b")
    shape = plan.header.shape
    batches = RandomTokens(1, shape.batch, shape.seq, shape.vocab)
    spec = OptimSpec(kind="adamw", lr=1e-4, weight_decay=0.0)

    def run_tpc() -> float:
        times = []
        interpret(plan, RunOptions(steps=args.steps, optim=spec, lr_schedule="constant", quiet=True),
                  model=model, batches=batches, keep_grads=False,
                  on_step=lambda step, loss, info: times.append(info["step_time"]))
        return statistics.median(times[1:])

    def run_library() -> float:
        pipe = tpc.pipeline(plan, model, interpret=True)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4, weight_decay=0.0)
        times = []
        for step in range(args.steps):
            tokens = batches.get(step)
            t0 = time.perf_counter()
            pipe.step(tokens)
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        pipe.close()
        return statistics.median(times[1:])

    rows = []
    for r in range(args.repeats):
        a, b = run_tpc(), run_library()
        rows.append((a, b))
        print(f"repeat {r + 1}: tpc run {a * 1e3:8.1f} ms/step   library {b * 1e3:8.1f} ms/step   "
              f"library / tpc run {b / a:5.2f}", flush=True)
    ratios = sorted(b / a for a, b in rows)
    print(f"median ratio library / tpc run: {statistics.median(ratios):.2f} "
          f"(range {ratios[0]:.2f}-{ratios[-1]:.2f}; {args.steps} steps a run, the first left out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
