"""GPipe: every forward of the step, then every backward.

Forwards run micro-batch by micro-batch, each micro-batch's token slices in order, stage by
stage. Backwards then run micro-batch by micro-batch in the order the micro-batches were fed
(0, 1, ..., M-1), the way torch.distributed.pipelining's ScheduleGPipe runs them, each
micro-batch's slices in reverse token order (slice i needs the K/V gradients of slices > i).
That micro-batch order is what sets it apart from 'terapipe', which back-propagates in the
exact reverse of its forward order.

Built as one global order projected onto the ranks, so a rank may hold several stages.
"""

from __future__ import annotations

from tpc.compiler.schedules.common import Compute, forwards_then_backwards
from tpc.ir.nodes import Header

NAME = "gpipe"
PLACEMENT = "looped"


def build(header: Header) -> Compute:
    return forwards_then_backwards(header, range(len(header.microbatches)))
