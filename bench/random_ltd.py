"""Random layerwise token dropping: step time against the kept fraction, measured side by side.

The model is bench/models/gpt_untied.py (examples/gpt.py, 8 layers, width 128, untied), batch 8
of 256 tokens in 4 micro-batches of one slice (or --slices N), 2 stages on 2 gloo ranks with one
thread each, 1F1B. DeepSpeed's setting: every layer but the first and the last drops tokens
(units 2..7 of 0..9: the embedding, 8 blocks, the head); each kept fraction f is a fixed
schedule (min_value = max_value = f x 256). In the same processes, blocks of steps alternate
over the fractions (a block of each, then again; the first step of each block left out); the
table gives the median wall time of rank 0's steps (each ends in the all-reduce of the loss)
and its ratio to f = 1 (no dropping: the plain stages).

    OMP_NUM_THREADS=1 python bench/random_ltd.py [--repeats 4] [--block 3] [--slices 1]
        [--fractions 1,0.75,0.5,0.25]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MACHINE, at_root, compile_plan, launch, load_note, median, table, tpc_setup  # noqa: E402

MODEL, FACTORY = "bench/models/gpt_untied.py", "model"
SEQ, BATCH, MICRO, RANKS = 256, 8, 4, 2
UNITS = tuple(range(2, 8))  # blocks 1..6 of 0..7: all but the first and the last


def ltd_of(fraction: float):
    from tpc.compiler.random_ltd import RandomLTD

    if fraction >= 1:
        return None
    k = max(1, round(fraction * SEQ))
    return RandomLTD(units=UNITS, min_value=k, max_value=k, require_steps=1)


def rank_times(rank: int, world: int, plan_path: str, fractions: list, repeats: int, block: int):
    import torch

    from tpc.executors.distributed import World, run_plan
    from tpc.executors.options import RunOptions
    from tpc.executors.training.batches import RandomTokens
    from tpc.executors.training.optimizer import OptimSpec

    plan, model, sliced = tpc_setup(plan_path)
    h = plan.header.shape
    times = {f: [] for f in fractions}
    for _ in range(repeats):
        for f in fractions:
            got = []
            options = RunOptions(steps=block + 1, optim=OptimSpec("sgd", 1e-4, 0.0), lr_schedule="constant",
                                 timeout=600.0, quiet=True, random_ltd=ltd_of(f))
            run_plan(plan, World(rank, world, rank), options, model=model, device=torch.device("cpu"),
                     sliced=sliced, batches=RandomTokens(0, h.batch, h.seq, h.vocab),
                     on_step=lambda s, loss, info: got.append(info["step_time"]))
            times[f] += got[1:]
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=4, help="blocks of each fraction (default: 4)")
    ap.add_argument("--block", type=int, default=3, help="timed steps per block (default: 3)")
    ap.add_argument("--slices", type=int, default=1, help="token slices per micro-batch (default: 1)")
    ap.add_argument("--fractions", default="1,0.75,0.5,0.25", help="kept fractions (default: 1,0.75,0.5,0.25)")
    args = ap.parse_args(argv)
    at_root()
    fractions = [float(x) for x in args.fractions.split(",")]
    with tempfile.TemporaryDirectory(prefix="tpc-bench-") as tmp:
        plan = compile_plan(MODEL, Path(tmp) / "p.tpir", factory=FACTORY, stages=RANKS, microbatches=MICRO,
                            seq_len=SEQ, batch=BATCH, slices=args.slices, schedule="1f1b", comm="gloo")
        times = launch(RANKS, rank_times, plan, fractions, args.repeats, args.block)[0]
    base = median(times[1.0]) if 1.0 in times else None
    print(f"random-LTD on {MACHINE}: GPT 8x128 untied, blocks 1..6 dropping, {RANKS} stages on {RANKS} gloo ranks "
          f"(1 thread each), 1f1b, batch {BATCH} x {SEQ} tokens in {MICRO} micro-batches x {args.slices} slice(s); "
          f"{args.repeats} x {args.block} steps of each, alternating; {load_note()}")
    rows = []
    for f in fractions:
        t = median(times[f])
        rows.append([f"{f:g}", f"{round(f * SEQ) if f < 1 else SEQ}", f"{t * 1e3:.1f}",
                     f"{t / base:.3f}" if base else "-"])
    print(table(["kept fraction", "kept tokens", "median step ms", "ratio to f = 1"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
