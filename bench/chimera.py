"""Chimera against 1F1B on the same ranks: measured step times side by side, and the simulator's.

The model is bench/models/gpt_untied.py (examples/gpt.py, 8 layers, width 128, untied: chimera
refuses tied weights), batch 8 of 256 tokens in 4 micro-batches, 2 stages on 2 gloo ranks with
one thread each (the 4-rank pair needs 4 cores to mean anything). `tpc compile --schedule chimera`
gives each rank a replica of both stages (stage 0 down on rank 0 and up on rank 1), so its step
has no bubble under F = B where 1F1B idles (D-1)/(N+D-1) = 1/5 of it; under F = 1, B = 2 the unit
figures are 12 against 15.

Measured: in the same processes, blocks of steps alternate (a block of 1F1B, a block of chimera,
...; the first step of each block left out), the wall time of rank 0's steps (each ends in the
all-reduce of the loss); the ratio is median(chimera) / median(1F1B). Predicted: `tpc simulate`
of both plans with the CPU profile `tpc profile` measures first, and with unit costs.

    OMP_NUM_THREADS=1 python bench/chimera.py [--repeats 4] [--block 3] [--slices 1]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (MACHINE, at_root, compile_plan, cpu_profile, launch, load_note, median,  # noqa: E402
                    rank_alternate, simulated_time, table)

MODEL, FACTORY = "bench/models/gpt_untied.py", "model"
SEQ, BATCH, MICRO, RANKS = 256, 8, 4, 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=4, help="blocks of each plan (default: 4)")
    ap.add_argument("--block", type=int, default=3, help="timed steps per block (default: 3)")
    ap.add_argument("--slices", type=int, default=1, help="token slices per micro-batch (default: 1)")
    ap.add_argument("--profile", help="use this CPU profile instead of running `tpc profile` first")
    args = ap.parse_args(argv)
    at_root()
    with tempfile.TemporaryDirectory(prefix="tpc-bench-") as tmp:
        profile = cpu_profile(MODEL, FACTORY, SEQ, Path(tmp) / "cpu.msgpack", batch=BATCH // MICRO,
                              given=args.profile)
        plans = [compile_plan(MODEL, Path(tmp) / f"{s}.tpir", factory=FACTORY, stages=RANKS, microbatches=MICRO,
                              seq_len=SEQ, batch=BATCH, slices=args.slices, schedule=s, comm="gloo")
                 for s in ("1f1b", "chimera")]
        [(base, chim)] = launch(RANKS, rank_alternate, [plans], args.repeats, args.block)[0]
        measured = median(chim) / median(base)
        unit = simulated_time(plans[1]) / simulated_time(plans[0])
        prof = simulated_time(plans[1], profile) / simulated_time(plans[0], profile)
    print(f"chimera vs 1f1b on {MACHINE}: GPT 8x128 untied, {RANKS} stages on {RANKS} gloo ranks (1 thread each), "
          f"batch {BATCH} x {SEQ} tokens in {MICRO} micro-batches x {args.slices} slice(s); "
          f"{args.repeats} x {args.block} steps of each, alternating; {load_note()}")
    print(table(["", "1f1b ms", "chimera ms", "chimera / 1f1b"], [
        ["measured (median step)", f"{median(base) * 1e3:.1f}", f"{median(chim) * 1e3:.1f}", f"{measured:.3f}"],
        ["predicted, CPU profile", "", "", f"{prof:.3f}"],
        ["predicted, unit costs", "", "", f"{unit:.3f}"],
    ]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
