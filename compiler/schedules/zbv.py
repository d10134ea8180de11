"""ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 6): the V-shape.

2p stages on p ranks, stage i and stage 2p-1-i on rank i (`placement.vshape`): a micro-batch
goes down the ranks through chunk 0 and comes back up through chunk 1, so the first and the last
stage share rank 0, and the backward of the last stage starts where the forward began. The
backward is split into B (`backward-input`) and W (`backward-weight`), W filling the bubbles.

Order on rank r, exactly torch's ScheduleZBVZeroBubble (`_calculate_single_rank_operations`), on
n = max(2p - 1, M) micro-batches, those >= M then dropped (a micro-batch's dependencies are
all inside it, so dropping whole micro-batches keeps a valid order valid):
  warm-up   2(p - r) - 1 forwards of chunk 0; r pairs (F chunk 1, F chunk 0); p - r triples
            (F, B, W of chunk 1);
  steady    while forwards remain: F chunk 0, B W chunk 0, F chunk 1, B W chunk 1;
  cool-down r pairs (B chunk 0, B chunk 1); p - r pairs (B chunk 0, W chunk 0); the remaining
            W's of chunk 1, then of chunk 0.
Under F = B = W (per chunk) no rank idles between its first and last compute once M >= 2p - 1,
and rank r holds at most 2p chunk micro-batches (from forward to W): p micro-batches of the
whole stage pair, 1F1B's first rank's memory.

Token slices: the unit of the order is a whole micro-batch. Its forward on a stage is its slices
in token order, its B and its W its slices in reverse token order, back to back. That always
respects the key/value dependencies (slice i's forward after slice i-1's on the same stage, its
B after slice i+1's), because the slices of one micro-batch never interleave with other work on
a stage; and expanding every action of a valid order into a contiguous block keeps it valid
(a block starts after every block it needs has finished). So every slicing is accepted, equal or
unequal. A finer unit (one slice) would need the first B of a micro-batch to wait for its last
slice's forward through the whole V, which torch's fixed warm-up does not provide; the sliced
zero-bubble order is `seq-zb`, which runs on any placement, the V included.

The placement is checked with a located error (`common.vshape_chunks`).
"""

from __future__ import annotations

from tpc.compiler.schedules.common import Compute, empty, expand, vshape_chunks
from tpc.ir.nodes import Header, Op

NAME = "zbv"
PLACEMENT = "vshape"

F, B, W = Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT


def rank_actions(p: int, M: int, r: int, c0: int, c1: int) -> list[tuple[Op, int, int]]:
    """(op, stage, micro-batch) of rank r, torch's order (module docstring)."""
    n = max(2 * p - 1, M)
    out: list[tuple[Op, int, int]] = []
    cnt = {(op, s): 0 for op in (F, B, W) for s in (c0, c1)}

    def act(op: Op, s: int) -> None:
        out.append((op, s, cnt[(op, s)]))
        cnt[(op, s)] += 1

    for _ in range(2 * (p - r) - 1):
        act(F, c0)
    for _ in range(r):
        act(F, c1)
        act(F, c0)
    for _ in range(p - r):
        act(F, c1)
        act(B, c1)
        act(W, c1)
    while cnt[(F, c1)] < cnt[(F, c0)] or cnt[(F, c0)] < n:
        if cnt[(F, c0)] < n:
            act(F, c0)
        act(B, c0)
        act(W, c0)
        act(F, c1)
        act(B, c1)
        act(W, c1)
    for _ in range(r):
        act(B, c0)
        act(B, c1)
    for _ in range(p - r):
        act(B, c0)
        act(W, c0)
    while cnt[(W, c1)] < cnt[(B, c1)]:
        act(W, c1)
    while cnt[(W, c0)] < cnt[(B, c0)]:
        act(W, c0)
    return [a for a in out if a[2] < M]


def build(header: Header) -> Compute:
    p, M = header.mesh.pipe, len(header.microbatches)
    out = empty(header)
    for r, (c0, c1) in vshape_chunks(header, NAME).items():
        out[r] = [ins for op, s, m in rank_actions(p, M, r, c0, c1) for ins in expand(header, op, s, m)]
    return out
