"""DualPipeV (DeepSeek-V3 technical report, 2024; the "cut-in-half" DualPipe of
github.com/deepseek-ai/DualPipe): DualPipe's V-shaped, single-replica form.

2p stages on p ranks in a V (`placement.vshape`: stage i and 2p-1-i on rank i), as ZB-V. In the
steady state each rank runs the forward of one micro-batch on one chunk next to the full
backward of another micro-batch on its other chunk: an overlapped pair "F&B". In the plan the
pair is two adjacent instructions (the forward's slices, then the backward's slices); they
touch different micro-batches of different stages, so nothing in the plan orders one before
the other, and an executor with two streams (a GPU computing one while the other's
all-to-all communication runs) may overlap them. On CPU they run in order; the simulator prices
them one after the other (F&B = F + B).

Order on rank r, exactly torch's ScheduleDualPipeV (`_calculate_single_rank_operations`), with
c0 = stage r and c1 = stage 2p-1-r, M micro-batches:
  1  F c0                   2(p - r - 1) times
  2  F c0, F c1             r + 1 times
  3  B c1, a queued W, F c1 p - r - 1 times (B = `backward-input`, its W queued)
  4  (F c0 & B c1), (F c1 & B c0)   M - 2p + r + 1 times (on the last rank the first F c0, B c1
                            not paired, to shorten the bubble); the B's here are full backwards
  5  B c1, (F c1 & B c0)    p - r - 1 times
  6  B c1, B c0             r + 1 times, switching to split backwards (B now, W queued) half way
  7  a queued W, B c0       p - r - 1 times
  8  a queued W             r + 1 times
DualPipe's table gives its bubble as (PP/2 - 1)(F&B + B - 3W) with PP = 2p chunks and its
activations as PP + 1 per rank. Under unit costs (a chunk's F 1, full B 2, W 1) the simulator
measures a first-rank bubble of p - 1, the formula's value with F&B = B (the forward hidden under
the backward), although it prices the pair one after the other, and 2p + 1 chunk micro-batches
held on every rank (tests/compiler/simulate/test_textbook_schedules.py).

Constraints, refused with located errors: the V (an even number of stages, 2p on p ranks) and
at least 2p micro-batches (step 4 runs M - 2p + r + 1 >= 1 times on rank 0).

Token slices: as in `zbv`, the unit is a whole micro-batch; every action expands into the
micro-batch's slices back to back (forward in token order, any backward in reverse token order),
which respects the key/value dependencies for any slicing and keeps a valid order valid. A
finer unit is refused by construction: the order is torch's, on micro-batches.
"""

from __future__ import annotations

from tpc.compiler.schedules.common import Compute, empty, expand, vshape_chunks
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Header, Op

NAME = "dualpipev"
PLACEMENT = "vshape"

F, FULL, B, W = Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT


def check_microbatches(header: Header) -> None:
    p, M = header.mesh.pipe, len(header.microbatches)
    if M < 2 * p:
        raise TpirError(Diagnostic(
            f"DualPipeV needs at least 2 x {p} ranks = {2 * p} micro-batches (its steady state "
            f"pairs a forward with a backward of another micro-batch on every rank), but the step "
            f"has {M}",
            where=f"--schedule {NAME} --microbatches {M}",
            hint=f"use --microbatches {2 * p} or more, or --schedule zbv"))


def rank_actions(p: int, M: int, r: int, c0: int, c1: int) -> list[tuple[Op, int, int]]:
    """(op, stage, micro-batch) of rank r, torch's order (module docstring)."""
    out: list[tuple[Op, int, int]] = []
    nxt: dict[tuple[str, int], int] = {}  # ("F" | "B", stage) -> next micro-batch
    weights: list[tuple[int, int]] = []

    def act(op: Op, s: int) -> None:
        key = ("F" if op is F else "B", s)
        m = nxt.get(key, 0)
        nxt[key] = m + 1
        out.append((op, s, m))
        if op is B:
            weights.append((s, m))

    def weight() -> None:
        if weights:
            s, m = weights.pop(0)
            out.append((W, s, m))

    for _ in range(2 * (p - r - 1)):
        act(F, c0)
    for _ in range(r + 1):
        act(F, c0)
        act(F, c1)
    for _ in range(p - r - 1):
        act(B, c1)
        weight()
        act(F, c1)
    for _ in range(M - 2 * p + r + 1):
        act(F, c0)  # on the last rank, the first time, not overlapped: the same two instructions
        act(FULL, c1)
        act(F, c1)
        act(FULL, c0)
    for _ in range(p - r - 1):
        act(FULL, c1)
        act(F, c1)
        act(FULL, c0)
    split = False
    half = (r + 1) // 2
    for i in range(r + 1):
        if i == half and r % 2 == 1:
            split = True
        act(B if split else FULL, c1)
        if i == half and r % 2 == 0:
            split = True
        act(B if split else FULL, c0)
    for _ in range(p - r - 1):
        weight()
        act(B if split else FULL, c0)
    for _ in range(r + 1):
        weight()
    return out


def build(header: Header) -> Compute:
    chunks = vshape_chunks(header, NAME)
    check_microbatches(header)
    p, M = header.mesh.pipe, len(header.microbatches)
    out = empty(header)
    for r, (c0, c1) in chunks.items():
        out[r] = [ins for op, s, m in rank_actions(p, M, r, c0, c1) for ins in expand(header, op, s, m)]
    return out
