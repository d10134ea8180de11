"""Functions the rewritten graphs call at run time.

`causal_attention` is what every recognised attention becomes: this slice's queries attend to
the cached prefix of keys/values plus this slice's own, under a causal mask aligned bottom-right
(query q, at absolute position off+q, sees keys at positions <= off+q). SDPA's `is_causal=True`
aligns the mask top-left, which is right only when there is no prefix. With a prefix, CUDA
tensors get PyTorch's `causal_lower_right` bias, which SDPA serves with the flash (or memory-
efficient) kernel without materialising a mask; elsewhere (CPU, tracing) an additive mask made
once per shape.

With `window` w (a sliding-window layer) query q sees only the keys q - w < k <= q: the prefix
is cut to its last w - 1 tokens before the slice's own keys are appended (what no query of the
slice can see receives a zero gradient, as in the unsliced model), and the mask is the band
aligned bottom-right. A prefix of any length >= min(offset, w - 1) gives the same result, so a
runtime may keep only the last w - 1 tokens of a windowed layer's cache.

With a position `bias` (ALiBi; `bias.py`) the mask is an additive tensor: the bottom-right
causal (or banded) mask plus the slice's part of the bias, rebuilt from its table for the
queries [offset, offset + l) and the keys the slice reads.

With `documents` (a `DocumentSlice`: one row of a micro-batch whose rows are packed documents,
`documents.py`) a query sees only the keys of its own document, at or before it. The slice's
keys start at the first token of the document its first query is in (the runtime narrows the
prefix to it, `StageModule.forward`), and the attention runs document by document: each
document's queries over its own keys, one SDPA call each (causal, or aligned bottom-right for
the one document that began in an earlier slice). A slice whose first token starts a document
reads no cached keys at all. Measured on CPU (bench/documents.py's kernel table) this beats one
SDPA call under a dense block-diagonal mask by 7-10x at 4K keys with 512-token documents,
since no cross-document score is computed; PyTorch's FlexAttention has no CPU backward (torch 2.13). On
CUDA the same loop serves each document with the flash kernel; a varlen kernel (cu_seqlens)
would do it in one launch. With a sliding window or a position bias the slice falls back to one
call under the dense mask of its documents.

`causal_pad` is what a pad along the sequence becomes (a short causal convolution's left
padding, a token shift): the slice's own tokens after the last cached tokens of the earlier
slices, the model's pad value where the sequence has none.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


@dataclass(frozen=True)
class DocumentSlice:
    """One row's token slice [offset, offset + length) of packed documents, as a stage graph
    reads it. The slice reads `keys` tokens, [offset + length - keys, offset + length): its own
    and the earlier tokens of the document its first token is in. `positions` (keys,) holds each
    of those tokens' position within its document (the slice's queries are the last `length`);
    `segments` the documents: (q_lo, q_hi, k_lo), the queries [q_lo, q_hi) of the slice (slice
    coordinates) see the keys [k_lo, keys - length + q] (key coordinates)."""

    positions: torch.Tensor
    segments: tuple[tuple[int, int, int], ...]
    keys: int
    length: int
    _made: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def query_positions(self) -> torch.Tensor:
        """(length,) the slice's tokens' positions within their documents."""
        if "q" not in self._made:
            self._made["q"] = self.positions[self.keys - self.length:]
        return self._made["q"]

    def keep(self, lk: int) -> torch.Tensor:
        """(length, lk) bool: query q sees key j of the last `lk` keys (its document, not later)."""
        if lk not in self._made:
            m = torch.zeros(self.length, self.keys, dtype=torch.bool)
            for q_lo, q_hi, k_lo in self.segments:
                block = torch.ones(q_hi - q_lo, self.keys - self.length + q_hi - k_lo, dtype=torch.bool)
                m[q_lo:q_hi, k_lo:self.keys - self.length + q_hi] = block.tril(block.size(1) - block.size(0))
            self._made[lk] = m[:, self.keys - lk:].to(self.positions.device)
        return self._made[lk]


def document_slice(starts, offset: int, length: int, device) -> DocumentSlice:
    """The `DocumentSlice` of the tokens [offset, offset + length) of a row whose documents start
    at `starts` (ascending, host ints, the first 0)."""
    end = offset + length
    first = max(s for s in starts if s <= offset)
    bounds = [s for s in starts if first <= s < end] + [end]
    keys = end - first
    pos = torch.empty(keys, dtype=torch.int64)
    segments = []
    for a, b in zip(bounds, bounds[1:]):
        pos[a - first:b - first] = torch.arange(b - a)
        q_lo = max(a, offset) - offset
        segments.append((q_lo, b - offset, a - first))
    return DocumentSlice(pos.to(device), tuple(segments), keys, length)


def document_positions(documents: DocumentSlice, dtype=None, **_):
    """What `arange(offset, offset + l)` (a slice's positions) becomes over packed documents:
    each token's position within its document."""
    p = documents.query_positions
    return p if dtype is None or dtype == p.dtype else p.to(dtype)


def document_take(x, dim: int, documents: DocumentSlice):
    """What `x[offset:offset + l]` along `dim` (a position table's window) becomes over packed
    documents: the rows of each token's position within its document."""
    return x.index_select(dim, documents.query_positions.to(x.device))


def _document_attention(q, kf, vf, documents: DocumentSlice, scale, dropout_p, extra):
    """Attention document by document (the module docstring): the keys `kf` are the last
    kf.size(-2) of the slice's `documents.keys`."""
    lk, shift = kf.size(-2), documents.keys - kf.size(-2)
    outs = []
    for q_lo, q_hi, k_lo in documents.segments:
        # a sliding window may have cut the first keys: none of them is in any query's window
        k_lo, k_hi = max(0, k_lo - shift), documents.keys - documents.length + q_hi - shift
        qs = q.narrow(-2, q_lo, q_hi - q_lo)
        ks, vs = kf.narrow(-2, k_lo, k_hi - k_lo), vf.narrow(-2, k_lo, k_hi - k_lo)
        if k_hi - k_lo == q_hi - q_lo:
            o = F.scaled_dot_product_attention(qs, ks, vs, dropout_p=dropout_p, is_causal=True, scale=scale, **extra)
        else:
            build = _bottom_right_mask if type(q) is torch.Tensor else _bottom_right_mask.__wrapped__
            mask = build(q_hi - q_lo, k_hi - k_lo, q.dtype, q.device)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, dropout_p=dropout_p, scale=scale, **extra)
        outs.append(o)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


