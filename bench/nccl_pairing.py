"""What NCCL-safe plans cost on gloo: the same schedule lowered with and without exchanges.

The model is examples/gpt.py as it is (4 layers, width 128, tied head), batch 8 x 128 tokens,
compiled with `tpc compile --stages 2 --microbatches 4 --slices 4 --schedule S` twice: `--comm
gloo` (no exchanges: the plan gloo's buffered sends need) and the default `--comm nccl` (the
sends and receives two ranks must post together paired into `exchange`s). Two gloo ranks run,
in one process group, alternating blocks of `--steps` steps (after one warm-up step each):

- A: the gloo plan under gloo's rules (receives posted ahead, sends waited on at `step`);
- B: the NCCL plan under gloo's rules (the exchanges change nothing there but where the
  receives sit: lowering moves each paired receive up to its send);
- C: the NCCL plan under NCCL's rules on gloo (`tpc run --comm nccl`: the NCCL branch of the
  executor, receives at their own instruction, each exchange one `batch_isend_irecv`, every
  send complete before the rank goes on), what a GPU run does.

Ratios are median step times, B / A and C / A, per schedule. Plain SGD; steps end with the
loss all-reduce, a sync point of both ranks.

    OMP_NUM_THREADS=1 python bench/nccl_pairing.py [--steps 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import at_root, compile_plan, launch, load_note, median, table, tpc_run, tpc_setup  # noqa: E402

MODEL = "examples/gpt.py"
SEQ, BATCH = 128, 8
KINDS = (("A", "gloo", "gloo"), ("B", "nccl", "gloo"), ("C", "nccl", "nccl"))  # (name, plan, rules)


def rank_blocks(rank: int, world: int, plans: dict, steps: int, repeats: int):
    """{(schedule, kind): [step seconds]} of alternating blocks on this rank."""
    setups = {key: tpc_setup(path) for key, path in plans.items()}
    times: dict = {}
    for _ in range(repeats):
        for schedule in sorted({s for s, _ in plans}):
            for name, plan_kind, rules in KINDS:
                plan, model, sliced = setups[(schedule, plan_kind)]
                got = []
                tpc_run(plan, model, sliced, rank, world, steps + 1, comm=rules,
                        on_step=lambda s, loss, info: got.append(info["step_time"]))
                times.setdefault((schedule, name), []).extend(got[1:])
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4, help="timed steps per block (default: 4)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating blocks of each kind (default: 3)")
    ap.add_argument("--schedules", default="1f1b,seq1f1b", help="comma-separated (default: 1f1b,seq1f1b)")
    args = ap.parse_args(argv)
    at_root()
    schedules = args.schedules.split(",")
    with tempfile.TemporaryDirectory(prefix="tpc-pairing-") as tmp:
        plans = {}
        for schedule in schedules:
            for comm in ("gloo", "nccl"):
                plans[(schedule, comm)] = compile_plan(
                    MODEL, Path(tmp) / f"{schedule}-{comm}.tpir", stages=2, microbatches=4, slices=4,
                    seq_len=SEQ, batch=BATCH, schedule=schedule, comm=comm)
        results = launch(2, rank_blocks, plans, args.steps, args.repeats)
    rows = []
    for schedule in schedules:
        med = {name: median(results[0][(schedule, name)]) for name, _, _ in KINDS}
        rows.append([schedule, f"{med['A'] * 1e3:.1f}", f"{med['B'] * 1e3:.1f}", f"{med['C'] * 1e3:.1f}",
                     f"{med['B'] / med['A']:.3f}", f"{med['C'] / med['A']:.3f}"])
    print(table(["schedule", "A gloo plan (ms)", "B nccl plan, gloo rules (ms)",
                 "C nccl plan, nccl rules (ms)", "B / A", "C / A"], rows))
    print(f"\n2 gloo ranks, {args.repeats} x {args.steps} steps per kind; {load_note()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
