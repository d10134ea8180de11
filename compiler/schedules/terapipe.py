"""TeraPipe: token-slice pipelining with all forwards first, then all backwards in reverse.

Forwards run micro-batch by micro-batch, slice by slice (slice i+1 of a stage can start as soon
as slice i left it, which is what fills the pipeline when there are few micro-batches);
backwards run in the exact reverse of that order: last micro-batch first, each micro-batch's
slices in reverse token order, as the TeraPipe paper (Li et al., 2021) runs them. Every slice
activation of the step is alive at the turn from forwards to backwards.

Built as one global order projected onto the ranks, so a rank may hold several stages.
"""

from __future__ import annotations

from tpc.compiler.schedules.common import Compute, forwards_then_backwards
from tpc.ir.nodes import Header

NAME = "terapipe"
PLACEMENT = "looped"


def build(header: Header) -> Compute:
    return forwards_then_backwards(header, reversed(range(len(header.microbatches))))
