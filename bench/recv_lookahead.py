"""How far ahead the gloo executor posts its receives: step times of one plan at two settings.

`DistTransport.LOOKAHEAD_COMPUTES` bounds how many computes ahead of the current instruction
the distributed executor posts its receives on gloo (`LOOKAHEAD_BYTES` bounds their buffers). A
receive posted early lets its sender's send complete while this rank still computes. The model
is bench/models/gpt_untied.py (8 layers, width 128), batch 8 of 256 tokens in 4 micro-batches,
one slice, on 2 gloo ranks with one thread each, in the layouts of bench/vs_torch_pipelining.py
(2 chunks per rank for interleaved, looped-bfs and zb-h1; a V for zbv and dualpipev).

Blocks of steps alternate between the two settings in the same processes (the first step of
each block left out); the ratio is median(B) / median(A) of rank 0's step times.

    OMP_NUM_THREADS=1 python bench/recv_lookahead.py [--a 2] [--b 8] [--schedules 1f1b,...]
        [--repeats 6] [--block 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MACHINE, at_root, compile_plan, launch, load_note, median, table, tpc_setup, tpc_step_times  # noqa: E402

MODEL = "bench/models/gpt_untied.py"
SEQ, BATCH, MICRO = 256, 8, 4
LAYOUTS = {"1f1b": dict(stages=2), "interleaved": dict(stages=2, virtual_stages=2),
           "looped-bfs": dict(stages=2, virtual_stages=2), "zb-h1": dict(stages=2, virtual_stages=2),
           "zbv": dict(stages=4), "dualpipev": dict(stages=4)}


def rank_times(rank: int, world: int, plan_path: str, settings: tuple[int, int], repeats: int, block: int):
    from tpc.executors import dist_transport

    plan, model, sliced = tpc_setup(plan_path)
    times = {s: [] for s in settings}
    for _ in range(repeats):
        for s in settings:
            dist_transport.DistTransport.LOOKAHEAD_COMPUTES = s
            times[s] += tpc_step_times(plan, model, sliced, rank, world, block + 1)[1:]
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", type=int, default=2, help="computes ahead, setting A (default: 2)")
    ap.add_argument("--b", type=int, default=8, help="computes ahead, setting B (default: 8)")
    ap.add_argument("--schedules", default=",".join(LAYOUTS), help=f"default: {','.join(LAYOUTS)}")
    ap.add_argument("--repeats", type=int, default=6, help="blocks of each setting (default: 6)")
    ap.add_argument("--block", type=int, default=3, help="timed steps per block (default: 3)")
    args = ap.parse_args(argv)
    at_root()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tpc-bench-") as tmp:
        for schedule in args.schedules.split(","):
            plan = compile_plan(MODEL, Path(tmp) / f"{schedule}.tpir", microbatches=MICRO, seq_len=SEQ, batch=BATCH,
                                slices=1, schedule=schedule, comm="gloo", **LAYOUTS[schedule])
            times = launch(2, rank_times, plan, (args.a, args.b), args.repeats, args.block)[0]
            a, b = median(times[args.a]), median(times[args.b])
            rows.append([schedule, f"{a * 1e3:.1f}", f"{b * 1e3:.1f}", f"{b / a:.3f}"])
            print(f"  {' | '.join(rows[-1])}", file=sys.stderr, flush=True)
    print(f"receives posted ahead on {MACHINE}: GPT 8x128 untied, 2 gloo ranks (1 thread each), batch {BATCH} x "
          f"{SEQ} tokens in {MICRO} micro-batches; {args.repeats} x {args.block} steps of each, alternating; "
          f"{load_note()}")
    print(table(["schedule", f"ms/step, {args.a} computes ahead", f"ms/step, {args.b} computes ahead",
                 f"{args.b} / {args.a}"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
