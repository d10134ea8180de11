"""Every schedule on one model and 4 ranks: predicted vs measured step time and peak memory per rank.

The model is bench/models/gpt_untied.py's `model` (examples/gpt.py, 8 layers, width 128, untied),
batch 8 of 256 tokens in 4 micro-batches of 2 sequences, each cut into 2 equal token slices, on 4
pipeline ranks (gloo, one thread per rank). The schedules that put several model chunks on a rank
(interleaved, looped-bfs, seq-interleaved) get 2 per rank (`--stages 4 --virtual-stages 2`), the
others one; chimera's ranks each hold a weight replica of two of the 4 stages. The CPU profile comes from `tpc profile` run first (at L=256, micro-batches of 2).

Predicted: `tpc simulate PLAN --cost PROFILE`: the iteration time, and per rank the peak of what
a step adds to memory (compiler/predict/memory.py at its peak: gradients, live activations, KV caches and
their gradients, a split backward's held gradients, received messages; the parameters and the
optimizer state are there before the step).
Measured: each plan in 4 fresh processes (`run_plan`, what `tpc run` runs under torchrun), plain
SGD: the median wall time of rank 0's steps after the warm-up (each step ends in the all-reduce
of the loss, a sync point of every rank), and per rank the peak RSS during the timed steps above
the RSS just before the first of them (after the warm-up, a garbage collection and a heap trim):
what a step adds once the process is warm, the quantity the model predicts (gradients are set
to None after each step, so every step allocates them again). What the warm-up step left
behind for good (libraries' first-use state: thread pools, GEMM and gloo buffers) is reported
apart, per rank, as the "one-off" column.

`--allocator returning` runs the rank processes with glibc told to give every freed block of
16 KiB or more back to the OS at once (MALLOC_MMAP_THRESHOLD_=16384, MALLOC_TRIM_THRESHOLD_=0),
so that their RSS follows the live tensors; with the default (`glibc`) it also holds what the
allocator keeps of freed blocks for reuse, which the model does not know.

Target: predicted within 10% of measured for every row (time and memory).

    OMP_NUM_THREADS=1 python bench/schedule_table.py [--steps 5] [--schedules gpipe,1f1b,...]
        [--allocator glibc|returning]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (MACHINE, at_root, compile_plan, cpu_profile, launch, load_note, median, ok, peak_kib,  # noqa: E402
                    reset_peak, table, tpc_run, tpc_setup)

MODEL, FACTORY = "bench/models/gpt_untied.py", "model"
SEQ, BATCH, MICRO, SLICES, RANKS = 256, 8, 4, 2, 4
# schedule -> chunks per rank
SCHEDULES = {"gpipe": 1, "1f1b": 1, "terapipe": 1, "seq1f1b": 1, "interleaved": 2, "looped-bfs": 2,
             "zb-h1": 1, "zb-h2": 1, "seq-zb": 1, "seq-interleaved": 2, "chimera": 1}
TARGET = 0.10
RETURNING = {"MALLOC_MMAP_THRESHOLD_": "16384", "MALLOC_TRIM_THRESHOLD_": "0"}


def rank_measure(rank: int, world: int, plan_path: str, warmup: int, steps: int):
    """Step times (s) after the warm-up; the peak RSS (KiB) during the timed steps above the RSS
    before the first of them; the RSS the warm-up left behind (KiB, above the RSS before it)."""
    plan, model, sliced = tpc_setup(plan_path)
    state, times = {}, []

    def before(engine, index):  # after every part of setup run_plan does
        if index == 0 and engine.step == 0:
            state["setup"] = reset_peak()
        if index == 0 and engine.step == warmup:
            state["warm"] = reset_peak()

    tpc_run(plan, model, sliced, rank, world, warmup + steps, before=before,
            on_step=lambda step, loss, info: times.append(info["step_time"]))
    return times[warmup:], peak_kib() - state["warm"], state["warm"] - state["setup"]


def predicted(plan_path: str, profile: str):
    """(iteration time s, per pipeline rank the bytes a step adds at its peak)."""
    from tpc.compiler.costmodel.resolve import plan_cost_model
    from tpc.compiler.predict.simulate import simulate
    from tpc.ir.semantics import GLOO
    from tpc.ir.verify import verify_file

    plan = verify_file(plan_path)
    result = simulate(plan, plan_cost_model(plan.header, cost=profile), GLOO)  # measured on gloo ranks
    adds = []
    for r in result.ranks:
        m = r.peak_memory
        adds.append(m.total - m.params - m.optimizer)  # gradients, activations, KV, messages, ...
    return result.iteration_time, adds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (default: 1)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per plan (default: 5)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help=f"default: {','.join(SCHEDULES)}")
    ap.add_argument("--profile", help="use this CPU profile instead of running `tpc profile` first")
    ap.add_argument("--allocator", choices=("glibc", "returning"), default="glibc",
                    help="glibc: its default policy; returning: freed blocks of 16 KiB or more go back to "
                         "the OS at once, so RSS follows the live tensors (default: glibc)")
    args = ap.parse_args(argv)
    if args.warmup < 1:
        ap.error("--warmup: at least 1 (memory is measured after it)")
    if args.allocator == "returning":
        os.environ.update(RETURNING)  # read by glibc as the rank processes start
    unknown = [s for s in args.schedules.split(",") if s not in SCHEDULES]
    if unknown:
        ap.error(f"--schedules: {', '.join(unknown)} not in this table's schedules ({', '.join(SCHEDULES)})")
    at_root()
    rows, ok_all = [], True
    with tempfile.TemporaryDirectory(prefix="tpc-bench-") as tmp:
        profile = cpu_profile(MODEL, FACTORY, SEQ, Path(tmp) / "cpu.msgpack", batch=BATCH // MICRO,
                              given=args.profile)
        for schedule in args.schedules.split(","):
            chunks = SCHEDULES[schedule]
            plan = compile_plan(MODEL, Path(tmp) / f"{schedule}.tpir", factory=FACTORY, stages=RANKS,
                                virtual_stages=chunks, microbatches=MICRO, seq_len=SEQ, batch=BATCH,
                                slices=SLICES, schedule=schedule)
            t0 = time.monotonic()
            out = launch(RANKS, rank_measure, plan, args.warmup, args.steps)
            print(f"  {schedule}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
            p_time, p_mem = predicted(plan, profile)
            m_time = median(out[0][0])
            m_mem = [o[1] * 1024 for o in out]
            one_off = [o[2] / 1024 for o in out]
            t_err = p_time / m_time - 1
            m_err = [p / m - 1 if m > 0 else float("inf") for p, m in zip(p_mem, m_mem)]
            good = abs(t_err) <= TARGET and all(abs(e) <= TARGET for e in m_err)
            ok_all &= good
            rows.append([f"{schedule}" + (f" ({chunks} chunks/rank)" if chunks > 1 else ""),
                         f"{p_time * 1e3:.0f} / {m_time * 1e3:.0f}", f"{t_err:+.1%}",
                         " ".join(f"{v / 2**20:.1f}" for v in p_mem) + " / " + " ".join(f"{v / 2**20:.1f}" for v in m_mem),
                         " ".join(f"{e:+.0%}" for e in m_err), " ".join(f"{v:.1f}" for v in one_off), ok(good)])
            print(f"  {' | '.join(rows[-1])}", file=sys.stderr, flush=True)
    print(f"every schedule on {MACHINE}: GPT 8x128 untied, {RANKS} pipeline ranks (gloo, 1 thread each), batch "
          f"{BATCH} x {SEQ} tokens in {MICRO} micro-batches x {SLICES} slices, CPU profile from `tpc profile`; "
          f"{args.warmup} warm-up and {args.steps} timed steps per plan, {args.allocator} allocator; {load_note()}")
    print(table(["schedule", "step ms predicted / measured", "time error", "MiB a step adds per rank, predicted / measured",
                 "memory error per rank", "one-off MiB per rank", f"within {TARGET:.0%}"], rows))
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
