"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B's peak memory, a
third of its bubble.

The backward is split in two: B (`backward-input`: the gradient the previous stage waits for)
and W (`backward-weight`: the parameter gradient nobody waits for), and W is deferred into the
bubbles. Under F = B = W the bubble of a rank (its idle time between its first and last compute)
falls from 1F1B's (p-1)(F+B+W) to (p-1)(F+B-W), while no rank holds more micro-batches'
activations (from a forward to its W) than 1F1B's first rank, p.

The rules are those of `list_scheduler` on whole micro-batches: rank r runs 1F1B's warm-up of
p - 1 - r forwards, then alternately one forward and one B; a W runs when the wanted B has not
arrived yet, or when the rank holds p micro-batches and must free one before its next forward,
and the rest of the W's at the end. Rank r so delays its first W by r forward-B pairs, as the
paper's ZB-H1 figure and torch's ZB1P do. A micro-batch's forward is all its token slices, its B
and W all of them in reverse token order (the token-slice granularity is `seq-zb`).

With v chunks per rank (the looped placement) the same rules run micro-batches through the chunks
in Megatron's groups of p: warm-up (v-1)p + p - 1 - r, at most v p held (torch's
ScheduleInterleavedZeroBubble).
"""

from __future__ import annotations

from tpc.compiler.schedules import list_scheduler
from tpc.compiler.schedules.common import Compute
from tpc.ir.nodes import Header

NAME = "zb-h1"
PLACEMENT = "looped"


def build(header: Header) -> Compute:
    p = header.mesh.pipe
    units = list_scheduler.microbatch_units(header)
    return list_scheduler.build(header, units, split=True, extra=lambda r: p - 1 - r, hold=lambda r: p)
