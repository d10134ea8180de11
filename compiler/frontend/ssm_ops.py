"""Selective scans, the state-space recurrences of Mamba and Mamba-2 (and the recurrences of
RWKV and RecurrentGemma), as ops a token slice runs from the state the slice before it ended
with.

Mamba's scan (`selective_scan`): per channel d and state entry n,
    h_t = exp(dt_t * A) * h_{t-1} + dt_t * B_t * x_t,    y_t = C_t . h_t (+ D x_t) (* silu(z_t))
over x, dt, z (batch, channels, tokens), B, C (batch, state, tokens), A (channels, state).
Mamba-2's (`ssd_scan`) has one decay per head (A (heads,)) and computes the same recurrence in
chunks of `chunk` tokens (the state-space duality): a masked quadratic form inside each chunk,
the recurrence between chunks. Both are causal, and a slice needs nothing of the tokens before
it but the state h they left: (batch, channels, state) for Mamba, (batch, heads, head_dim,
state) for Mamba-2, whatever the sequence's length. RWKV's WKV (`wkv`) carries a numerator,
a denominator and their running maximum per channel; RecurrentGemma's RG-LRU (`linear_scan`,
h_t = a_t h_{t-1} + x_t) one value per channel.

Two forms of each:

* the captured op (`torch.ops.tpc.selective_scan`, `torch.ops.tpc.ssd_scan`): the whole
  sequence from a zero state, one opaque node of the graph torch.export records in place of the
  model's scan function (`ssm_state.py` puts it there), so that the capture does not unroll a
  loop over the tokens or guard the length against a chunk size;
* the carried form (`selective_scan_carried`, `ssd_scan_carried`): what a stage graph calls.
  It takes the carried state as a tensor of 0 entries (the first slice: the zero state) or 1
  (the state the slice before ended with) on axis 1, and returns the slice's output and its
  final state with that axis: a cached tensor of one entry per slice, which the runtime keeps
  as a window of one (`ssm_state.ScanSite`). It is written in torch operations, so autograd
  differentiates it, through the carried state into the slices before.

The arithmetic follows the models' own reference code (Hugging Face's `mamba_selective_scan`
loop and `mamba2_chunk_scan`): float32 states, the same discretisation, the same clamp of dt.
Mamba-2's chunks start at each slice's first token (and a slice shorter than a chunk is one
chunk of its length, not padded to the model's), so a sliced run groups the sums differently
from an unsliced one: the same function, rounded differently (the tests hold it to 1e-5).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _last(state: Tensor) -> Tensor | None:
    """The carried state's last entry, as a tensor of its own (the runtime may overwrite the
    cache the slice read it from before the slice's backward, `executors/stage_runtime.py`), or
    None for none."""
    return state[:, -1].clone() if state.size(1) else None


# ------------------------------------------------------------------ Mamba

def _selective_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, z: Tensor | None,
                    dt_bias: Tensor | None, softplus: bool, h0: Tensor | None) -> tuple[Tensor, Tensor]:
    """(y (batch, channels, tokens) in x's dtype, final state (batch, channels, state) float32)."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)[..., None]
    if softplus:
        dt = F.softplus(dt)
    Bt, Ct = B.transpose(1, 2), C.transpose(1, 2)  # (batch, tokens, state)
    dA = torch.exp(A[None, :, None, :] * dt[:, :, :, None])  # (batch, channels, tokens, state)
    dBx = dt[:, :, :, None] * Bt[:, None, :, :].float() * x[:, :, :, None].float()
    h = h0 if h0 is not None else torch.zeros(x.size(0), x.size(1), A.size(-1), dtype=x.dtype, device=x.device)
    ys = []
    # the tokens taken apart once (`unbind`): indexing token t of the whole tensor in the loop
    # would have each step's backward write a gradient the size of the whole tensor (O(l^2))
    for a_t, b_t, c_t in zip(dA.unbind(2), dBx.unbind(2), Ct.unbind(1)):
        h = a_t * h + b_t
        ys.append(torch.matmul(h.to(x.dtype), c_t.unsqueeze(-1))[:, :, 0])
    y = torch.stack(ys, dim=-1) if ys else x.new_zeros(x.shape)
    if D is not None:
        y = y + x * D[None, :, None]
    if z is not None:
        y = y * F.silu(z)
    return y.to(x.dtype), h.float()


@torch.library.custom_op("tpc::selective_scan", mutates_args=())
def selective_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, z: Tensor | None,
                   dt_bias: Tensor | None, softplus: bool) -> Tensor:
    """Mamba's scan of a whole sequence from the zero state (the module docstring)."""
    return _selective_scan(x, dt, A, B, C, D, z, dt_bias, softplus, None)[0].clone()


@selective_scan.register_fake
def _(x, dt, A, B, C, D, z, dt_bias, softplus):
    return x.new_empty(x.shape)


