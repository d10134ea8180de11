"""Chimera's forward doubling against plain chimera and 1F1B, under the simulator's unit costs,
beside the paper's bubble formulas.

For D = 2, 4, 8 stages on D ranks and N = D, 2D, 4D micro-batches of one slice each, every
schedule is built, lowered, verified and simulated (no transfer time; gloo's buffered sends, or
NCCL's rules with --comm nccl). Costs per micro-batch and stage: a forward 1, a backward 1 (the
paper's figures, F = B) or 2 (B = 2F, the usual ratio and the case forward doubling is for).
Printed per row: the step (units), the bubble (idle over the step, the mean of the ranks) and
the formula's bubble, and the peak activations per rank in micro-batches:

* 1f1b, F = B or B = 2F: (D-1)/(N+D-1);
* chimera, F = B: (D-2)/(2N+D-2), its N = kD units concatenated directly;
* chimera, B = 2F: no formula in the paper (concatenated units leave bubbles between them);
* chimera-doubling, B = 2F: (D-2)/(3N/2+D-2), the figure's slots of length B (a backward, or
  a pair's two forwards) with Chimera's D-2 empty ones per rank, for N = 2kD.

    python bench/chimera_doubling.py [--stages 2,4,8] [--factors 1,2,4] [--comm gloo|nccl]
"""

from __future__ import annotations

import argparse
from fractions import Fraction

from tpc.compiler.costmodel.unit import UnitCosts
from tpc.compiler.lowering.lower import lower
from tpc.compiler.optimise.slicing import ranges_of
from tpc.compiler.predict.simulate import simulate
from tpc.compiler.schedules import build_schedule, with_replicas
from tpc.ir.nodes import Header, MeshLine, Microbatch, ModelLine, ScheduleLine, ShapeLine, Stage, UnitsLine
from tpc.ir.semantics import GLOO, NCCL

SEQ = 64


def header(D: int, N: int, schedule: str) -> Header:
    return with_replicas(Header(
        model=ModelLine("m.py", "0" * 64), shape=ShapeLine(batch=N, seq=SEQ, vocab=16),
        mesh=MeshLine(pipe=D, data=1), schedule=ScheduleLine(schedule), units=UnitsLine(D),
        stages=tuple(Stage(s, s, (s, s + 1)) for s in range(D)),
        microbatches=tuple(Microbatch(i, 1, ranges_of((SEQ,))) for i in range(N))))


def run(schedule: str, D: int, N: int, backward: float, comm):
    h = header(D, N, schedule)
    return simulate(lower(h, build_schedule(schedule, h), comm=comm), UnitCosts(backward=backward), comm)


def formula(name: str, D: int, N: int, backward: float) -> str:
    if name == "1f1b":
        f = Fraction(D - 1, N + D - 1)
    elif name == "chimera" and backward == 1:
        f = Fraction(D - 2, 2 * N + D - 2)
    elif name == "chimera-doubling" and backward == 2 and N % (2 * D) == 0:
        f = Fraction(D - 2) / (Fraction(3 * N, 2) + D - 2)
    else:
        return "-"
    return f"{float(f):.3f}"


ROWS = (("1f1b", 1.0), ("1f1b", 2.0), ("chimera", 1.0), ("chimera", 2.0), ("chimera-doubling", 2.0))


def table(stages, factors, comm) -> list[str]:
    head = f"{'D':>2} {'N':>3}  {'schedule':<17} {'B/F':>3} {'step':>6} {'bubble':>7} {'formula':>8} {'acts':>5}"
    lines = [f"comm {comm.value}, unit costs (forward 1 per micro-batch and stage)", head]
    for D in stages:
        for N in (f * D for f in factors):
            for name, backward in ROWS:
                r = run(name, D, N, backward, comm)
                acts = max(x.peak_memory.activations for x in r.ranks)
                lines.append(f"{D:>2} {N:>3}  {name:<17} {backward:>3.0f} {r.iteration_time:>6.0f} "
                             f"{r.bubble:>7.3f} {formula(name, D, N, backward):>8} {acts:>5.0f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="2,4,8")
    ap.add_argument("--factors", default="1,2,4", help="micro-batches as multiples of the stages")
    ap.add_argument("--comm", default="gloo", choices=("gloo", "nccl"))
    a = ap.parse_args()
    print("\n".join(table([int(x) for x in a.stages.split(",")], [int(x) for x in a.factors.split(",")],
                          GLOO if a.comm == "gloo" else NCCL)))


if __name__ == "__main__":
    main()
