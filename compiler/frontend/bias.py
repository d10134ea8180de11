"""Position biases added to attention scores (ALiBi and its relatives), read at the plan's
length and kept as a table the sliced attention rebuilds its bias from.

A bias is the finite part of an additive mask (`masks.read`): BLOOM adds `slope_h * k` (key
position k) through `baddbmm`, MPT `slope_h * (k - (L - 1))`, a hand-written ALiBi
`-slope_h * (q - k)`. It is a static value, a function of (query position, key position) and the
head, so it is evaluated at the plan's length L like the mask, and what the slice's queries see
of it is rebuilt for each slice from a table of that evaluation, bottom-right: a slice of l
queries at offset c over the keys [c + l - lk, c + l) gets the entries (c + i, k) of the length-L
bias. The values are the length-L evaluation's own, so the sliced scores are the unsliced
model's. Only the entries some query sees are compared (the rest are hidden by the mask), and
the smallest table that gives all of them is kept:

* `"key"`: the bias depends on the key position only (BLOOM, MPT): a (heads, 1, L) table, the
  slice takes keys [c + l - lk, c + l);
* `"relative"`: on the distance q - k only (ALiBi written as `-slope * (q - k)`, a bucketed
  relative bias): a (heads, L) table indexed by the distance;
* `"full"`: anything else: the (heads, L, L) evaluation, cut to the slice's rows and keys.

The table is in the layout of the attention's scores (the dims before (query, key) as q has
them: (B, H) or BLOOM's merged (B * H)), at batch 1; the op repeats it over the batch, as the
model does. A bias that differs between sequences of the batch, or that depends on parameters
(a learned bias, whose gradient a table would lose), is refused by the caller.
"""

from __future__ import annotations

import torch

ROWS = 512  # queries compared at a time (no second (L x L) matrix per head at long lengths)


class NotABias(Exception):
    """The bias cannot be rebuilt per slice; str() says why."""


def in_scores_layout(value: torch.Tensor, lead_at: tuple[int, ...], lead_q: tuple[int, ...]) -> torch.Tensor:
    """`value`, added to scores whose dims before (query, key) are `lead_at`, in the layout of
    the attention's own scores (`lead_q`: the same elements, merged or split differently)."""
    v = value.reshape(*([1] * max(0, len(lead_at) + 2 - value.dim())), *value.shape)
    v = v.expand(*lead_at, *v.shape[-2:])
    return v.reshape(*lead_q, *v.shape[-2:])


def batch_tiles(one: torch.Tensor, two: torch.Tensor) -> None:
    """The bias at batch 2 must be its batch-1 value repeated over the batch; NotABias if not."""
    if one.dim() != two.dim():
        raise NotABias("the bias has a different rank at another batch size")
    reps = []
    for a, b in zip(one.shape, two.shape):
        if b % a:
            raise NotABias("the bias's shape does not follow the batch")
        reps.append(b // a)
    if not torch.equal(one.repeat(*reps), two):
        raise NotABias("the bias differs between sequences of the batch (a padding bias)")


def table_of(bias: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, str]:
    """(table, kind) of a bias in the scores' layout (dims (..., 1 or L, 1 or L)), compared on
    the entries `keep` (L x L) says are seen."""
    n = keep.size(-1)
    if bias.size(-2) == 1:
        return bias.contiguous(), "key"
    full = bias.expand(*bias.shape[:-2], n, n)
    diag = full.diagonal(dim1=-2, dim2=-1)  # (..., L): the bias of key k as query k sees it
    if _agrees(full, keep, lambda rows, cols: diag[..., None, :].expand(*diag.shape[:-1], rows.numel(), n)):
        return diag.unsqueeze(-2).contiguous(), "key"
    rel = full[..., n - 1, :].flip(-1)  # (..., L): distance d = q - k, as the last query sees it
    if _agrees(full, keep, lambda rows, cols: rel[..., (rows[:, None] - cols[None, :]).clamp(min=0)]):
        return rel.contiguous(), "relative"
    return full.contiguous(), "full"


def _agrees(full: torch.Tensor, keep: torch.Tensor, rebuilt) -> bool:
    n = keep.size(-1)
    cols = torch.arange(n)
    for lo in range(0, n, ROWS):
        rows = torch.arange(lo, min(lo + ROWS, n))
        same = full[..., lo:lo + rows.numel(), :] == rebuilt(rows, cols)
        if not bool((same | ~keep[lo:lo + rows.numel()]).all()):
            return False
    return True