def selective_scan_carried(x, dt, A, B, C, D, z, dt_bias, softplus, state):
    """One slice of Mamba's scan from `state` (batch, 0 or 1, channels, state): (y, the final
    state (batch, 1, channels, state))."""
    y, h = _selective_scan(x, dt, A, B, C, D, z, dt_bias, softplus, _last(state))
    return y, h.unsqueeze(1)


# ------------------------------------------------------------------ Mamba-2

def _segment_sums(a: Tensor) -> Tensor:
    """(..., s) -> (..., s, s): entry [i, j] is a_{j+1} + ... + a_i for j <= i, -inf above the
    diagonal (a decay of 0 from a later token)."""
    s = a.size(-1)
    parts = a[..., None, :].expand(*a.shape[:-1], s, s)  # [i, k] = a_k
    after = torch.tril(torch.ones(s, s, dtype=torch.bool, device=a.device), diagonal=-1)
    sums = parts.transpose(-1, -2).masked_fill(~after, 0).cumsum(dim=-2)  # [i, j] = sum_{j<k<=i} a_k
    causal = torch.tril(torch.ones(s, s, dtype=torch.bool, device=a.device))
    return sums.masked_fill(~causal, float("-inf"))


def _ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, dt_bias: Tensor | None,
              softplus: bool, dt_min: float, dt_max: float, chunk: int, h0: Tensor | None) -> tuple[Tensor, Tensor]:
    """x (batch, tokens, heads, head_dim), dt (batch, tokens, heads), A (heads,), B, C (batch,
    tokens, groups, state): (y (batch, tokens, heads, head_dim) float32, final state (batch,
    heads, head_dim, state) float32)."""
    b, length, heads, _ = x.shape
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_min, max=dt_max)
    x = x.float()
    reps = heads // B.size(2)
    B = B.float().repeat_interleave(reps, dim=2)
    C = C.float().repeat_interleave(reps, dim=2)
    skip = D[..., None] * x if D is not None else None
    xd = x * dt[..., None].float()
    a = A.to(x.dtype) * dt.float()  # (batch, tokens, heads)
    chunk = max(1, min(chunk, length))  # a slice shorter than a chunk is one chunk: no padding to compute
    pad = (chunk - length % chunk) % chunk
    n = (length + pad) // chunk

    def chunks(t: Tensor) -> Tensor:  # (batch, tokens, ...) -> (batch, n, chunk, ...), zeros after the end
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(b, n, chunk, *t.shape[2:])

    xd, a, B, C = chunks(xd), chunks(a), chunks(B), chunks(C)
    a = a.permute(0, 3, 1, 2)  # (batch, heads, n, chunk)
    a_sum = torch.cumsum(a, dim=-1)
    # within each chunk: a masked form of C_l . B_s over the decay from s to l
    decay = torch.exp(_segment_sums(a))  # (batch, heads, n, l, s)
    scores = torch.einsum("bclhn,bcshn->bclsh", C, B) * decay.permute(0, 2, 3, 4, 1)
    y_in = torch.einsum("bclsh,bcshp->bclhp", scores, xd)
    # each chunk's own contribution to the state at its end
    to_end = torch.exp(a_sum[..., -1:] - a_sum)  # (batch, heads, n, chunk)
    own = torch.einsum("bclhn,bclhp->bchpn", B * to_end.permute(0, 2, 3, 1)[..., None], xd)
    # the recurrence between chunks, from the carried state
    start = h0[:, None].float() if h0 is not None else torch.zeros_like(own[:, :1])
    own = torch.cat([start, own], dim=1)  # (batch, n + 1, heads, head_dim, state)
    across = torch.exp(_segment_sums(F.pad(a_sum[..., -1], (1, 0)))).transpose(1, 3)  # (batch, n+1, n+1, heads)
    states = torch.einsum("bzch,bzhpn->bchpn", across, own)
    before, final = states[:, :-1], states[:, -1]
    # each chunk's tokens read the state it started with
    y_from = torch.einsum("bclhn,bchpn->bclhp", C, before) * torch.exp(a_sum).permute(0, 2, 3, 1)[..., None]
    y = (y_in + y_from).reshape(b, n * chunk, heads, -1)[:, :length]
    if skip is not None:
        y = y + skip
    return y, final


@torch.library.custom_op("tpc::ssd_scan", mutates_args=())
def ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, dt_bias: Tensor | None,
             softplus: bool, dt_min: float, dt_max: float, chunk: int) -> Tensor:
    """Mamba-2's scan of a whole sequence from the zero state (the module docstring)."""
    return _ssd_scan(x, dt, A, B, C, D, dt_bias, softplus, dt_min, dt_max, chunk, None)[0].clone()


@ssd_scan.register_fake
def _(x, dt, A, B, C, D, dt_bias, softplus, dt_min, dt_max, chunk):
    return x.new_empty(x.shape, dtype=torch.float32)


def ssd_scan_carried(x, dt, A, B, C, D, dt_bias, softplus, dt_min, dt_max, chunk, state):
    """One slice of Mamba-2's scan from `state` (batch, 0 or 1, heads, head_dim, state): (y,
    the final state (batch, 1, heads, head_dim, state))."""
    y, h = _ssd_scan(x, dt, A, B, C, D, dt_bias, softplus, dt_min, dt_max, chunk, _last(state))
    return y, h.unsqueeze(1)