def _document_bias(table, kind: str, documents: DocumentSlice, lk: int, lead) -> torch.Tensor:
    """The position bias of the slice's queries over its last `lk` keys, at the tokens' positions
    within their documents (what each document alone would read)."""
    kp = documents.positions[documents.keys - lk:].to(table.device)
    qp = documents.query_positions.to(table.device)
    if kind == "key":
        b = table[..., kp]  # (..., 1, lk)
    elif kind == "relative":
        b = table[..., (qp[:, None] - kp[None, :]).clamp(min=0)]
    else:
        b = table[..., qp, :][..., kp]
    reps = [s // t if t not in (1, s) else 1 for t, s in zip(b.shape[:-2], lead)]
    return b.repeat(*reps, 1, 1) if any(r != 1 for r in reps) else b


def causal_attention(q, k, v, k_prefix, v_prefix, scale=None, dropout_p=0.0, rep=1, enable_gqa=False,
                     window=None, bias=None, bias_kind=None, offset=0, softcap=None, sink=None, chunk=None,
                     documents=None):
    """Attention of a slice. k/v are this slice's keys/values, (B, Hkv, l, D) (or (B * H, l, D));
    the prefix is the same layout with the earlier tokens. `rep` > 1 repeats key/value heads after
    the cache (GQA written with repeat_interleave), so the cache holds the un-repeated heads.
    `window`: each query sees only the last `window` tokens, its own included (None: every
    earlier token). `bias`: a position bias table of kind `bias_kind` (`bias.py`), read for the
    queries at [offset, offset + l). `softcap` c: the scores are c * tanh(scale * q.k^T) before
    the mask (Gemma 2); `sink`: a logit per query joined to the scores as one more key, whose
    probability is dropped (GPT-OSS); either is computed written out (`_written_out`). `chunk` c:
    chunked local attention (Llama 4): the query at position p sees the keys p - p % c .. p, so
    the prefix is cut to the tokens of the chunk the slice starts in (`offset % c`) and the
    mask is built for the slice's place in its chunks. `documents`: over packed documents, the
    row's `DocumentSlice` (attention stays inside each document); not with the three above, which
    the stage build refuses (`documents.document_graph`)."""
    if chunk is not None:
        return _chunked(q, k, v, k_prefix, v_prefix, scale, dropout_p, rep, enable_gqa, chunk, int(offset),
                        softcap, sink)
    if window is not None and k_prefix.size(-2) > window - 1:
        keep = window - 1  # (B, Hkv, w-1, D): the only cached tokens a query of this slice sees
        k_prefix = k_prefix.narrow(-2, k_prefix.size(-2) - keep, keep)
        v_prefix = v_prefix.narrow(-2, v_prefix.size(-2) - keep, keep)
    if k_prefix.size(-2) == 0:  # the first slice: no copy of this slice's keys/values
        kf, vf = k, v
    else:
        kf = torch.cat([k_prefix, k], dim=-2)  # (B, Hkv, off+l, D)
        vf = torch.cat([v_prefix, v], dim=-2)  # (B, Hkv, off+l, D)
    if rep != 1:
        kf = kf.repeat_interleave(rep, dim=1)  # (B, H, off+l, D)
        vf = vf.repeat_interleave(rep, dim=1)
    lq, lk = q.size(-2), kf.size(-2)
    extra = {"enable_gqa": True} if enable_gqa else {}
    if documents is not None:
        if bias is None and (window is None or lk <= window):
            return _document_attention(q, kf, vf, documents, scale, dropout_p, extra)
        keep = documents.keep(lk)
        if window is not None and lk > window:
            keep = keep & ~torch.ones(lq, lk, dtype=torch.bool, device=keep.device).tril(diagonal=lk - lq - window)
        mask = torch.zeros(lq, lk, dtype=q.dtype, device=q.device).masked_fill_(~keep, float("-inf"))
        if bias is not None:
            mask = mask + _document_bias(bias, bias_kind, documents, lk, q.shape[:-2]).to(q.dtype)
        return F.scaled_dot_product_attention(q, kf, vf, attn_mask=mask, dropout_p=dropout_p, scale=scale, **extra)
    if softcap is not None or sink is not None:
        plain = type(q) is torch.Tensor
        if window is not None and lk > window:
            mask = (_band_mask if plain else _band_mask.__wrapped__)(lq, lk, window, q.dtype, q.device)
        else:
            mask = (_bottom_right_mask if plain else _bottom_right_mask.__wrapped__)(lq, lk, q.dtype, q.device)
        if bias is not None:
            mask = mask + position_bias(bias, bias_kind, int(offset), lq, lk, q.shape[:-2]).to(q.dtype)
        return _written_out(q, kf, vf, mask, scale, softcap, sink, dropout_p, enable_gqa)
    if bias is not None:
        plain = type(q) is torch.Tensor
        if window is not None and lk > window:
            mask = (_band_mask if plain else _band_mask.__wrapped__)(lq, lk, window, q.dtype, q.device)
        else:
            mask = (_bottom_right_mask if plain else _bottom_right_mask.__wrapped__)(lq, lk, q.dtype, q.device)
        mask = mask + position_bias(bias, bias_kind, int(offset), lq, lk, q.shape[:-2]).to(q.dtype)
        return F.scaled_dot_product_attention(q, kf, vf, attn_mask=mask, dropout_p=dropout_p, scale=scale, **extra)
    if window is not None and lk > window:  # some query does not see the first keys: a band
        build = _band_mask if type(q) is torch.Tensor else _band_mask.__wrapped__
        mask = build(lq, lk, window, q.dtype, q.device)  # (l, lk)
        return F.scaled_dot_product_attention(q, kf, vf, attn_mask=mask, dropout_p=dropout_p, scale=scale, **extra)
    if lq == lk:
        return F.scaled_dot_product_attention(q, kf, vf, dropout_p=dropout_p, is_causal=True, scale=scale, **extra)
    if _fused_bottom_right(q):
        # the causal bias dispatches to the fused kernels itself, ahead of autocast, which would
        # otherwise cast q, k and v to one dtype (rotary embeddings leave q and k in float32
        # while v is bf16): cast them to the autocast dtype as SDPA under autocast does
        if torch.is_autocast_enabled(q.device.type):
            dt = torch.get_autocast_dtype(q.device.type)
            q, kf, vf = q.to(dt), kf.to(dt), vf.to(dt)
        mask = causal_lower_right(lq, lk)
    else:  # cached for plain tensors only: a mask made under a tracing mode must not outlive it
        build = _bottom_right_mask if type(q) is torch.Tensor else _bottom_right_mask.__wrapped__
        mask = build(lq, lk, q.dtype, q.device)  # (l, off+l)
    return F.scaled_dot_product_attention(q, kf, vf, attn_mask=mask, dropout_p=dropout_p, scale=scale, **extra)


def _chunked(q, k, v, k_prefix, v_prefix, scale, dropout_p, rep, enable_gqa, chunk, offset, softcap, sink):
    keep = min(offset % chunk, k_prefix.size(-2))  # the slice's first query sees its chunk's start
    if keep < k_prefix.size(-2):
        k_prefix = k_prefix.narrow(-2, k_prefix.size(-2) - keep, keep)
        v_prefix = v_prefix.narrow(-2, v_prefix.size(-2) - keep, keep)
    kf = torch.cat([k_prefix, k], dim=-2) if keep else k
    vf = torch.cat([v_prefix, v], dim=-2) if keep else v
    if rep != 1:
        kf, vf = kf.repeat_interleave(rep, dim=1), vf.repeat_interleave(rep, dim=1)
    build = _chunk_mask if type(q) is torch.Tensor else _chunk_mask.__wrapped__
    mask = build(q.size(-2), keep, offset % chunk, chunk, q.dtype, q.device)
    if softcap is not None or sink is not None:
        return _written_out(q, kf, vf, mask, scale, softcap, sink, dropout_p, enable_gqa)
    extra = {"enable_gqa": True} if enable_gqa else {}
    return F.scaled_dot_product_attention(q, kf, vf, attn_mask=mask, dropout_p=dropout_p, scale=scale, **extra)


@functools.lru_cache(maxsize=64)
def _chunk_mask(lq: int, keep: int, start: int, chunk: int, dtype, device) -> torch.Tensor:
    """The additive mask of a slice of `lq` queries whose first sits `start` tokens into its chunk,
    over the `keep` cached keys before it and its own: query i (position start + i in chunk
    terms) sees key j (position start - keep + j) when both are in one chunk and j is not later."""
    qpos = torch.arange(start, start + lq, device=device)[:, None]
    kpos = torch.arange(start - keep, start + lq, device=device)[None, :]
    sees = (kpos <= qpos) & (kpos // chunk == qpos // chunk)
    return torch.zeros(lq, keep + lq, dtype=dtype, device=device).masked_fill_(~sees, float("-inf"))


def _written_out(q, k, v, mask, scale, softcap, sink, dropout_p, enable_gqa):
    """softmax(softcap * tanh(scale * q.k^T) + mask [, sink]) . v, the sink's column dropped after
    the softmax: what SDPA cannot express. The softmax runs in float32, as the models upcast it.
    FlexAttention would express both exactly (a `score_mod`; the sink through its log-sum-exp) but
    runs no backward on the CPU, and compiled its forward was no faster than this form compiled
    (bench/score_transforms.py, docs/benchmarks.md)."""
    if enable_gqa and k.size(-3) != q.size(-3):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), dim=-3)
    s = torch.matmul(q, k.transpose(-2, -1)) * (q.size(-1) ** -0.5 if scale is None else scale)
    if softcap is not None:
        s = torch.tanh(s) * softcap
    s = s + mask
    if sink is not None:
        s = torch.cat([s, sink.to(s.dtype).expand(*s.shape[:-1], 1)], dim=-1)
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    if sink is not None:
        p = p[..., :-1]
    if dropout_p:
        p = F.dropout(p, dropout_p)
    return torch.matmul(p, v)


