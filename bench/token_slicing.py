"""Token slicing on 2 CPU ranks: the optimiser's slices vs none, measured and predicted.

The model is bench/models/gpt_untied.py's `long` (examples/gpt.py, 4 layers, width 256), one
micro-batch of one sequence of L tokens, 2 pipeline stages on 2 gloo ranks with one thread each.
The CPU profile comes from `tpc profile` run first (in this process, at L); the sliced plans
from `tpc compile --slices auto --cost PROFILE`, the unsliced ones from `--slices 1`, each for
the schedules terapipe, seq1f1b and seq-zb (split backward: slices' weight gradients deferred into
the bubble).

Measured: blocks of steps alternate between the unsliced and the sliced plan in the same two
processes (`run_plan`, what `tpc run` runs under torchrun); each block's first step is
warm-up; the speedup is median(unsliced) / median(sliced). Predicted: `tpc simulate --cost
PROFILE` of both plans, the ratio of their iteration times.

Targets: the best sliced plan >= 1.6x the unsliced at L=1024 (each row: >= 1.4x); measured
within 15% of the prediction.

    OMP_NUM_THREADS=1 python bench/token_slicing.py [--seq-lens 1024,2048] [--repeats 3] [--schedules terapipe,seq1f1b,seq-zb]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (MACHINE, at_root, compile_plan, cpu_profile, launch, load_note, median, ok,  # noqa: E402
                    rank_alternate, simulated_time, table)

MODEL, FACTORY = "bench/models/gpt_untied.py", "long"
SCHEDULES = ("terapipe", "seq1f1b", "seq-zb")
BEST_TARGET = 1.6  # the best sliced plan over the unsliced at L=1024


def slices_of(plan_path: str) -> str:
    from tpc.ir.verify import verify_file

    mbs = verify_file(plan_path).header.microbatches
    lengths = [hi - lo for m in mbs for lo, hi in m.slices]
    return f"{len(lengths)}: " + " ".join(map(str, lengths)) if len(lengths) <= 10 else \
        f"{len(lengths)}: {lengths[0]} .. {lengths[-1]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lens", default="1024", help="sequence lengths L (default: 1024)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per step, one micro-batch (default: 1)")
    ap.add_argument("--repeats", type=int, default=3, help="alternations of the two plans (default: 3)")
    ap.add_argument("--block", type=int, default=3, help="timed steps per block (default: 3)")
    ap.add_argument("--profile", help="use this CPU profile instead of running `tpc profile` first")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help=f"schedules (default: {','.join(SCHEDULES)})")
    ap.add_argument("--compile", action="store_true", help="both sides `tpc run --compile` (the profile "
                    "too: `tpc profile --compile`, so the slices follow what a compiled slice costs)")
    args = ap.parse_args(argv)
    at_root()

    rows, ok_all, summary = [], True, None
    with tempfile.TemporaryDirectory(prefix="tpc-bench-") as tmp:
        for L in (int(v) for v in args.seq_lens.split(",")):
            profile = cpu_profile(MODEL, FACTORY, L, Path(tmp) / f"cpu{L}.msgpack", batch=args.batch,
                                  given=args.profile)
            pairs, schedules, speedups = [], args.schedules.split(","), []
            for schedule in schedules:
                common = dict(factory=FACTORY, stages=2, microbatches=1, seq_len=L, batch=args.batch,
                              schedule=schedule)
                pairs.append((compile_plan(MODEL, Path(tmp) / f"{schedule}{L}-1.tpir", slices=1, **common),
                              compile_plan(MODEL, Path(tmp) / f"{schedule}{L}-auto.tpir", slices="auto",
                                           cost=profile, **common)))
            t0 = time.monotonic()
            measured = launch(2, rank_alternate, pairs, args.repeats, args.block, args.compile)
            print(f"  runs at L={L}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
            for schedule, (plain, sliced), times in zip(schedules, pairs, measured[0]):
                t_plain, t_sliced = median(times[0]), median(times[1])
                speedup = t_plain / t_sliced
                speedups.append((speedup, schedule))
                p_plain, p_sliced = simulated_time(plain, profile), simulated_time(sliced, profile)
                p_speedup = p_plain / p_sliced
                off = speedup / p_speedup - 1
                good = abs(off) <= 0.15 and (speedup >= 1.4 if L == 1024 else True)
                ok_all &= good
                rows.append([f"L={L} {schedule}", slices_of(sliced),
                             f"{t_plain * 1e3:.0f} / {t_sliced * 1e3:.0f}", f"{speedup:.2f}x",
                             f"{p_plain * 1e3:.0f} / {p_sliced * 1e3:.0f}", f"{p_speedup:.2f}x",
                             f"{off:+.1%}", ok(good)])
            if L == 1024:
                best, which = max(speedups)
                ok_all &= best >= BEST_TARGET
                summary = f"best sliced plan at L=1024: {which}, {best:.2f}x (target >= {BEST_TARGET}x: {ok(best >= BEST_TARGET)})"
    print(f"token slicing on {MACHINE}: GPT 4x256 untied, 2 stages on 2 gloo ranks (1 thread each), "
          f"{'compiled (--compile)' if args.compile else 'eager'}, "
          f"1 micro-batch of {args.batch} sequence(s); {args.repeats} x {args.block} alternating timed steps each; "
          f"{load_note()}")
    print(table(["setup", "slices (auto)", "measured ms unsliced / sliced", "speedup",
                 "predicted ms", "predicted speedup", "measured vs predicted", "target met"], rows))
    if summary:
        print(summary)
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
