"""Packed documents in the data: where each row's documents start, the targets that cross a
document boundary, and a token file's document lengths (its profile).

A document ends with the separator token (an end-of-text id, as most corpora have). In a row of
ids, a document starts at 0 and right after each separator; the target of a separator is the
next document's first token, which no document predicts: it becomes `IGNORE` (cross-entropy's
ignore index), so it adds nothing to the loss, which stays the sum over the predicted tokens
divided by the batch's token count (the plan's static loss scale, batch x L, the same with or
without documents).
"""

from __future__ import annotations

import numpy as np
import torch

IGNORE = -100  # torch's cross_entropy ignore_index: a target the loss leaves out


def document_starts(ids: torch.Tensor, eos: int) -> tuple[tuple[int, ...], ...]:
    """Per row of `ids` (rows, L), on the host, the positions where its documents start: 0, and
    each position after a separator (but L)."""
    rows = ids.numpy() if ids.device.type == "cpu" else ids.cpu().numpy()
    length = rows.shape[1]
    out = []
    for row in rows:
        after = np.flatnonzero(row == eos) + 1
        out.append((0, *(int(a) for a in after if a < length)))
    return tuple(out)


def mask_crossing_targets(ids: torch.Tensor, targets: torch.Tensor, eos: int) -> torch.Tensor:
    """`targets` with the target of every separator (the next document's first token) ignored."""
    return targets.masked_fill(ids == eos, IGNORE)


def document_lengths(tokens: np.ndarray, eos: int) -> np.ndarray:
    """The length of every document of a flat token stream (its separator counted; a last
    document without one counted to the end)."""
    ends = np.flatnonzero(tokens == eos) + 1
    if len(ends) == 0 or ends[-1] != len(tokens):
        ends = np.append(ends, len(tokens))
    return np.diff(np.concatenate(([0], ends)))
