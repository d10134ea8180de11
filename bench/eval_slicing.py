"""Token slicing of the evaluation program on 2 CPU ranks: the forward-only DP's slices vs none.

The model is bench/models/gpt_untied.py's `long` (examples/gpt.py, 4 layers, width 256), one
micro-batch of one sequence of L tokens, 2 pipeline stages on 2 gloo ranks with one thread each.
`tpc compile --slices auto --cost PROFILE` (the CPU profile from `tpc profile`, run first) writes
the plan; its evaluation program is sliced by the DP without backward (compiler/lowering/eval_program.py).
Beside it, the same plan with an unsliced evaluation program (one slice of L tokens).

Measured: blocks of evaluations (one batch each, `Evaluation.run`, what `tpc run --eval-data`
runs under torchrun) alternate between the unsliced and the sliced evaluation program in the
same two processes; each block's first evaluation is warm-up; the speedup is
median(unsliced) / median(sliced). Predicted: `tpc simulate`'s time of both evaluation programs
(`Plan.evaluation()`) under the profile. No target: this records what token slicing does for a
forward-only program.

    OMP_NUM_THREADS=1 python bench/eval_slicing.py [--seq-len 1024] [--repeats 3] [--block 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MACHINE, at_root, compile_plan, cpu_profile, launch, load_note, median, table  # noqa: E402

MODEL, FACTORY = "bench/models/gpt_untied.py", "long"


class _Batches:
    """One random batch (seed 0) as the validation set."""

    def __init__(self, header):
        from tpc.executors.training.batches import RandomTokens

        s = header.shape
        self.tokens, self.count = RandomTokens(0, s.batch, s.seq, s.vocab), 1

    def get(self, k):
        return self.tokens.get(k)


def variants(plan):
    """(label, plan) of the compiled plan and the same with an unsliced evaluation program."""
    from tpc.compiler.lowering.eval_program import eval_program

    h = plan.header
    whole = tuple(dataclasses.replace(m, slices=((0, h.shape.seq),)) for m in plan.eval.microbatches)
    return [("unsliced", dataclasses.replace(plan, eval=eval_program(h, whole))), ("DP, forward only", plan)]


def rank_alternate(rank: int, world: int, plan_path: str, repeats: int, block: int):
    import torch

    from common import tpc_setup
    from tpc.executors.distributed import Distributed, World
    from tpc.executors.evaluation import Evaluation
    from tpc.executors.options import RunOptions
    from tpc.executors.plan_model import StageSource
    from tpc.executors.pipeline import PlanSet

    plan, model, sliced = tpc_setup(plan_path)
    options = RunOptions(steps=1, timeout=600.0, eval_data="random")
    plans = PlanSet.single(plan)
    executor = Distributed(World(rank, world, rank), options, torch.device("cpu"), plans,
                           stages=StageSource.of(plans, model, sliced=sliced), model=model)
    evals = [Evaluation(_Batches(p.header), 0, 1, executor.build_eval(p, None).evaluate)
             for _, p in variants(plan)]
    times = [[] for _ in evals]
    for _ in range(repeats):
        for which, ev in enumerate(evals):
            for k in range(block + 1):
                t = time.perf_counter()
                ev.run()
                if k:
                    times[which].append(time.perf_counter() - t)
    return times


def predicted(plan, profile: str) -> float:
    from tpc.compiler.costmodel import load_cost_model
    from tpc.compiler.predict.simulate import simulate
    from tpc.ir.semantics import GLOO

    h = plan.header
    costs = load_cost_model(cost=profile, stage_units=[s.units for s in h.stages], num_units=h.units.count,
                            model_sha256=h.model.sha256)
    return simulate(plan.evaluation(), costs, GLOO).iteration_time  # measured on gloo ranks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=1024, help="sequence length L (default: 1024)")
    ap.add_argument("--repeats", type=int, default=3, help="alternations of the two programs (default: 3)")
    ap.add_argument("--block", type=int, default=3, help="timed evaluations per block (default: 3)")
    ap.add_argument("--profile", help="use this CPU profile instead of running `tpc profile` first")
    args = ap.parse_args(argv)
    at_root()
    from tpc.ir.verify import verify_file

    L = args.seq_len
    with tempfile.TemporaryDirectory(prefix="tpc-bench-") as tmp:
        profile = cpu_profile(MODEL, FACTORY, L, Path(tmp) / f"cpu{L}.msgpack", given=args.profile)
        path = compile_plan(MODEL, Path(tmp) / "plan.tpir", factory=FACTORY, stages=2, microbatches=1,
                            seq_len=L, batch=1, schedule="seq1f1b", slices="auto", cost=profile)
        plan = verify_file(path)
        t0 = time.monotonic()
        measured = launch(2, rank_alternate, path, args.repeats, args.block)[0]
        print(f"  runs: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        rows = []
        labelled = variants(plan)
        base = median(measured[0])
        p_base = predicted(labelled[0][1], profile)
        for (label, p), times in zip(labelled, measured):
            lengths = [hi - lo for m in p.eval.microbatches for lo, hi in m.slices]
            t, pt = median(times), predicted(p, profile)
            rows.append([label, f"{len(lengths)}: " + " ".join(map(str, lengths)), f"{t * 1e3:.0f}",
                         f"{base / t:.2f}x", f"{pt * 1e3:.0f}", f"{p_base / pt:.2f}x"])
        train = [hi - lo for m in plan.header.microbatches for lo, hi in m.slices]
    print(f"evaluation program on {MACHINE}: GPT 4x256 untied, L={L}, 2 stages on 2 gloo ranks (1 thread "
          f"each), 1 sequence; training slices {len(train)}: {' '.join(map(str, train))}; "
          f"{args.repeats} x {args.block} alternating timed evaluations each; {load_note()}")
    print(table(["evaluation program", "slices", "measured ms per batch", "speedup", "predicted ms",
                 "predicted speedup"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
