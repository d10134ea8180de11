"""Attention masks, read exactly: which keys each query sees at the plan's full length.

A mask a model builds from sizes alone (a causal `tril`, Hugging Face's `masking_utils` masks, a
sliding window) is a static value: it can be evaluated for concrete sizes. The plan trains the
model at one length, the compile's `--seq-len` L, so the mask the unsliced model uses is the mask
at L; it is evaluated there, over every (query, key) pair, and compared with the patterns the
sliced attention implements:

* causal: query q sees keys k <= q;
* banded (sliding window w): query q sees keys q - w < k <= q, the last w tokens including its
  own (Hugging Face's `sliding_window`, Mistral's convention);
* chunked (chunks of c tokens, Llama 4's `attention_chunk_size`): query q sees the keys of its
  own chunk up to itself, q - q % c <= k <= q.

A mask that is none of these is described ("causal within documents",
"bidirectional: every query sees every key", ...) and refused by the caller: it is never replaced
by something else. Equality at L is what exactness needs: every slice of the plan is a window of
the length-L sequence, and the sliced attention reproduces the length-L mask on it.

Three encodings are read (what `keep` means):
* `"keep"`: a boolean mask, True where the query sees the key (SDPA's `attn_mask`, `where(m, s, -inf)`);
  a floating `attn_mask` is additive, as SDPA reads it;
* `"hide"`: a boolean mask, True where the key is hidden (`masked_fill(m, -inf)`);
* `"add"`: an additive mask: -inf (or the dtype's most negative number, whose exponential is
  zero just the same) where hidden; any finite value where seen. A finite value other than 0 is
  a position bias (ALiBi, `-slope * (q - k)`), which `bias.py` rebuilds for each slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# An additive mask value hides a key when it is this negative or less: exp() of it (plus any
# finite score) is exactly zero in every floating dtype, as with -inf.
HIDDEN = -1e30


@dataclass(frozen=True)
class Pattern:
    kind: str  # "causal", "banded" or "chunked"
    window: int | None = None  # banded: keys q - window < k <= q; chunked: the chunk's length c

    def describe(self) -> str:
        if self.kind == "chunked":
            return f"chunked: chunks of {self.window}"
        return "causal" if self.kind == "causal" else f"banded: window {self.window}"


class NotAMask(Exception):
    """The value is not a mask the front end can read; str() says what it is."""


@dataclass(frozen=True)
class Reading:
    """A mask read at the plan's length: the (length x length) keys each query sees and, for
    an additive mask, its finite part (a position bias such as ALiBi; None when it is all 0),
    in the value's own layout with hidden entries 0."""

    keep: torch.Tensor
    bias: torch.Tensor | None = None


def read(value, how: str, length: int) -> Reading:
    """Read an evaluated mask whose last two axes are (query, key). Which keys are seen must
    not change with the leading axes (batch, heads); an additive bias may (ALiBi's slopes differ
    per head)."""
    if not isinstance(value, torch.Tensor):
        raise NotAMask(f"the mask is a {type(value).__name__}, not a tensor")
    m = value
    if m.dim() < 2:
        m = m.reshape(*([1] * (2 - m.dim())), *m.shape)
    if m.shape[-1] not in (1, length) or m.shape[-2] not in (1, length):
        raise NotAMask(f"the mask has shape {tuple(m.shape)}, not (..., {length}, {length}) at length {length}")
    bias = None
    if how == "keep" and m.dtype == torch.bool:
        keep = m
    elif how == "hide":
        keep = ~m.bool()
    elif how in ("add", "keep"):
        if m.dtype == torch.bool:
            raise NotAMask("a boolean mask added to the attention scores")
        hidden = m.float() <= HIDDEN
        keep = ~hidden
        finite = m.masked_fill(hidden, 0)
        if bool((finite != 0).any()):
            bias = finite
    else:  # pragma: no cover - the callers pass one of the three
        raise ValueError(how)
    lead = keep.reshape(-1, keep.shape[-2], keep.shape[-1])
    if lead.size(0) > 1 and not bool((lead == lead[:1]).all()):
        raise NotAMask("the mask differs between sequences of the batch or between heads "
                       "(a padding or per-head mask)")
    return Reading(lead[0].expand(length, length), bias)


def both(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    """Keys seen under two masks applied one after the other."""
    return b if a is None else a & b


def classify(keep: torch.Tensor, rows: int = 1024) -> Pattern | None:
    """The pattern `keep` is exactly, or None. Compared `rows` queries at a time, so checking
    a long sequence needs no second (n x n) matrix."""
    n = keep.size(-1)
    w = int(keep[-1].sum())  # the last query sees its whole window: all n keys when causal
    if w < 1:
        return None
    k = torch.arange(n)
    for lo in range(0, n, rows):
        q = torch.arange(lo, min(lo + rows, n))[:, None]
        want = (k[None, :] <= q) & (k[None, :] > q - w)
        if not bool((keep[lo:lo + rows] == want).all()):
            return _chunked(keep, rows)
    return Pattern("causal") if w == n else Pattern("banded", w)


def _chunked(keep: torch.Tensor, rows: int) -> Pattern | None:
    """Chunked local attention (Llama 4): query q sees the keys of its own chunk of c tokens up
    to itself, q - q % c <= k <= q; None when `keep` is not that for any c."""
    n = keep.size(-1)
    starts = [q for q in range(1, n) if not bool(keep[q, q - 1])]  # a query not seeing the one before
    if not starts:
        return None
    c = starts[0]
    k = torch.arange(n)
    for lo in range(0, n, rows):
        q = torch.arange(lo, min(lo + rows, n))[:, None]
        want = (k[None, :] <= q) & (k[None, :] >= q - q % c)
        if not bool((keep[lo:lo + rows] == want).all()):
            return None
    return Pattern("chunked", c)


def describe(keep: torch.Tensor) -> str:
    """What a mask that is neither causal nor banded is, in words."""
    n = keep.size(-1)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    if bool(keep.all()):
        return "bidirectional: every query sees every key"
    future = keep & ~causal
    if bool(future.any()):
        q, k = (int(i) for i in future.nonzero()[0])
        return f"not causal: query {q} sees the later key {k}"
    if not bool(keep.diagonal().all()):
        q = int((~keep.diagonal()).nonzero()[0])
        return f"query {q} does not see its own key"
    first = keep.int().argmax(-1)  # each query's first key seen
    q = torch.arange(n)
    contiguous = bool((keep.sum(-1) == q - first + 1).all())  # keys first..q, no gaps
    if contiguous:
        new_doc = first == q
        same_doc = torch.cat([torch.tensor([True]), first[1:] == first[:-1]])
        if bool((new_doc | same_doc).all()):  # causal within documents
            starts = [int(i) for i in new_doc.nonzero().flatten()]
            c = starts[1] if len(starts) > 1 else n
            if starts == list(range(0, n, c)):
                return f"chunked local attention: chunks of {c} tokens"
            shown = ", ".join(map(str, starts[:8])) + (", ..." if len(starts) > 8 else "")
            return f"causal within documents (a document mask), which start at tokens {shown}"
        w = q - first + 1
        return f"banded with a width that varies between {int(w.min())} and {int(w.max())} keys"
    q, k = (int(i) for i in (causal & ~keep).nonzero()[0])
    return f"causal with gaps: query {q} does not see the earlier key {k}"
