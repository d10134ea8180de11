"""Seq-ZB: Zero Bubble over token slices (no shipped system has it).

The unit of work is one (micro-batch, slice), as in seq1f1b, and each slice's backward is split
into B (`backward-input`: the gradient of the slice's input and of its cached prefix, i.e. what
the previous stage and this stage's earlier slices wait for) and W (`backward-weight`).

Why it differs from ZB on micro-batches: the key/value gradient. Slice i's B needs slice i+1's B
on the same stage, so one micro-batch's B's run in reverse token order, one after the other,
each also waiting for its output gradient from the next stage. On the last stage the first B of
a micro-batch is its LAST slice, so its warm-up needs every slice of the micro-batch forwarded
first (n - 1 forwards longer than ZB's); and a stage's B's of one micro-batch arrive spaced by
the next stage's B of the same slice, leaving gaps inside the steady state that W's of slices
already back-propagated fill. Only B is on that chain: W of a slice depends on nothing but its
own B, which is what lets it move into any gap.

Rules (`list_scheduler`'s, on slices). Rank r, with n the most slices of any micro-batch:
  warm-up  (n - 1) + (p - 1 - r) slice forwards (seq1f1b's warm-up; with v chunks per rank the
           forwards up to the last chunk's slice n-1 of micro-batch 0, plus p - 1 - r);
  steady   alternately one slice forward and one slice B, oldest first (micro-batch by
           micro-batch, slices in reverse token order); when the wanted B has not arrived, or
           the rank holds `hold` slices beyond the warm-up's n - 1 (default p: seq1f1b's first
           rank's n + p - 1 in all) and must free one before its next forward, the oldest W;
  cool-down the remaining B's as they arrive, W's in the gaps, then the remaining W's.
Parameter `hold` (slices beyond the warm-up's n - 1, default p) trades memory for bubble as
ZB-H2 does for ZB-H1: the warm-up's second term becomes min(2(p - 1 - r), hold - 1 - r), so
hold = 2p - 1 gives ZB-H2's warm-up and no gap inside any rank's step under F = B = W.

Why it cannot deadlock: the order of every rank is the projection of one simulated execution
that respects every dependency of DESIGN.md section 4 (forward after the previous stage's and
the previous slice's; B after its forward, the next stage's B and the next slice's B; W after
its B), and that simulation always runs to the end (`list_scheduler`'s docstring gives the
argument); lowering keeps a valid execution valid, and the verifier checks the lowered plan.
"""

from __future__ import annotations

from tpc.compiler.schedules import list_scheduler
from tpc.compiler.schedules.common import Compute
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Header

NAME = "seq-zb"
PLACEMENT = "looped"


def build(header: Header, *, hold: int | None = None) -> Compute:
    p = header.mesh.pipe
    if hold is not None and (isinstance(hold, bool) or not isinstance(hold, int) or hold < 1):
        raise TpirError(Diagnostic(f"seq-zb: hold must be a positive number of slices, got {hold!r}",
                                   where="--schedule seq-zb", hint="leave it out for the default, p"))
    h = p if hold is None else hold
    units = list_scheduler.slice_units(header)
    return list_scheduler.build(header, units, split=True, extra=lambda r: max(0, min(2 * (p - 1 - r), h - 1 - r)),
                                hold=lambda r: h)
