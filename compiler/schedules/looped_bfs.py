"""LoopedBFS (torch.distributed.pipelining's ScheduleLoopedBFS): breadth first over the chunks.

Each rank runs every forward of its first chunk, then every forward of its next chunk, and so
on; then the backwards chunk by chunk in reverse, each chunk's micro-batches in reverse order
(last fed, first back, as torch runs them), each micro-batch's slices in reverse token order.
It is GPipe applied chunk by chunk: every activation of the step is alive at the turn.

Built as one global order projected onto the ranks (every forward of stage 0, of stage 1, ...,
then every backward of stage K-1, K-2, ...), so it accepts any placement; with the looped one
(stage s on rank s mod p) it is torch's schedule.
"""

from __future__ import annotations

from tpc.compiler.schedules.common import (
    Compute,
    backward,
    backward_units,
    forward,
    forward_units,
    project,
)
from tpc.ir.nodes import Header

NAME = "looped-bfs"
PLACEMENT = "looped"


def build(header: Header) -> Compute:
    stages = range(header.num_stages)
    fwd = forward_units(header)
    bwd = backward_units(header, reversed(range(len(header.microbatches))))
    order = [forward(s, m, i) for s in stages for m, i in fwd]
    order += [backward(s, m, i) for s in reversed(stages) for m, i in bwd]
    return project(header, order)
