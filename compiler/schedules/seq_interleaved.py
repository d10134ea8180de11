"""Seq-interleaved: Megatron's interleaved 1F1B over token slices, v chunks per rank.

Stage s on rank s mod p (the looped placement), the unit of work one (micro-batch, slice). Each
rank's forwards go in Megatron's virtual order over slices: blocks of p consecutive slices (in
forward order) run through the rank's chunks in pipeline order; its backwards the blocks of
slices in backward order (micro-batch by micro-batch, later slices first: the KV gradients)
through the chunks in reverse.

Rules (`list_scheduler`'s, full backward): rank r warms up with the forwards its first backward
needs (up to the last chunk's last slice of micro-batch 0) minus one, plus Megatron's
2(p - 1 - r) (p - 1 - r with one chunk), then alternates one slice forward and one slice
backward (1F1B), then drains the backwards; it never holds more than its warm-up and one. With
one chunk per rank it is seq1f1b's order driven by arrival. Unlike `interleaved` it needs no
particular number of micro-batches: a last, shorter block is fine.

Deadlock-free for the reason `list_scheduler` gives; the verifier checks the lowered plan.
"""

from __future__ import annotations

from tpc.compiler.schedules import list_scheduler
from tpc.compiler.schedules.common import Compute
from tpc.compiler.schedules.placement import virtual_stages
from tpc.ir.nodes import Header

NAME = "seq-interleaved"
PLACEMENT = "looped"


def build(header: Header) -> Compute:
    p = header.mesh.pipe
    v = virtual_stages(header, NAME)
    units = list_scheduler.slice_units(header)
    extra = (lambda r: p - 1 - r) if v == 1 else (lambda r: 2 * (p - 1 - r))
    return list_scheduler.build(header, units, split=False, extra=extra, hold=lambda r: 0)
