"""The executor's overhead: a one-stage, one-slice plan vs a plain PyTorch training loop.

The model is examples/gpt.py as it is (4 layers, width 128, tied head), batch 8 x 256 tokens,
plain SGD (no weight decay). tpc runs `tpc compile --stages 1 --microbatches 1 --slices 1` with
the distributed executor (`run_plan`, what `tpc run` runs under torchrun) on one gloo rank with
one thread; the plain loop is forward, mean cross-entropy, backward, optimizer step, zero_grad
on its own copy of the same initial weights and the same batches. Steps alternate in the same process (a tpc
step, then a plain step, ...): the ratio is median(tpc) / median(plain) after warm-up steps.

Target: time ratio <= 1.05.

    OMP_NUM_THREADS=1 python bench/overhead.py [--steps 20]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (MACHINE, at_root, compile_plan, launch, load_note, median, ok, table,  # noqa: E402
                    tpc_run, tpc_setup)

MODEL = "examples/gpt.py"
SEQ, BATCH, LR = 256, 8, 1e-4


def rank_alternate(rank: int, world: int, plan_path: str, warmup: int, steps: int):
    import torch
    import torch.nn.functional as F

    from tpc.executors.training.batches import RandomTokens
    from tpc.executors.plan_model import load_plan_model

    plan, model, sliced = tpc_setup(plan_path)
    plain = load_plan_model(plan, 0)  # the same initial weights
    opt = torch.optim.SGD(plain.parameters(), lr=LR)
    h = plan.header.shape
    batches = RandomTokens(0, h.batch, h.seq, h.vocab)
    tpc_times, plain_times = [], []

    def plain_step(step, loss, info):
        tpc_times.append(info["step_time"])
        t0 = time.perf_counter()
        tokens = batches.get(step)
        ids, targets = tokens[:, :-1], tokens[:, 1:]
        logits = plain(ids)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())  # the loss a training loop logs
        plain_times.append(time.perf_counter() - t0)

    tpc_run(plan, model, sliced, rank, world, warmup + steps, optim=("sgd", LR, 0.0), on_step=plain_step)
    return tpc_times[warmup:], plain_times[warmup:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps of each first (default: 3)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps of each (default: 20)")
    args = ap.parse_args(argv)
    at_root()
    with tempfile.TemporaryDirectory(prefix="tpc-bench-") as tmp:
        plan = compile_plan(MODEL, Path(tmp) / "one.tpir", stages=1, microbatches=1, seq_len=SEQ, batch=BATCH,
                            slices=1, schedule="gpipe")
        [(tpc_times, plain_times)] = launch(1, rank_alternate, plan, args.warmup, args.steps)
    t_tpc, t_plain = median(tpc_times), median(plain_times)
    ratio = t_tpc / t_plain
    print(f"executor overhead on {MACHINE}: examples/gpt.py, batch {BATCH} x {SEQ} tokens, SGD, 1 rank, "
          f"1 thread; {args.steps} alternating timed steps; {load_note()}")
    print(table(["setup", "ms/step tpc / plain", "time ratio", "target", "target met"],
                [["1 stage, 1 slice, `run_plan` vs plain loop", f"{t_tpc * 1e3:.1f} / {t_plain * 1e3:.1f}",
                  f"{ratio:.3f}", "<= 1.05", ok(ratio <= 1.05)]]))
    return 0 if ratio <= 1.05 else 1


if __name__ == "__main__":
    raise SystemExit(main())
