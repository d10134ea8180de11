"""KV buffers sized once from the plan vs grown by doubling: the token-slicing plan, both ways.

The engine passes each micro-batch's token count to the stage runtime (`capacity`), so a
micro-batch's KV buffers are allocated once at its first slice. Without it they grow by doubling,
copying the cache each time and leaving earlier slices' prefix views pinning the outgrown
buffers. This script measures what that costs: bench/token_slicing.py's setup (the `long`
4 x 256 model, L tokens, 2 stages on 2 gloo ranks, one thread each, `--slices auto` from a
fresh `tpc profile`, terapipe), with the sliced plan run alternately with the capacity and with
the runtime's doubling fallback (the capacity withheld), next to the unsliced plan. Blocks of
steps alternate in the same two processes; each block's first step is left out; medians.

    OMP_NUM_THREADS=1 python bench/kv_capacity.py [--seq-len 1024] [--repeats 6]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (MACHINE, at_root, compile_plan, cpu_profile, launch, load_note, median, table,  # noqa: E402
                    tpc_setup, tpc_step_times)
from token_slicing import FACTORY, MODEL, slices_of  # noqa: E402

VARIANTS = ("unsliced", "sliced, capacity from the plan", "sliced, doubling buffers")


def rank_alternate(rank: int, world: int, plans: list, repeats: int, block: int) -> dict:
    from tpc.executors import stage_runtime

    append = stage_runtime.StageRuntime._append
    withhold = {"on": False}

    def maybe_without_capacity(self, mb, kv, capacity):
        return append(self, mb, kv, None if withhold["on"] else capacity)

    stage_runtime.StageRuntime._append = maybe_without_capacity
    plain, sliced = (tpc_setup(p) for p in plans)
    times = {v: [] for v in VARIANTS}
    for _ in range(repeats):
        for variant, (plan, model, sm) in zip(VARIANTS, (plain, sliced, sliced)):
            withhold["on"] = variant == VARIANTS[2]
            times[variant] += tpc_step_times(plan, model, sm, rank, world, block + 1)[1:]
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=1024, help="sequence length L (default: 1024)")
    ap.add_argument("--repeats", type=int, default=6, help="alternations (default: 6)")
    ap.add_argument("--block", type=int, default=3, help="timed steps per block (default: 3)")
    args = ap.parse_args(argv)
    at_root()

    L = args.seq_len
    with tempfile.TemporaryDirectory(prefix="tpc-bench-") as tmp:
        profile = cpu_profile(MODEL, FACTORY, L, Path(tmp) / "cpu.msgpack")
        common = dict(factory=FACTORY, stages=2, microbatches=1, seq_len=L, batch=1, schedule="terapipe")
        plans = [compile_plan(MODEL, Path(tmp) / "plain.tpir", slices=1, **common),
                 compile_plan(MODEL, Path(tmp) / "sliced.tpir", slices="auto", cost=profile, **common)]
        times = launch(2, rank_alternate, plans, args.repeats, args.block)[0]
        slices = slices_of(plans[1])
    base = median(times[VARIANTS[0]])
    rows = [[v, f"{median(t) * 1e3:.1f}", f"{base / median(t):.2f}x"] for v, t in times.items()]
    print(f"KV buffers on {MACHINE}: GPT 4x256 untied, L={L}, 2 stages on 2 gloo ranks, terapipe, "
          f"slices {slices}; {args.repeats} x {args.block} alternating timed steps each; {load_note()}")
    print(table(["plan, runtime", "median step ms", "speedup over unsliced"], rows))
    ratio = median(times[VARIANTS[2]]) / median(times[VARIANTS[1]])
    print(f"doubling / capacity: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
