"""ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): more memory, no bubble
inside a rank's step.

As ZB-H1 (B and W apart, W deferred into the bubbles, `list_scheduler`'s rules), but rank r
warms up with 2(p - 1 - r) forwards (Megatron's interleaved warm-up) and may hold 2p - 1
micro-batches instead of p. The extra forwards fill the wait before the first B arrives and the
queued W's the one after the last, so under F = B = W each rank computes without a gap from
its first forward to its last W: the paper's bubble (p-1)(F+B-2W) = 0. The step still ends
(p-1)F after a rank that started (p-1)F late (the last rank waits for its first input), so a
single step takes as long as ZB-H1's; the gain is that consecutive steps overlap, each rank
starting its next step right after its own optimizer step.

It needs M >= 2p - 1 micro-batches to fill that warm-up; with fewer it runs ZB-H1's warm-up and
limit (which then hold every micro-batch anyway).
"""

from __future__ import annotations

from tpc.compiler.schedules import list_scheduler
from tpc.compiler.schedules.common import Compute
from tpc.ir.nodes import Header

NAME = "zb-h2"
PLACEMENT = "looped"


def build(header: Header) -> Compute:
    p = header.mesh.pipe
    units = list_scheduler.microbatch_units(header)
    if len(units) < 2 * p - 1:  # too few micro-batches to fill the warm-up: ZB-H1
        return list_scheduler.build(header, units, split=True, extra=lambda r: p - 1 - r, hold=lambda r: p)
    return list_scheduler.build(header, units, split=True, extra=lambda r: 2 * (p - 1 - r),
                                hold=lambda r: 2 * p - 1)
