"""The memory half of bench/vs_torch_pipelining.py alone: tpc's and torch's peak RSS per rank
(MiB above the RSS before the first step) for the 2-stage 1f1b plan, each framework `--runs`
times in fresh processes, alternating.

It uses the `bench/vs_torch_pipelining.py` of the directory it runs in, so the same file
measures another revision: check it out or `git archive` it, `pip install .` it into a virtual
environment of its own, and run this script there with that environment's Python:

    cd CHECKOUT && OMP_NUM_THREADS=1 /path/to/venv/bin/python /path/to/bench/pipelining_memory.py --label REV
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="this tree", help="what to call this revision in the output")
    ap.add_argument("--runs", type=int, default=2, help="runs of each framework, alternating (default: 2)")
    ap.add_argument("--steps", type=int, default=2, help="steps per run (default: 2)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path.cwd()))
    import bench.vs_torch_pipelining as b

    b.at_root()
    with tempfile.TemporaryDirectory(prefix="tpc-bench-") as tmp:
        plan = b.compile_plan(b.MODEL, Path(tmp) / "1f1b2.tpir", factory="model", stages=2, microbatches=b.MICRO,
                              seq_len=b.SEQ, batch=b.BATCH, slices=1, schedule="1f1b")
        for _ in range(args.runs):
            for fw in ("tpc", "torch"):
                peaks = b.launch(2, b.rank_memory, plan, "1f1b", fw, args.steps)
                print(f"{args.label} {fw}: " + " / ".join(f"{p / 1024:.1f}" for p in peaks) + " MiB", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
