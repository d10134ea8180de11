"""Merak's critical-path 1F1B against 1F1B with the same full recomputation, under the
simulator's unit costs (a stage's forward 1, recompute 1, backward 2; no transfer time).

For p = 2, 4, 8 pipeline stages and m = p, 2p, 4p micro-batches of one slice each, every variant
(compiler/schedules/critical_path.py) is built, lowered, verified and simulated, under buffered
sends (gloo) and under NCCL's rules (one in-order stream per rank pair, a send waits for its
receive). Printed side by side: the iteration time, its ratio to `1f1b --recompute full`, and
the bubble (idle time over the step, the mean of the ranks).

    python bench/critical_path.py [--stages 2,4,8] [--factors 1,2,4]
"""

from __future__ import annotations

import argparse

from tpc.compiler.costmodel.unit import UnitCosts
from tpc.compiler.lowering import recompute
from tpc.compiler.lowering.lower import lower
from tpc.compiler.optimise.slicing import ranges_of
from tpc.compiler.predict.simulate import simulate
from tpc.compiler.schedules import build_schedule, own_recompute
from tpc.ir.nodes import Header, MeshLine, Microbatch, ModelLine, ScheduleLine, ShapeLine, Stage, UnitsLine
from tpc.ir.semantics import GLOO, NCCL

BASE = "1f1b"
VARIANTS = ("1f1b-pre-recompute", "1f1b-last-no-recompute", "1f1b-critical-path")
SEQ = 64


def header(p: int, m: int, schedule: str) -> Header:
    return Header(
        model=ModelLine("m.py", "0" * 64), shape=ShapeLine(batch=m, seq=SEQ, vocab=16),
        mesh=MeshLine(pipe=p, data=1), schedule=ScheduleLine(schedule), units=UnitsLine(p),
        stages=tuple(Stage(s, s, (s, s + 1)) for s in range(p)),
        microbatches=tuple(Microbatch(i, 1, ranges_of((SEQ,))) for i in range(m)))


def run(schedule: str, p: int, m: int, comm):
    h = header(p, m, schedule)
    compute = build_schedule(schedule, h)
    if not own_recompute(schedule):  # the baseline: --recompute full
        compute = recompute.apply(compute, recompute.uniform(h, "full"))
    return simulate(lower(h, compute, comm=comm), UnitCosts(), comm)


def table(stages, factors, comm) -> list[str]:
    names = (BASE + " full",) + VARIANTS
    head = f"{'p':>2} {'m':>3}  " + "  ".join(f"{n:>26}" for n in names)
    lines = [f"comm {comm.value}: iteration time (ratio to 1f1b full) bubble", head]
    for p in stages:
        for m in (f * p for f in factors):
            base = run(BASE, p, m, comm)
            cells = []
            for name in (BASE,) + VARIANTS:
                r = base if name == BASE else run(name, p, m, comm)
                cells.append(f"{r.iteration_time:6.0f} ({r.iteration_time / base.iteration_time:.3f}) "
                             f"{r.bubble:.3f}")
            lines.append(f"{p:>2} {m:>3}  " + "  ".join(f"{c:>26}" for c in cells))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="2,4,8")
    ap.add_argument("--factors", default="1,2,4", help="micro-batches as multiples of the stages")
    a = ap.parse_args()
    stages = [int(x) for x in a.stages.split(",")]
    factors = [int(x) for x in a.factors.split(",")]
    for comm in (GLOO, NCCL):
        print("\n".join(table(stages, factors, comm)))
        print()


if __name__ == "__main__":
    main()
