"""Seq1F1B: 1F1B over token slices (Sun et al., 2024).

The unit of work is one (micro-batch, slice). Forward units run in order (micro-batch by
micro-batch, slices in token order); backward units run micro-batch by micro-batch, each
micro-batch's slices in reverse token order. Stage s runs a warm-up of

    w_s = (n_max - 1) + (K - s - 1)        forward units   (n_max: most slices of any mb)

then alternates one forward unit with one backward unit, then drains the backwards.

Why this warm-up. Backward of slice i needs backward of slice i+1, so the first backward of a
micro-batch is its LAST slice, which needs that slice's forward on this stage and every later
one. On the last stage, after the warm-up the j-th forward pairs with the j-th backward; the
first backward of micro-batch m (index start_m) needs forward index start_m + n_m - 1 done, so
w_{K-1} >= n_m - 1 for every m, hence n_max - 1. Each earlier stage runs one more unit ahead,
as in 1F1B: the backward unit j on stage s waits for stage s+1's backward j, which runs after
stage s+1's forward w_{s+1} + j, which needs stage s's forward w_{s+1} + j; stage s has run
forward w_s + j by then, so w_s >= w_{s+1} rules out deadlock and the extra unit per stage keeps
the gradient arriving in time rather than after a bubble.

Stage s so holds at most w_s + 1 = n_max + K - s - 1 slice activations, against K - s whole
micro-batches (n per micro-batch) under 1F1B and all M * n under TeraPipe/GPipe.

Needs exactly one stage per pipeline rank.
"""

from __future__ import annotations

from tpc.compiler.schedules.common import (
    Compute,
    backward,
    backward_units,
    empty,
    forward,
    forward_units,
    one_f_one_b,
    one_stage_per_rank,
    slice_counts,
)
from tpc.ir.nodes import Header

NAME = "seq1f1b"


def warmup(header: Header, stage: int) -> int:
    """Forward units stage `stage` runs before its first backward (see the module docstring)."""
    n_max = max(slice_counts(header))
    return (n_max - 1) + (header.num_stages - stage - 1)


def build(header: Header) -> Compute:
    fwd_units = forward_units(header)
    bwd_units = backward_units(header, range(len(header.microbatches)))
    out = empty(header)
    for rank, s in enumerate(one_stage_per_rank(header, NAME)):
        fwd = [forward(s, m, i) for m, i in fwd_units]
        bwd = [backward(s, m, i) for m, i in bwd_units]
        out[rank] = one_f_one_b(fwd, bwd, warmup(header, s))
    return out
