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

`causal_pad` is what a pad along the sequence becomes (a short causal convolution's left
padding, a token shift): the slice's own tokens after the last cached tokens of the earlier
slices, the model's pad value where the sequence has none.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def causal_attention(q, k, v, k_prefix, v_prefix, scale=None, dropout_p=0.0, rep=1, enable_gqa=False,
                     window=None, bias=None, bias_kind=None, offset=0, softcap=None, sink=None, chunk=None):
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
    mask is built for the slice's place in its chunks."""
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
    the softmax: what SDPA cannot express. The softmax runs in float32, as the models upcast it."""
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
