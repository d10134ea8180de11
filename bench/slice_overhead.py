"""What one more token slice costs a stage, and how much two ranks slow each other down.

Why this exists: `bench/token_slicing.py` misses its 1.4x target on this 2-core machine. This
script splits the cost of slicing into the parts that decide it, for each half of the
bench/models/gpt_untied.py `long` model (the two stages of token_slicing.py), on one thread:

- fixed cost per slice: forward + backward of L=64 tokens as 8 slices, minus as 1 slice, over 7;
  also given for the forward and the backward apart.
  At 8 tokens a slice does almost no arithmetic, so this is dispatch, autograd and runtime
  bookkeeping: what a slice costs whatever its length.
- cost per extra slice at L=1024: the same difference for 1024 tokens (1 slice vs 8 slices).
- co-run slowdown: stage 0's 8-slice step timed in a process of its own, then both stages'
  timed at the same moment in two processes (as the two pipeline ranks run): the slower one's
  median over the first. With a free core per rank and memory bandwidth to spare it is 1.0.

Each time is the median of `--repeats` steps after one warm-up; the two sides of every
difference run alternately in the same process.

    OMP_NUM_THREADS=1 python bench/slice_overhead.py [--repeats 9]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MACHINE, at_root, table  # noqa: E402

MODEL, FACTORY, SEQ = "bench/models/gpt_untied.py", "long", 1024


def _stage(half: int):
    import torch

    from tpc.compiler.frontend import SlicedModel, load_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    sm = SlicedModel.from_model(load_model(MODEL, FACTORY), seq_len=SEQ, vocab=256)
    mid = sm.num_units // 2
    lo, hi = (0, mid) if half == 0 else (mid, sm.num_units)
    return sm.stage_module(lo, hi), sm.hidden_size


def _step(stage, hidden: int, L: int, n: int) -> tuple[float, float]:
    """Seconds for the forward of n equal slices of L tokens, and for their backward after."""
    import torch

    from tpc.executors.stage_runtime import StageRuntime

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, L + 1), generator=g)
    rt = StageRuntime(stage, 1.0 / L)
    cuts = [(L * i // n, L * (i + 1) // n) for i in range(n)]
    xs = [ids[:, a:b] if stage.is_first else torch.randn(1, b - a, hidden, generator=g) for a, b in cuts]
    gs = [None if stage.is_last else torch.randn(1, b - a, hidden, generator=g) for a, b in cuts]
    t0 = time.perf_counter()
    for i, (a, b) in enumerate(cuts):
        rt.forward(0, i, xs[i], a, ids[:, a + 1:b + 1])
    t1 = time.perf_counter()
    for i in reversed(range(n)):
        rt.backward(0, i, gs[i])
    rt.free_kv(0)
    t2 = time.perf_counter()
    stage.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1


def _pair(stage, hidden, L, repeats):
    """Median ms of 1 slice and of 8 slices of L tokens, alternating: each a (total, forward,
    backward) triple."""
    one, eight = [], []
    _step(stage, hidden, L, 1), _step(stage, hidden, L, 8)
    for _ in range(repeats):
        one.append(_step(stage, hidden, L, 1))
        eight.append(_step(stage, hidden, L, 8))

    def medians(steps):
        return tuple(statistics.median(part(s) for s in steps) * 1e3
                     for part in (lambda s: s[0] + s[1], lambda s: s[0], lambda s: s[1]))

    return medians(one), medians(eight)


def _corun_worker(half: int, repeats: int, start: float, out) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    at_root()
    stage, hidden = _stage(half)
    _step(stage, hidden, SEQ, 8)
    while time.time() < start:
        time.sleep(0.001)
    out.put(statistics.median(sum(_step(stage, hidden, SEQ, 8)) for _ in range(repeats)) * 1e3)


def _corun(halves, repeats: int) -> float:
    """Median ms of the slowest process's 8-slice step, one fresh process per stage half,
    all timed at the same moment."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    start = time.time() + 15.0  # the processes import torch and build their stage first
    procs = [ctx.Process(target=_corun_worker, args=(h, repeats, start, q)) for h in halves]
    for p in procs:
        p.start()
    got = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return max(got)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=9, help="timed steps per measurement (median)")
    opts = ap.parse_args()
    at_root()
    rows = []
    for half in (0, 1):
        stage, hidden = _stage(half)
        s1, s8 = _pair(stage, hidden, 64, opts.repeats)
        l1, l8 = _pair(stage, hidden, SEQ, opts.repeats)
        fixed, fixed_fwd, fixed_bwd = ((s8[k] - s1[k]) / 7 for k in range(3))
        extra = (l8[0] - l1[0]) / 7
        rows.append([f"stage {half} ({stage.lo}:{stage.hi})", f"{l1[0]:.1f}", f"{l8[0]:.1f}", f"{extra:.2f}",
                     f"{fixed:.2f}", f"{fixed_fwd:.2f} / {fixed_bwd:.2f}",
                     f"{fixed / extra:.0%}" if extra > 0 else "-"])
    print(f"{MACHINE}, one thread per process, L={SEQ}")
    print(table(["stage", "1 slice ms", "8 slices ms", "ms per extra slice", "fixed ms per slice (L=64)",
                 "of it forward / backward", "fixed share"], rows))
    alone = _corun((0,), opts.repeats)
    both = _corun((0, 1), opts.repeats)
    print(f"8 slices of L={SEQ}: stage 0 alone {alone:.1f} ms; stages 0 and 1 at once, in two "
          f"processes, the slower {both:.1f} ms: co-run slowdown {both / alone:.2f}x")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
