"""Time of the optimiser's DP (token slices + batch knapsack) on paper-sized problems.

Cost model: the analytic V100 model of GPT-3 44B (96 layers, hidden 6144, 48 heads), one layer
per stage, so K = 96. Targets: L = 2048 at 8-token granularity within 1 s for every batch size
from 2 to 32; L = 8192 within 10 s.

    OMP_NUM_THREADS=1 python bench/dp_speed.py [--quick] [--search]

--search also times the whole plan search of `tpc compile --stages auto --ranks N --slices auto
--schedule auto` (DP runs, partitions, lowering and simulating the candidates) on an analytic
A100 model of a 24-layer GPT (hidden 2048), without tracing a model. Targets: 8 ranks at
L = 1024 within 10 s, 16 ranks at L = 2048 within 30 s.
"""

from __future__ import annotations

import argparse
import time

from tpc.compiler.costmodel import AnalyticCostModel, ModelShapes, even_layers
from tpc.compiler.costmodel.devices import V100
from tpc.compiler.optimise.slice_optimiser import optimise


def run(L: int, batch: int, K: int = 96, granularity: int = 8):
    shapes = ModelShapes(layers=96, hidden=6144, heads=48, vocab=50257)
    cost = AnalyticCostModel(V100, shapes, even_layers(96, K), op=1)
    t0 = time.perf_counter()
    choice = optimise(cost, K, L, batch, granularity=granularity)
    return time.perf_counter() - t0, choice


def run_search(L: int, batch: int, microbatches: int, ranks: int):
    """The plan search of `tpc compile --stages auto --ranks N`, on a model that is not traced:
    unit labels and ties are all a header needs from the front end."""
    from types import SimpleNamespace

    from tpc.cli.compile import check_options
    from tpc.compiler.header import header_maker
    from tpc.compiler.pipeline import search_space
    from tpc.compiler.costmodel.resolve import load_cost_source
    from tpc.compiler.optimise.search import search_plan

    shapes = ModelShapes(layers=24, hidden=2048, heads=16, vocab=50257)
    n = shapes.layers + 2
    source = load_cost_source(device_model="a100", model_shapes=shapes, num_units=n)
    front = SimpleNamespace(unit_labels=[f"unit{u}" for u in range(n)], ties=lambda ranges: [])
    opts = check_options(stages="auto", microbatches=microbatches, seq_len=L, batch=batch,
                         slices="auto", schedule="auto", dp=1, ranks=ranks, device_model="a100")
    make = header_maker(model_path="gpt24.py", sha256="0" * 64, factory="model", opts=opts,
                        vocab=shapes.vocab, sliced=front)
    t0 = time.perf_counter()
    result = search_plan(source, search_space(opts, n), make)
    return time.perf_counter() - t0, result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only L=2048, batch 2 and 32")
    ap.add_argument("--search", action="store_true", help="also time the plan search")
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
    if args.search:
        print(f"\n{'plan search (24 layers, a100)':<44} {'seconds':>8} {'target':>7} {'ok':>4}  "
              f"{'built':>5}/{'all':<4} chosen")
        for L, batch, mbs, ranks, target in ((1024, 16, 4, 8, 10.0), (2048, 32, 4, 16, 30.0)):
            secs, res = run_search(L, batch, mbs, ranks)
            ok = secs <= target
            ok_all &= ok
            built = sum(c.simulated for c in res.candidates)
            b = res.best
            name = f"L={L} batch={batch} mb={mbs} ranks={ranks}"
            print(f"{name:<44} {secs:8.2f} {target:7.1f} {'yes' if ok else 'NO':>4}  "
                  f"{built:5d}/{len(res.candidates):<4} {b.pipe}x{b.data} {b.schedule} "
                  f"{b.slicing.summary()}")
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
