"""1F1B (PipeDream-flush) with micro-batch granularity.

Stage s runs a warm-up of min(K - s - 1, M) micro-batch forwards, then alternates one
micro-batch forward with one micro-batch backward (oldest first), then drains the remaining
backwards. A micro-batch's forward is all its token slices in order; its backward is all of them
in reverse token order. Stage s therefore holds at most K - s micro-batches' activations.

Needs exactly one stage per pipeline rank (the interleaved variant is another schedule).
"""

from __future__ import annotations

from tpc.compiler.schedules.common import (
    Compute,
    backward,
    backward_units,
    empty,
    forward,
    one_f_one_b,
    one_stage_per_rank,
    slice_counts,
)
from tpc.ir.nodes import Header

NAME = "1f1b"


def build(header: Header) -> Compute:
    K = header.num_stages
    counts = slice_counts(header)
    out = empty(header)
    for rank, s in enumerate(one_stage_per_rank(header, NAME)):
        fwd = [[forward(s, m, i) for i in range(n)] for m, n in enumerate(counts)]
        bwd = [[backward(s, m, i) for _, i in backward_units(header, [m])] for m in range(len(counts))]
        out[rank] = [instr for group in one_f_one_b(fwd, bwd, K - s - 1) for instr in group]
    return out
