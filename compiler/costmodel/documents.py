"""Attention over packed documents, priced by the corpus's mean document length.

A slice's attention is counted by the traced graph (`frontend/flops.py`) as its l queries over
its c + l keys. Over packed documents it computes only each document's queries over that
document's keys (`runtime_ops.causal_attention`: one call per document, the prefix cut to the
first query's document). With the corpus's mean document length m (the plan's
`documents eos ID mean M`, measured by `tpc compile --document-length FILE`), a row is priced as
documents of length m one after the other from its first token (a row starts at a document), so
the slice [c, c + l) computes

    q1 * k1  +  n * m^2  +  r^2

score entries: its first document's q1 queries over the k1 keys since that document's start,
n documents wholly inside it, and r queries of the last one over as many keys; against l (c + l)
counted. `attention_share` is that ratio, by which the attention class's FLOPs and bytes of the
unit are scaled (`GraphCostModel`). Real lengths vary about the mean; with the mean the price is
exact for a corpus of equal documents and a first-order estimate otherwise.
"""

from __future__ import annotations

import numpy as np


def attention_share(l, c, m: int):
    """Of the l x (c + l) score entries the graph counts for slices of `l` tokens after `c`,
    the share computed over documents of length `m` (numpy arrays broadcast; 1 where no
    document ends inside the row)."""
    l, c = np.asarray(l, dtype=np.float64), np.asarray(c, dtype=np.float64)
    m = float(m)
    start = np.floor(c / m) * m  # the first query's document starts here
    end = c + l
    q1 = np.minimum(end, start + m) - c
    k1 = c + q1 - start
    rest = np.maximum(end - (start + m), 0.0)
    n = np.floor(rest / m)
    r = rest - n * m
    computed = q1 * k1 + n * m * m + r * r
    return computed / (l * (c + l))
