"""Chimera with forward doubling (Li & Hoefler, SC'21, section 3.5): the paper's remedy for a
backward about twice as long as a forward.

Plain Chimera's basic units concatenate without gaps when a forward costs as much as a backward
(its figures); with B = 2F they leave bubbles between units. Forward doubling runs the forwards
of two micro-batches of the same pipeline together, so that a "forward" costs 2F = B like a
backward and the units fit again, at the price of twice the activations: a rank holds up to
2D micro-batches' instead of D.

In tpc the two forwards of a pair are two `forward` instructions back to back on each rank (a
pair is micro-batches m and m + 2: consecutive in one direction, cut into the same slices; the
last of a direction may run alone), so nothing new reaches the IR or the executors: the plan is
an ordinary chimera plan (format version 3, two weight replicas, `reduce-replicas`), exact
under both executors like any valid order, and the simulator prices it as it prices any plan.
The order is made by the same run as chimera's (compiler/schedules/chimera.py), with the pair's
forwards one job of twice the cost that needs both micro-batches' inputs, and the memory cap
doubled. Its constraints are chimera's.

Unit costs (F = 1, B = 2 per micro-batch and stage): in the picture of the paper's figure a
slot lasts B and holds one backward or one doubled forward, a rank has N/2 + N work slots and
Chimera's D - 2 empty ones, so a step of N = 2kD micro-batches lasts 2(3N/2 + D - 2) =
3N + 2D - 4, a bubble of (D-2)/(3N/2+D-2). Under buffered sends the order meets it from
N = 4D on and beats it at N = 2D; with N = D or an odd multiple of D plain chimera can be
faster (tests/compiler/test_schedules_chimera_doubling.py, bench/chimera_doubling.py).
"""

from __future__ import annotations

from tpc.compiler.schedules.chimera import build_order
from tpc.compiler.schedules.common import Compute
from tpc.ir.nodes import Header

NAME = "chimera-doubling"
PLACEMENT = "bidirectional"
REPLICAS = 2  # weight replicas of every stage: the down and the up pipeline


def build(header: Header) -> Compute:
    return build_order(header, doubling=True, schedule=NAME)
