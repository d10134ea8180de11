"""Time of the optimiser's DP (token slices + batch knapsack) on paper-sized problems.

Cost model: the analytic V100 model of GPT-3 44B (96 layers, hidden 6144, 48 heads), one layer
per stage, so K = 96. Targets: L = 2048 at 8-token granularity within 1 s for every batch size
from 2 to 32; L = 8192 within 10 s.

    OMP_NUM_THREADS=1 python bench/dp_speed.py [--quick]
"""

from __future__ import annotations

import argparse
import time

from tpc.compiler.costmodel import AnalyticCostModel, ModelShapes, even_layers
from tpc.compiler.costmodel.devices import V100
from tpc.compiler.optimiser import optimise


def run(L: int, batch: int, K: int = 96, granularity: int = 8):
    shapes = ModelShapes(layers=96, hidden=6144, heads=48, vocab=50257)
    cost = AnalyticCostModel(V100, shapes, even_layers(96, K), op=1)
    t0 = time.perf_counter()
    choice = optimise(cost, K, L, batch, granularity=granularity)
    return time.perf_counter() - t0, choice


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only L=2048, batch 2 and 32")
    args = ap.parse_args(argv)
    setups = [(2048, b, 1.0) for b in ((2, 32) if args.quick else (2, 4, 8, 16, 32))]
    if not args.quick:
        setups += [(8192, b, 10.0) for b in (2, 8, 32)]
    print(f"{'setup':<34} {'seconds':>8} {'target':>7} {'ok':>4}  {'DP runs':>7}  slices/mb")
    ok_all = True
    for L, b, target in setups:
        secs, ch = run(L, b)
        ok = secs <= target
        ok_all &= ok
        name = f"L={L} g=8 K=96 batch={b}"
        print(f"{name:<34} {secs:8.3f} {target:7.1f} {'yes' if ok else 'NO':>4}  "
              f"{ch.evaluated:7d}  {len(ch.mb_sizes)} mb x {ch.num_slices // len(ch.mb_sizes)}")
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
