"""The simulator's accuracy: predicted iteration time of CPU-profiled plans vs a measured 2-rank run.

The model is bench/models/gpt_untied.py's `long` (4 layers, width 256), one sequence of L tokens
on 2 pipeline stages. `tpc profile` (run first, in this process) gives the CPU profile; plans
come from `tpc compile` (the optimiser's slices with `--slices auto --cost`, and an unsliced
plan); each runs as `torchrun --nproc-per-node 2 --no-python tpc run PLAN --trace T.json` (gloo,
one thread per rank) and is compared as `tpc simulate PLAN --cost PROFILE --compare T.json`
does (`timeline.compare`: the measured iteration time is the span of a step's instructions over
both ranks, the mean over the steps after the first). The plans' runs alternate, `--repeats`
times; the error reported is the median.

Target: predicted within 15% of measured.

    OMP_NUM_THREADS=1 python bench/sim_accuracy.py [--seq-len 1024] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MACHINE, at_root, compile_plan, cpu_profile, free_port, load_note, median, ok, table  # noqa: E402

MODEL, FACTORY = "bench/models/gpt_untied.py", "long"
PLANS = (("seq1f1b", "auto"), ("terapipe", "auto"), ("seq1f1b", "1"))


def measure(plan: str, trace: str, steps: int) -> None:
    """`torchrun --nproc-per-node 2 -m tpc.cli.main run PLAN --trace TRACE --steps N`: this
    interpreter's tpc, whatever `tpc` is on PATH."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "tpc.cli.main", "run", plan, "--trace", trace, "--steps", str(steps),
           "--optimizer", "sgd", "--lr", "1e-4", "--quiet", "--device", "cpu"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")


def compare(plan_path: str, profile: str, trace: str):
    """What `tpc simulate PLAN --cost PROFILE --compare TRACE` prints, as rows."""
    from tpc.compiler.predict import timeline
    from tpc.compiler.predict.chrome_trace import read_trace
    from tpc.compiler.costmodel.resolve import plan_cost_model
    from tpc.compiler.predict.simulate import simulate
    from tpc.ir.semantics import GLOO
    from tpc.ir.verify import verify_file

    plan = verify_file(plan_path)
    result = simulate(plan, plan_cost_model(plan.header, cost=profile), GLOO)  # measured on gloo ranks
    return timeline.compare(result, read_trace(trace)).rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=1024, help="sequence length L (default: 1024)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each plan, alternating (default: 2)")
    ap.add_argument("--steps", type=int, default=5, help="steps per run, the first left out (default: 5)")
    ap.add_argument("--profile", help="use this CPU profile instead of running `tpc profile` first")
    args = ap.parse_args(argv)
    at_root()

    L = args.seq_len
    rows, ok_all = [], True
    with tempfile.TemporaryDirectory(prefix="tpc-bench-") as tmp:
        profile = cpu_profile(MODEL, FACTORY, L, Path(tmp) / "cpu.msgpack", given=args.profile)
        plans = [compile_plan(MODEL, Path(tmp) / f"{s}-{n}.tpir", factory=FACTORY, stages=2, microbatches=1,
                              seq_len=L, batch=1, slices=n, schedule=s, **({"cost": profile} if n == "auto" else {}))
                 for s, n in PLANS]
        results = {p: [] for p in plans}
        for rep in range(args.repeats):
            for p in plans:
                trace = str(Path(tmp) / f"trace{rep}.json")
                measure(p, trace, args.steps)
                results[p].append(compare(p, profile, trace))
        for (schedule, n), p in zip(PLANS, plans):
            iters = [rs[0] for rs in results[p]]  # the "iteration time" row of each run
            predicted = iters[0].predicted
            measured = median(r.measured for r in iters)
            err = median(r.error for r in iters)
            good = abs(err) <= 0.15
            ok_all &= good
            computes = "; ".join(f"{r.what}: {median(x.error for x in rows_):+.1%}"
                                 for r, rows_ in zip(results[p][0][1:],
                                                     zip(*[rs[1:] for rs in results[p]])))
            rows.append([f"L={L} {schedule}, slices {n}", f"{predicted:.1f}", f"{measured:.1f}",
                         f"{err:+.1%}", computes, ok(good)])
    print(f"simulator accuracy on {MACHINE}: GPT 4x256 untied, 2 stages on 2 gloo ranks under torchrun, "
          f"1 sequence of {L} tokens, CPU profile from `tpc profile`; {args.repeats} runs of {args.steps} steps; "
          f"{load_note()}")
    print(table(["plan", "predicted ms", "measured ms (median)", "error (median)", "compute per rank, error",
                 "within 15%"], rows))
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