# ------------------------------------------------------------------ RWKV

def _wkv(time_decay: Tensor, time_first: Tensor, key: Tensor, value: Tensor,
         h0: Tensor | None) -> tuple[Tensor, Tensor]:
    """RWKV's WKV over key, value (batch, tokens, channels): (y in key's dtype, the final state
    (batch, 3, channels) float32: numerator, denominator and the running maximum that keeps
    their exponentials finite)."""
    if h0 is None:
        num = torch.zeros_like(key[:, 0], dtype=torch.float32)
        den = torch.zeros_like(key[:, 0], dtype=torch.float32)
        top = torch.zeros_like(key[:, 0], dtype=torch.float32) - 1e38
    else:
        num, den, top = h0.unbind(1)
    decay = -torch.exp(time_decay)
    ys = []
    for k, v in zip(key.unbind(1), value.unbind(1)):  # (taken apart once: see _selective_scan)
        k = k.float()
        out_top = torch.maximum(top, k + time_first)
        e1, e2 = torch.exp(top - out_top), torch.exp(k + time_first - out_top)
        ys.append(((e1 * num + e2 * v) / (e1 * den + e2)).to(key.dtype))
        new_top = torch.maximum(top + decay, k)
        e1, e2 = torch.exp(top + decay - new_top), torch.exp(k - new_top)
        num, den, top = e1 * num + e2 * v, e1 * den + e2, new_top
    y = torch.stack(ys, dim=1) if ys else torch.zeros_like(key)
    return y, torch.stack([num, den, top], dim=1)


@torch.library.custom_op("tpc::wkv", mutates_args=())
def wkv(time_decay: Tensor, time_first: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """RWKV's WKV over a whole sequence from the empty state."""
    return _wkv(time_decay, time_first, key, value, None)[0].clone()


@wkv.register_fake
def _(time_decay, time_first, key, value):
    return key.new_empty(key.shape)


def wkv_carried(time_decay, time_first, key, value, state):
    """One slice of RWKV's WKV from `state` (batch, 0 or 1, 3, channels): (y, the final state
    (batch, 1, 3, channels))."""
    y, h = _wkv(time_decay, time_first, key, value, _last(state))
    return y, h.unsqueeze(1)


# ------------------------------------------------------------------ a diagonal linear recurrence

def _linear_scan(x: Tensor, a: Tensor, h0: Tensor | None) -> tuple[Tensor, Tensor]:
    """h_t = a_t * h_{t-1} + x_t over x, a (batch, tokens, channels), accumulated in float32
    (RecurrentGemma's RG-LRU): (the h_t in x's dtype, the final h (batch, channels) float32)."""
    h = h0 if h0 is not None else torch.zeros(x[:, 0].shape, dtype=torch.float32, device=x.device)
    ys = []
    for a_t, x_t in zip(a.unbind(1), x.unbind(1)):  # (taken apart once: see _selective_scan)
        h = a_t.float() * h + x_t.float()
        ys.append(h.to(x.dtype))
    return (torch.stack(ys, dim=1) if ys else torch.zeros_like(x)), h


@torch.library.custom_op("tpc::linear_scan", mutates_args=())
def linear_scan(x: Tensor, a: Tensor) -> Tensor:
    """A diagonal linear recurrence over a whole sequence from the zero state."""
    return _linear_scan(x, a, None)[0].clone()


@linear_scan.register_fake
def _(x, a):
    return x.new_empty(x.shape)


def linear_scan_carried(x, a, state):
    """One slice of the recurrence from `state` (batch, 0 or 1, channels): (y, the final state
    (batch, 1, channels))."""
    y, h = _linear_scan(x, a, _last(state))
    return y, h.unsqueeze(1)


# ------------------------------------------------------------------ the captured ops' gradients

def _grads(fn, names):
    """Autograd for a captured op: its backward runs the op's torch form again under autograd
    (the captured graph is a reference the compiler runs; stage graphs call the carried forms)."""

    def setup(ctx, inputs, output):
        ctx.inputs = inputs

    def backward(ctx, grad):
        inputs = [t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, Tensor) else t
                  for t in ctx.inputs]
        wanted = [t for t in inputs if isinstance(t, Tensor) and t.requires_grad]
        with torch.enable_grad():
            out = fn(*inputs)
        got = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        return tuple(next(got) if isinstance(t, Tensor) and t.requires_grad else None for t in inputs)

    return setup, backward


for _op, _fn in ((selective_scan, lambda *a: _selective_scan(*a, None)[0]),
                 (ssd_scan, lambda *a: _ssd_scan(*a, None)[0]),
                 (wkv, lambda *a: _wkv(*a, None)[0]),
                 (linear_scan, lambda *a: _linear_scan(*a, None)[0])):
    _setup, _backward = _grads(_fn, None)
    _op.register_autograd(_backward, setup_context=_setup)
