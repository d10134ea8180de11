"""Every schedule on one model and 4 ranks: predicted vs measured step time and peak memory per rank.

The model is bench/models/gpt_untied.py's `model` (examples/gpt.py, 8 layers, width 128, untied),
batch 8 of 256 tokens in 4 micro-batches of 2 sequences, each cut into 2 equal token slices, on 4
pipeline ranks (gloo, one thread per rank). The schedules that put several model chunks on a rank
(interleaved, looped-bfs, seq-interleaved) get 2 per rank (`--stages 4 --virtual-stages 2`), the
others one; chimera's ranks each hold a weight replica of two of the 4 stages. The CPU profile comes from `tpc profile` run first (at L=256, micro-batches of 2).

Predicted: `tpc simulate PLAN --cost PROFILE`: the iteration time, and per rank the peak of what
a step adds to memory (compiler/memory.py at its peak: gradients, live activations, KV caches and
their gradients; the parameters and the optimizer state are there before the step).
Measured: each plan in 4 fresh processes (`run_plan`, what `tpc run` runs under torchrun), plain
SGD: the median wall time of rank 0's steps after the warm-up (each step ends in the all-reduce
of the loss, a sync point of every rank), and per rank the peak RSS during the steps above the RSS
just before the first (after a garbage collection and a heap trim).

Target: predicted within 10% of measured for every row (time and memory).

    OMP_NUM_THREADS=1 python bench/schedule_table.py [--steps 5] [--schedules gpipe,1f1b,...]
"""

from __future__ import annotations

import argparse
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


def rank_measure(rank: int, world: int, plan_path: str, warmup: int, steps: int):
    """Step times (s) after the warm-up, and the peak RSS (KiB) above the RSS before the first step."""
    plan, model, sliced = tpc_setup(plan_path)
    state, times = {}, []

    def before(engine, index):  # after every part of setup run_plan does
        if engine.step == 0 and index == 0:
            state["base"] = reset_peak()

    tpc_run(plan, model, sliced, rank, world, warmup + steps, before=before,
            on_step=lambda step, loss, info: times.append(info["step_time"]))
    return times[warmup:], peak_kib() - state["base"]


def predicted(plan_path: str, profile: str):
    """(iteration time s, per pipeline rank the bytes a step adds at its peak)."""
    from tpc.compiler.costmodel.resolve import plan_cost_model
    from tpc.compiler.simulate import simulate
    from tpc.ir.verify import verify_file

    plan = verify_file(plan_path)
    result = simulate(plan, plan_cost_model(plan.header, cost=profile))
    adds = []
    for r in result.ranks:
        m = r.peak_memory
        adds.append(m.grads + m.activations + m.kv + m.kv_grads + m.held_grads)
    return result.iteration_time, adds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (default: 1)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per plan (default: 5)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help=f"default: {','.join(SCHEDULES)}")
    ap.add_argument("--profile", help="use this CPU profile instead of running `tpc profile` first")
    args = ap.parse_args(argv)
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
            t_err = p_time / m_time - 1
            m_err = [p / m - 1 if m > 0 else float("inf") for p, m in zip(p_mem, m_mem)]
            good = abs(t_err) <= TARGET and all(abs(e) <= TARGET for e in m_err)
            ok_all &= good
            rows.append([f"{schedule}" + (f" ({chunks} chunks/rank)" if chunks > 1 else ""),
                         f"{p_time * 1e3:.0f} / {m_time * 1e3:.0f}", f"{t_err:+.1%}",
                         " ".join(f"{v / 2**20:.1f}" for v in p_mem) + " / " + " ".join(f"{v / 2**20:.1f}" for v in m_mem),
                         " ".join(f"{e:+.0%}" for e in m_err), ok(good)])
            print(f"  {' | '.join(rows[-1])}", file=sys.stderr, flush=True)
    print(f"every schedule on {MACHINE}: GPT 8x128 untied, {RANKS} pipeline ranks (gloo, 1 thread each), batch "
          f"{BATCH} x {SEQ} tokens in {MICRO} micro-batches x {SLICES} slices, CPU profile from `tpc profile`; "
          f"{args.steps} timed steps per plan; {load_note()}")
    print(table(["schedule", "step ms predicted / measured", "time error", "MiB a step adds per rank, predicted / measured",
                 "memory error per rank", f"within {TARGET:.0%}"], rows))
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