def position_bias(table, kind: str, offset: int, lq: int, lk: int, lead) -> torch.Tensor:
    """The bias of the queries at [offset, offset + lq) over the keys [offset + lq - lk, offset + lq),
    from a table of the length-L bias (`bias.py`), repeated over the batch to the scores' leading
    dims `lead`."""
    end = offset + lq
    start = end - lk
    if kind == "key":
        b = table[..., start:end]  # (..., 1, lk)
    elif kind == "relative":
        dist = torch.arange(offset, end, device=table.device)[:, None] - \
            torch.arange(start, end, device=table.device)[None, :]
        b = table[..., dist.clamp(min=0)]  # (..., lq, lk); a later key (hidden) reads distance 0
    else:
        b = table[..., offset:end, start:end]
    reps = [s // t if t not in (1, s) else 1 for t, s in zip(b.shape[:-2], lead)]
    return b.repeat(*reps, 1, 1) if any(r != 1 for r in reps) else b


def causal_pad(x, prefix, dim: int, left: int, right: int = 0, value=0.0):
    """`x` (this slice's tokens along `dim`) padded as the model pads the whole sequence
    (`left` before, `right` after; a negative `right` drops tokens at the end), cut to the
    slice: the `left` positions before it hold the last tokens of the earlier slices (`prefix`,
    a cache of the same value) and `value` where the sequence has none yet."""
    have = prefix.size(dim)
    if have > left:
        prefix, have = prefix.narrow(dim, have - left, left), left
    parts = []
    if have < left:
        parts.append(x.new_full((*x.shape[:dim], left - have, *x.shape[dim + 1:]), value))
    if have:
        parts.append(prefix)
    parts.append(x)
    if right > 0:
        parts.append(x.new_full((*x.shape[:dim], right, *x.shape[dim + 1:]), value))
    y = torch.cat(parts, dim) if len(parts) > 1 else x
    return y.narrow(dim, 0, y.size(dim) + right) if right < 0 else y


def _fused_bottom_right(q) -> bool:
    """Whether the bottom-right mask goes to SDPA as a causal bias (fused kernels on CUDA)
    rather than as a tensor: plain CUDA tensors only, since on CPU the bias is materialised on
    every call."""
    return type(q) is torch.Tensor and q.is_cuda


@functools.lru_cache(maxsize=16)
def _bottom_right_mask(lq: int, lk: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive causal mask aligned bottom-right: 0 where query q sees key j (j <= lk - lq + q),
    -inf elsewhere. Built once per shape (every layer of every slice of that length uses it); an
    additive mask in the query's dtype is what SDPA would make of a boolean one on each call."""
    sees = torch.ones(lq, lk, dtype=torch.bool, device=device).tril(diagonal=lk - lq)
    return torch.zeros(lq, lk, dtype=dtype, device=device).masked_fill_(~sees, float("-inf"))


@functools.lru_cache(maxsize=16)
def _band_mask(lq: int, lk: int, window: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive sliding-window mask aligned bottom-right: query q (the key position lk - lq + q)
    sees key j when 0 <= (lk - lq + q) - j < window, -inf elsewhere."""
    ones = torch.ones(lq, lk, dtype=torch.bool, device=device)
    sees = ones.tril(diagonal=lk - lq) & ~ones.tril(diagonal=lk - lq - window)
    return torch.zeros(lq, lk, dtype=dtype, device=device).masked_fill_(~sees, float("-inf"))


def sum_token_loss(logits, targets):
    """Next-token cross-entropy summed over the slice's tokens (the runtime divides by the total
    token count of the global batch, so slices add up to the mean)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), reduction="sum")
