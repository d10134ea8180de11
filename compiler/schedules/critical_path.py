"""Merak's critical-path 1F1B (Lai et al., 2023): 1F1B under activation recomputation, with the
recomputes placed and the order changed so that fewer of them lie on the step's critical path.

This module holds the rules the three schedules share; each is its own registry module
(`pre_recompute.py`, `last_no_recompute.py`, `full_critical_path.py`). They place their own
recomputation: a recomputed stage's forwards are written `forward ... checkpoint` and a
`recompute` of each slice comes right before that slice's backward. Lowering puts the receive of
the output gradient right before the backward, so after the recompute: the recompute runs while
the gradient is still on its way (Merak's "pre-recompute", its RecomputeRecvGrad).

Merak (Merak/core/pipeline/schedule.py) and what each schedule here keeps of it:

* `1f1b-pre-recompute` (PreRecomputeTrainSchedule): every stage recomputed; in the cool-down a
  micro-batch's recompute runs before its gradient is received, in the steady state inside the
  backward, after the receive. In tpc the recompute is an instruction of its own, and every
  recompute already comes before its receive (`--recompute full` places it so), the steady
  state's included; this schedule is that plan, under Merak's name.
* `1f1b-last-no-recompute` (LastNoRecomputeTrainSchedule): the last stage keeps its activations
  (its forward is followed at once by its backward, so it holds one micro-batch: recomputing
  there saves little memory and puts a forward per micro-batch straight onto the critical
  path); the other stages as above. (Merak pre-recomputes only the first micro-batch of stage
  K-2, a limit of its executor's global recompute switch; here every recompute is placed early.)
* `1f1b-critical-path` (FullCriticalPathTrainSchedule): the last stage as above, and stage K-2
  swaps its first backward with its third forward: F0 F1 F2 B0 B1 F3 B2 ... instead of 1F1B's
  F0 F1 B0 F2 B1 F3 ..., so it recomputes micro-batches 0 and 1 while the last stage runs their
  forward and backward (Merak: `use first backward for third forward`). With fewer than 3
  micro-batches there is no third forward and the order is 1F1B's. (Merak's special case on
  stage K-3 pre-recomputes its first micro-batch, which every recompute here already is; Merak
  also gives stage K-2 the checkpointing ratio of K-3 -- every stage but the last is
  recomputed in full here.)

Token slices: the unit of the order is a micro-batch, as in `1f1b`: a micro-batch's forward is its
slices in token order, its backward its slices in reverse, each slice's recompute right before
that slice's backward. Expanding each unit of a valid order into such a block keeps every
key/value dependency (DESIGN.md section 4), equal slices or not. Needs one stage per rank.
"""

from __future__ import annotations

from tpc.compiler.schedules.common import (
    Compute,
    backward_units,
    empty,
    one_f_one_b,
    one_stage_per_rank,
    slice_counts,
)
from tpc.ir.nodes import Header, Instr, Op


def _forward(stage: int, mb: int, n: int, checkpoint: bool) -> list[Instr]:
    return [Instr(Op.FORWARD, stage=stage, mb=mb, slice=i, checkpoint=checkpoint) for i in range(n)]


def _backward(header: Header, stage: int, mb: int, recompute: bool) -> list[Instr]:
    out: list[Instr] = []
    for _, i in backward_units(header, [mb]):
        if recompute:
            out.append(Instr(Op.RECOMPUTE, stage=stage, mb=mb, slice=i))
        out.append(Instr(Op.BACKWARD, stage=stage, mb=mb, slice=i))
    return out


def swap_first_backward(order: list, forwards: list, backwards: list) -> list:
    """`order` (one rank's 1F1B order of micro-batch units) with its first backward and its third
    forward exchanged; unchanged when there is no third forward."""
    if len(forwards) < 3:
        return order
    out = list(order)
    b0, f2 = out.index(backwards[0]), out.index(forwards[2])
    out[b0], out[f2] = out[f2], out[b0]
    return out


def build_variant(header: Header, name: str, *, last_recomputes: bool, swap: bool) -> Compute:
    """The compute order of one of Merak's variants: 1F1B (warm-up K - s - 1 on stage s) with
    every stage recomputed, the last one unless `last_recomputes` is false, and, with `swap`,
    stage K-2's first backward exchanged with its third forward (the module docstring)."""
    K = header.num_stages
    counts = slice_counts(header)
    out = empty(header)
    for rank, s in enumerate(one_stage_per_rank(header, name)):
        recomputed = last_recomputes or s != K - 1
        fwd = [_forward(s, m, n, recomputed) for m, n in enumerate(counts)]
        bwd = [_backward(header, s, m, recomputed) for m in range(len(counts))]
        order = one_f_one_b(fwd, bwd, K - s - 1)
        if swap and K >= 2 and s == K - 2:
            order = swap_first_backward(order, fwd, bwd)
        out[rank] = [instr for group in order for instr in group]
    return out
