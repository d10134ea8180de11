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

`--heldout` measures instead the held-out loss at equal wall-clock against plain training, on
the README's model and corpus (examples/gpt.py: 4 blocks of width 128; the Python standard
library's sources, examples/prepare_corpus.py, 4 MB), trained as the README does: 2 stages on 2
gloo ranks under torchrun (`tpc run`), batch 16 x 128 in 2 micro-batches, 1F1B, AdamW at lr 3e-3
with 20 warm-up steps then constant (one learning rate per step for both runs, whatever their
lengths), clipping at 1.0, from the same weights on the same batches. The plain plan runs
`--steps` steps; the random-LTD plan is compiled with `--random-ltd 2:4` (blocks 1 and 2 of 0..3,
all but the first and the last) and `--random-ltd-schedule 64,128,STEPS,16` (DeepSpeed's
fixed_linear from half the tokens to all of them over the plain run's steps) and runs 1.5 x
`--steps` steps, so that it has at least the plain run's training time. Both evaluate the
held-out loss (`--eval-data` val.bin, every token through every block, 4 batches) every
`--every` steps. A run's time at a step is the sum of its logged step times (training only).
Reported: both curves, and the random-LTD run's held-out loss at the plain run's total training
time (linear between the evaluations around it) against the plain run's final one.

    OMP_NUM_THREADS=1 python bench/random_ltd.py --heldout [--steps 150] [--every 25]
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


def heldout(steps: int, every: int, work: Path) -> int:
    """`--heldout` (the module docstring)."""
    import subprocess

    from curriculum import rows_of, torchrun

    data = work / "data"
    if not (data / "train.bin").is_file():
        subprocess.run([sys.executable, "examples/prepare_corpus.py", "-o", str(data), "--max-bytes", "4000000"],
                       check=True, capture_output=True)
    common = dict(stages=2, microbatches=2, batch=16, seq_len=128, slices=1, schedule="1f1b", comm="gloo")
    plain = compile_plan("examples/gpt.py", work / "plain.tpir", **common)
    schedule = f"64,128,{steps},16"
    compile_plan("examples/gpt.py", work / "ltd.tpir", random_ltd="2:4", random_ltd_schedule=schedule, **common)
    train = ["--data", str(data / "train.bin"), "--eval-data", str(data / "val.bin"), "--eval-every", str(every),
             "--eval-batches", "4", "--device", "cpu", "--lr", "3e-3", "--warmup", "20", "--lr-schedule", "constant",
             "--grad-clip", "1.0", "--seed", "0", "-q"]
    runs = {}
    for name, plan, n in (("plain", plain, steps), ("random-LTD", str(work / "ltd.tpir"), (3 * steps + 1) // 2)):
        metrics = work / f"{name}.jsonl"
        metrics.unlink(missing_ok=True)
        wall = torchrun(["run", plan, "--steps", str(n), "--metrics", str(metrics), *train], work / f"{name}.log")
        elapsed, total, curve = {0: 0.0}, 0.0, {}
        for r in rows_of(metrics):
            if "step_time" in r:
                total += r["step_time"]
                elapsed[r["step"]] = total
            if r.get("val_loss") is not None:
                curve[r["step"]] = r["val_loss"]
        runs[name] = dict(elapsed=elapsed, curve=curve, wall=wall, steps=n)
        print(f"  {name}: {n} steps, {wall:.0f} s", file=sys.stderr, flush=True)
    base, ltd = runs["plain"], runs["random-LTD"]
    budget = base["elapsed"][steps]
    print(f"random-LTD, held-out loss at equal wall-clock on {MACHINE}: examples/gpt.py (4 x 128), corpus of "
          f"examples/prepare_corpus.py (4 MB), 2 stages on 2 gloo ranks under torchrun, batch 16 x 128 in 2 "
          f"micro-batches, 1f1b, AdamW 3e-3 (20 warm-up steps, then constant); random-LTD: blocks 1-2 of 0-3, "
          f"kept tokens fixed_linear {schedule}; plain {steps} steps, random-LTD {ltd['steps']}; {load_note()}")
    rows = []
    for step in sorted(set(base["curve"]) | set(ltd["curve"])):
        cell = lambda r: (f"{r['elapsed'][step]:.1f}", f"{r['curve'][step]:.4f}") if step in r["curve"] else ("-", "-")  # noqa: E731
        rows.append([step, *cell(base), *cell(ltd)])
    print(table(["step", "plain: s", "plain: held-out loss", "random-LTD: s", "random-LTD: held-out loss"], rows))
    points = sorted((ltd["elapsed"][s], v) for s, v in ltd["curve"].items())
    times, losses = [t for t, _ in points], [v for _, v in points]
    final = base["curve"][steps]
    if budget <= times[-1]:
        import numpy as np

        at = float(np.interp(budget, times, losses))
        print(f"  at the plain run's training time, {budget:.1f} s: plain {final:.4f}, random-LTD {at:.4f} "
              f"(difference {at - final:+.4f})")
    else:
        print(f"  the random-LTD run trained {times[-1]:.1f} s, less than the plain run's {budget:.1f} s: "
              f"run with a larger --steps")
    same = ltd["curve"].get(steps)
    if same is not None:
        print(f"  at equal steps ({steps}): plain {final:.4f} in {budget:.1f} s, random-LTD {same:.4f} in "
              f"{ltd['elapsed'][steps]:.1f} s ({ltd['elapsed'][steps] / budget:.3f} of the time)")
    print(f"  whole runs (start-up, tracing, evaluations included): plain {base['wall']:.0f} s, "
          f"random-LTD {ltd['wall']:.0f} s")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heldout", action="store_true", help="the held-out loss at equal wall-clock (module docstring)")
    ap.add_argument("--steps", type=int, default=150, help="with --heldout: the plain run's steps (default: 150)")
    ap.add_argument("--every", type=int, default=25, help="with --heldout: evaluate every N steps (default: 25)")
    ap.add_argument("--work", help="with --heldout: keep the corpus, plans and logs here (default: a temporary folder)")
    ap.add_argument("--repeats", type=int, default=4, help="blocks of each fraction (default: 4)")
    ap.add_argument("--block", type=int, default=3, help="timed steps per block (default: 3)")
    ap.add_argument("--slices", type=int, default=1, help="token slices per micro-batch (default: 1)")
    ap.add_argument("--fractions", default="1,0.75,0.5,0.25", help="kept fractions (default: 1,0.75,0.5,0.25)")
    args = ap.parse_args(argv)
    at_root()
    if args.heldout:
        with tempfile.TemporaryDirectory(prefix="tpc-bench-") as tmp:
            work = Path(args.work or tmp)
            work.mkdir(parents=True, exist_ok=True)
            return heldout(args.steps, args.every, work)
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
