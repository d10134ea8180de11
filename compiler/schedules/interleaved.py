"""Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): v model chunks per rank.

The K = v * p stages are placed in a loop, stage s on rank s mod p (`placement.looped`), so
rank r holds chunks r, r + p, ..., r + (v-1)p. Each rank runs K / p = v times more, shorter
stages than under 1F1B, and the pipeline fills v times faster: the bubble is (p-1)/(v m) of the
ideal time instead of (p-1)/m.

Order on rank r, as in Megatron's `forward_backward_pipelining_with_interleaving`, over the
N = v m "virtual micro-batches" (a chunk and a micro-batch): the k-th forward is chunk
(k // p) mod v of micro-batch (k // (p v)) p + k mod p (micro-batches go through the chunks in
groups of p); the k-th backward the same with the chunks reversed. A warm-up of

    w_r = min((p - r - 1) * 2 + (v - 1) * p, N)     forwards

then alternately one forward and one backward, then the remaining backwards. With v = 1 this is
1F1B (warm-up p - r - 1). A micro-batch's forward is all its token slices in order, its backward
all of them in reverse token order (the token-slice granularity is `seq-interleaved`).

Megatron's constraint: with v > 1 the micro-batches must be a multiple of p (each group of p
fills the pipeline of one chunk); other counts are refused with a located error.
"""

from __future__ import annotations

from tpc.compiler.schedules.common import Compute, backward, empty, forward, one_f_one_b
from tpc.compiler.schedules.placement import chunks, virtual_stages
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Header

NAME = "interleaved"
PLACEMENT = "looped"


def check_microbatches(header: Header, schedule: str = NAME) -> int:
    """v, after checking the placement and Megatron's micro-batch rule (located errors)."""
    v = virtual_stages(header, schedule)
    p, M = header.mesh.pipe, len(header.microbatches)
    if v > 1 and M % p:
        lower, upper = (M // p) * p, (M // p + 1) * p
        choices = f"{lower} or {upper}" if lower else f"{upper}"
        raise TpirError(Diagnostic(
            f"interleaved 1F1B with {v} chunks per rank runs micro-batches through each chunk in "
            f"groups of the {p} pipeline ranks, but the step has {M} micro-batch"
            f"{'es' if M != 1 else ''}, not a multiple of {p}",
            where=f"--schedule {schedule} --virtual-stages {v}",
            hint=f"use --microbatches {choices}, or --virtual-stages 1"))
    return v


def warmup(p: int, v: int, r: int, total: int) -> int:
    """Forwards rank r runs before its first backward (Megatron's formula)."""
    w = p - r - 1 if v == 1 else (p - r - 1) * 2 + (v - 1) * p
    return min(w, total)


def virtual_order(p: int, v: int, M: int, k: int, backward: bool) -> tuple[int, int]:
    """(chunk, micro-batch) of the k-th forward (or backward) of a rank."""
    chunk = (k // p) % v
    return (v - 1 - chunk if backward else chunk), (k // (p * v)) * p + k % p


def build(header: Header) -> Compute:
    v = check_microbatches(header)
    p, M = header.mesh.pipe, len(header.microbatches)
    counts = [len(m.slices) for m in header.microbatches]
    out = empty(header)
    for r in range(p):
        mine = chunks(header, r)
        fwd, bwd = [], []
        for k in range(v * M):
            c, m = virtual_order(p, v, M, k, backward=False)
            fwd.append([forward(mine[c], m, i) for i in range(counts[m])])
            c, m = virtual_order(p, v, M, k, backward=True)
            bwd.append([backward(mine[c], m, i) for i in reversed(range(counts[m]))])
        out[r] = [ins for group in one_f_one_b(fwd, bwd, warmup(p, v, r, v * M)) for ins in group]
    return out
