"""Runs one pipeline stage one token slice at a time, owning its KV caches and their gradients.

Semantics (DESIGN.md section 4): a slice's forward reads the keys/values of the earlier slices
of its micro-batch as a detached leaf that requires grad, so its backward leaves there the
gradients it sends into them. When an earlier slice runs backward, the gradients later slices
sent into its keys/values are the upstream gradients of its K/V outputs: one autograd call over
[output, k..., v...] per slice. Parameter gradients accumulate in .grad across slices and
micro-batches.

Memory layout: one buffer per micro-batch and cached tensor holds every token's keys/values so
far; a slice writes its own tokens into it once, and reads its prefix as a view (no copy), so
the only copy of the prefix is the one attention makes when it appends the slice's own keys.
When the caller says how many tokens the micro-batch has (`capacity`, the end of its last slice:
the engine knows it from the plan), the first slice allocates the whole buffer and it never
moves. Without it the buffer grows by doubling; then an earlier slice's prefix leaf keeps the
smaller buffer it viewed alive until its backward, up to twice the cache's bytes. The
gradients sent into the cache collect in one buffer of the same layout, from which each slice
takes its own tokens' region when it runs backward. (Joining per-slice leaves instead copied the
whole prefix twice per slice: O(n²) copies for n slices.)

The cached tensors are attention keys and values and the inputs of short causal mixers (a causal
convolution of kernel k or a token shift reads the last k - 1 tokens of its input: a window of
k, `compiler/frontend/carried_state.py`); the runtime treats them alike.

Sliding-window layers (`module.kv_windows`, window w): a later slice reads only the last w - 1
tokens, so the cache keeps only those plus the slice being appended. When the buffer is full, its
last w - 1 tokens move to its front, in place; a prefix leaf that viewed the overwritten tokens
is only a receiver of gradients by then (attention concatenates the prefix into a new tensor,
which is what its backward keeps), except for a checkpointed slice, which keeps a copy of its
windowed prefix to recompute from. Gradients sent into a windowed cache collect in a buffer of
at most w - 1 tokens: by the time slice i runs backward every later slice has, and only the
w - 1 tokens before slice i can still receive gradients. So a windowed layer's cache and its
gradients take O(w) memory however long the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tpc.compiler.frontend import StageModule
from tpc.executors import weight_grads


@dataclass
class _Slice:
    mb: int
    x: torch.Tensor  # input (leaf requiring grad, or ids on the first stage)
    offset: int
    targets: torch.Tensor | None
    start: int  # tokens of this micro-batch before this slice (its prefix length)
    length: int  # tokens of this slice
    prefix: list = field(default_factory=list)  # the leaves this slice read its prefix through
    saved: list | None = None  # checkpointed: copies of its windowed prefixes, to recompute from
    # the graph-connected output (None while checkpointed): on the last stage the loss; on
    # any other its gradient edge only (`_output`), so that the activation itself is freed
    # once its send completes, not held until the backward
    y: object = None
    kv_out: list = field(default_factory=list)  # graph-connected K/V outputs
    weights: object = None  # what backward_input left for backward_weight (DeferredWeightGrads)
    sent_kv_grads: bool = False  # backward (or backward_input) ran: earlier slices' K/V grads are final


@dataclass
class _Acc:
    """Gradients sent into the tokens [base, base + g.size(d)) of one cached tensor."""

    g: torch.Tensor
    base: int = 0


@dataclass
class _Cache:
    """One micro-batch's keys/values on this stage, and the gradients sent into them."""

    kv: list  # per cached tensor: a buffer holding the tokens [base[t], length)
    length: int = 0
    grad: list | None = None  # per cached tensor an _Acc (None: nothing received yet)
    base: list = field(default_factory=list)  # per cached tensor: the token at buffer index 0


def _leaf(cached: torch.Tensor) -> torch.Tensor:
    """A slice's view of cached tokens as a leaf: one that requires grad, so the slice's backward
    leaves in it the gradients it sends into the earlier slices; a cache of token ids (a shift
    of the ids themselves) carries none."""
    leaf = cached.detach()
    return leaf.requires_grad_(True) if leaf.is_floating_point() else leaf


class StageRuntime:
    def __init__(self, module: StageModule, loss_scale: float):
        self.module = module
        self.loss_scale = float(loss_scale)
        self._slices: dict[tuple[int, int], _Slice] = {}
        self._caches: dict[int, _Cache] = {}
        self._empty: dict[tuple[int, torch.device], list] = {}
        self._evaluated: dict[int, int] = {}  # forward-only: mb -> slices run so far

    # ------------------------------------------------------------------ forward

    def forward(self, mb: int, sl: int, x: torch.Tensor, offset: int, targets=None, checkpoint: bool = False,
                capacity: int | None = None):
        """Forward one slice; returns the detached activation to send (or the scaled loss).
        `capacity`: the micro-batch's token count, if known (sizes its KV buffers once)."""
        if (mb, sl) in self._slices:
            raise RuntimeError(f"forward of micro-batch {mb} slice {sl} already ran on stage "
                               f"{self.module.lo}:{self.module.hi}")
        for i in range(sl):
            if (mb, i) not in self._slices:
                raise RuntimeError(f"forward of micro-batch {mb} slice {sl} needs the KV cache of slice {i}, "
                                   f"whose forward has not run (or was freed) on stage {self.module.lo}:{self.module.hi}")
        if self.module.is_last and targets is None:
            raise RuntimeError(f"the last stage needs targets for micro-batch {mb} slice {sl}")
        if not self.module.is_first:
            x = x.detach().requires_grad_(True)
        cache = self._caches.get(mb)
        start = cache.length if cache is not None else 0
        rec = _Slice(mb, x, int(offset), targets, start, x.size(1))
        with torch.set_grad_enabled(not checkpoint):
            y, kv = self._run(rec, checkpoint)
        self._append(mb, kv, capacity)
        if not checkpoint:
            rec.y, rec.kv_out = self._output(y), kv
        self._slices[(mb, sl)] = rec
        return self._scaled(y).detach()

    def evaluate(self, mb: int, sl: int, x: torch.Tensor, offset: int, targets=None,
                 capacity: int | None = None) -> torch.Tensor:
        """Forward one slice with no autograd graph and nothing kept but the KV cache the next
        slice reads (the evaluation program); returns the activation (or the scaled loss)."""
        done = self._evaluated.get(mb, 0)
        if sl != done:
            raise RuntimeError(f"forward of micro-batch {mb} slice {sl} needs the KV cache of slices "
                               f"0..{sl - 1}; {done} have run on stage {self.module.lo}:{self.module.hi}")
        if self.module.is_last and targets is None:
            raise RuntimeError(f"the last stage needs targets for micro-batch {mb} slice {sl}")
        cache = self._caches.get(mb)
        start = cache.length if cache is not None else 0
        with torch.no_grad():
            if start == 0:
                prefix = self._empty_kv(x.size(0), x.device)
            else:
                prefix = [self._prefix_view(cache, t, start) for t in range(len(cache.kv))]
            y, kv = self.module(x, int(offset), prefix, targets)
            self._append(mb, kv, capacity)
        self._evaluated[mb] = sl + 1
        return self._scaled(y)

    def recompute(self, mb: int, sl: int) -> None:
        """Rebuild the autograd graph of a checkpointed forward (same inputs, same cached prefix)."""
        rec = self._get(mb, sl, "recompute")
        if rec.y is not None:
            raise RuntimeError(f"recompute of micro-batch {mb} slice {sl}: its graph is already held")
        with torch.enable_grad():
            y, rec.kv_out = self._run(rec)
        rec.y = self._output(y)

    def _output(self, y: torch.Tensor):
        """What a slice keeps of its output for its backward: the loss on the last stage, else
        the output's gradient edge (autograd needs no more to run backward from it; the
        activation's bytes go with its send)."""
        if self.module.is_last or not y.requires_grad:
            return y
        return torch.autograd.graph.get_gradient_edge(y)

    def _run(self, rec: _Slice, checkpoint: bool = False):
        """The module on one slice, its prefix read as leaves viewing the cache (empty: none); a
        windowed cache's last w - 1 tokens only."""
        if rec.start == 0:
            rec.prefix = []
            prefix = self._empty_kv(rec.x.size(0), rec.x.device)
        elif rec.saved is not None:  # a recompute: the windowed prefixes may have been overwritten
            cache = self._caches[rec.mb]
            rec.prefix = [_leaf(saved if saved is not None else self._prefix_view(cache, t, rec.start))
                          for t, saved in enumerate(rec.saved)]
            prefix = rec.prefix
        else:
            cache = self._caches[rec.mb]
            rec.prefix = [_leaf(self._prefix_view(cache, t, rec.start)) for t in range(len(cache.kv))]
            prefix = rec.prefix
            if checkpoint and any(w is not None for w in self.module.kv_windows):
                rec.saved = [leaf.detach().clone() if w is not None else None
                             for leaf, w in zip(rec.prefix, self.module.kv_windows)]
        return self.module(rec.x, rec.offset, prefix, rec.targets)

    def _prefix_view(self, cache: _Cache, t: int, start: int) -> torch.Tensor:
        """Tokens [start - p, start) of cached tensor t: p = start, or at most w - 1 for a window."""
        w, d = self.module.kv_windows[t], self.module.kv_dims[t]
        p = start if w is None else min(start, w - 1)
        return cache.kv[t].narrow(d, start - p - cache.base[t], p)

    def _append(self, mb: int, kv: list, capacity: int | None) -> None:
        """Write a slice's keys/values after the cached ones: into buffers of the micro-batch's
        whole length when `capacity` is known, else into buffers that grow by doubling; a
        windowed tensor into a buffer of its last w - 1 tokens plus the slice."""
        n = kv[0].size(self.module.kv_dims[0]) if kv else 0
        cache = self._caches.get(mb)
        if cache is None:
            bufs = []
            for k, d, w in zip(kv, self.module.kv_dims, self.module.kv_windows):
                size = capacity if capacity is not None and capacity > n else n
                if w is not None:  # a buffer of its own: it is overwritten in place when full
                    size = max(n, min(size, w - 1 + n) if capacity is not None else w - 1 + n)
                if size <= n and w is None:  # its own tensor starts the buffer (no copy)
                    bufs.append(k.detach())
                else:
                    buf = k.new_empty(k.shape[:d] + (size,) + k.shape[d + 1:])
                    buf.narrow(d, 0, n).copy_(k.detach())
                    bufs.append(buf)
            self._caches[mb] = _Cache(bufs, n, base=[0] * len(bufs))
            return
        for t, (k, d, w) in enumerate(zip(kv, self.module.kv_dims, self.module.kv_windows)):
            buf, filled = cache.kv[t], cache.length - cache.base[t]
            if buf.size(d) < filled + n:
                if w is None:  # full: a buffer twice as large
                    grown = buf.new_empty(buf.shape[:d] + (max(2 * buf.size(d), filled + n),) + buf.shape[d + 1:])
                    grown.narrow(d, 0, filled).copy_(buf.narrow(d, 0, filled))
                    cache.kv[t] = buf = grown
                else:  # windowed: keep the last w - 1 tokens, at the front
                    m = min(cache.length, w - 1)
                    tail = buf.narrow(d, filled - m, m).clone()
                    if buf.size(d) < m + n:
                        cache.kv[t] = buf = buf.new_empty(buf.shape[:d] + (m + n,) + buf.shape[d + 1:])
                    buf.narrow(d, 0, m).copy_(tail)
                    cache.base[t], filled = cache.length - m, m
            buf.narrow(d, filled, n).copy_(k.detach())
        cache.length += n

    def _empty_kv(self, batch: int, device: torch.device) -> list:
        """The zero-length caches of a first slice, made once per batch size: building them
        evaluates the cache shapes symbolically, milliseconds per slice otherwise. They hold
        no data and never require grad, so every first slice can share them."""
        key = (batch, device)
        if key not in self._empty:
            self._empty[key] = self.module.empty_kv(batch)
        return self._empty[key]

    def _scaled(self, y):
        return y * self.loss_scale if self.module.is_last else y

    # ------------------------------------------------------------------ backward

    def _upstream(self, mb: int, sl: int, rec: _Slice, grad_out):
        """Outputs and their upstream gradients: [y, k..., v...] (K/V only where later slices
        sent gradients into them)."""
        if rec.y is None:
            raise RuntimeError(f"backward of micro-batch {mb} slice {sl}: its forward was checkpointed; "
                               "recompute it first")
        later = self._slices.get((mb, sl + 1))
        if later is not None and not later.sent_kv_grads:
            raise RuntimeError(f"backward of micro-batch {mb} slice {sl} needs the backward of slice {sl + 1} first "
                               "(its gradients into this slice's keys and values)")
        if self.module.is_last:
            outs, grads = [self._scaled(rec.y)], [torch.ones_like(rec.y) if grad_out is None else grad_out]
        else:
            if grad_out is None:
                raise RuntimeError(f"backward of micro-batch {mb} slice {sl} needs the output gradient")
            outs, grads = [rec.y], [grad_out]
        cache = self._caches[mb]
        for t, (out, d) in enumerate(zip(rec.kv_out, self.module.kv_dims)):
            acc = cache.grad[t] if cache.grad is not None else None
            if acc is None:
                continue
            lo, hi = max(rec.start, acc.base), min(rec.start + rec.length, acc.base + acc.g.size(d))
            if lo >= hi:  # no later slice read these tokens
                continue
            part = acc.g.narrow(d, lo - acc.base, hi - lo)
            if hi - lo < rec.length:  # a windowed cache: later slices read only its last tokens
                g = part.new_zeros(out.shape)
                g.narrow(d, lo - rec.start, hi - lo).copy_(part)
                part = g
            outs.append(out)
            grads.append(part)
        return outs, grads

    def _input_grad(self, rec: _Slice):
        """The slice's input gradient, to send (None on stage 0); the record lets go of it, so
        that it goes with its send rather than staying until `free-kv`."""
        if self.module.is_first:
            return None
        g, rec.x.grad = rec.x.grad, None
        return g

    def _send_prefix_grads(self, rec: _Slice) -> None:
        """Add what this slice's backward left in its prefix leaves to the cache's gradients,
        where the earlier slices find theirs."""
        if rec.prefix:
            cache = self._caches[rec.mb]
            if cache.grad is None:
                cache.grad = [None] * len(cache.kv)
            for t, (leaf, d, w) in enumerate(zip(rec.prefix, self.module.kv_dims, self.module.kv_windows)):
                if leaf.requires_grad:  # not a cache of token ids
                    cache.grad[t] = self._accumulate(cache.grad[t], leaf, d, rec.start, w is None)
                    # added in: the graph a split backward keeps for its weight half holds the
                    # leaf, whose gradient is a view of all of the attention's key gradient
                    leaf.grad = None
        rec.prefix = []
        rec.sent_kv_grads = True

    @staticmethod
    def _accumulate(acc: _Acc | None, leaf: torch.Tensor, d: int, start: int, full: bool) -> _Acc | None:
        """The gradients of a cached tensor after `leaf` (its tokens [start - p, start)) sent
        its own. Summed in fp32 at least: under bf16 autocast the cache is bf16, and each later
        slice adds into the gradients of every earlier slice's keys/values.

        A full cache's first backward (the last slice's: nothing sends gradients into the last
        slice's keys) allocates tokens [0, start), which covers every earlier slice. A windowed
        one keeps only tokens that no backward has consumed yet: [start - p, start) and what is
        left below `start` of the previous region."""
        p = leaf.size(d)
        dtype = torch.promote_types(leaf.dtype, torch.float32)
        if full:
            if acc is None:
                acc = _Acc(torch.zeros_like(leaf, dtype=dtype), 0)
            if leaf.grad is not None:
                acc.g.narrow(d, start - p, p).add_(leaf.grad)
            return acc
        lo = start - p if acc is None else min(start - p, acc.base)
        g = leaf.new_zeros((*leaf.shape[:d], start - lo, *leaf.shape[d + 1:]), dtype=dtype)
        if acc is not None:
            keep = min(start, acc.base + acc.g.size(d)) - acc.base
            if keep > 0:
                g.narrow(d, acc.base - lo, keep).add_(acc.g.narrow(d, 0, keep))
        if leaf.grad is not None:
            g.narrow(d, start - p - lo, p).add_(leaf.grad)
        return _Acc(g, lo)

    def backward(self, mb: int, sl: int, grad_out=None):
        """Input and weight gradients of one slice; returns the input gradient (None on stage 0)."""
        rec = self._get(mb, sl, "backward")
        outs, grads = self._upstream(mb, sl, rec, grad_out)
        torch.autograd.backward(outs, grads)
        self._send_prefix_grads(rec)
        rec.y, rec.kv_out = None, []
        return self._input_grad(rec)

    def backward_input(self, mb: int, sl: int, grad_out=None):
        """Split backward, first half: gradients of the input and of the cached prefix (what the
        previous stage and the earlier slices wait for). The graph is kept for backward_weight."""
        rec = self._get(mb, sl, "backward-input")
        outs, grads = self._upstream(mb, sl, rec, grad_out)
        inputs = ([] if self.module.is_first else [rec.x]) + rec.prefix
        params = [p for p in self.module.parameters() if p.requires_grad]
        got, rec.weights = weight_grads.backward_input(outs, grads, inputs, params)
        for t, g in zip(inputs, got):
            if g is not None:
                t.grad = g if t.grad is None else t.grad + g
        self._send_prefix_grads(rec)
        return self._input_grad(rec)

    def held_bytes(self, mb: int, sl: int) -> int:
        """What the slice's backward_input keeps for its backward_weight (0 before or after)."""
        rec = self._slices.get((mb, sl))
        return 0 if rec is None or rec.weights is None else rec.weights.held_bytes()

    def backward_weight(self, mb: int, sl: int) -> None:
        """Split backward, second half: parameter gradients, accumulated into .grad."""
        rec = self._slices.get((mb, sl))
        if rec is None or rec.weights is None:
            raise RuntimeError(f"backward-weight of micro-batch {mb} slice {sl} needs its backward-input first")
        rec.weights.apply()
        rec.y, rec.kv_out, rec.weights = None, [], None

    def _get(self, mb: int, sl: int, what: str) -> _Slice:
        rec = self._slices.get((mb, sl))
        if rec is None:
            raise RuntimeError(f"{what} of micro-batch {mb} slice {sl} on stage {self.module.lo}:{self.module.hi}: "
                               "its forward has not run (or its KV cache was freed)")
        if rec.sent_kv_grads:
            raise RuntimeError(f"{what} of micro-batch {mb} slice {sl}: its backward already ran")
        return rec

    # ------------------------------------------------------------------ memory

    def kv_buffers(self, mb: int) -> list:
        """The buffers holding micro-batch `mb`'s cached keys/values on this stage (their first
        tokens are filled; a buffer is replaced by a larger one when it grows)."""
        cache = self._caches.get(mb)
        return list(cache.kv) if cache is not None else []

    def free_kv(self, mb: int) -> None:
        """Drop every slice of a micro-batch: KV caches, their gradients, saved inputs."""
        for key in [k for k in self._slices if k[0] == mb]:
            del self._slices[key]
        self._caches.pop(mb, None)
        self._evaluated.pop(mb, None)

    @property
    def live_activations(self) -> int:
        """Slices whose autograd graph is currently held."""
        return sum(1 for r in self._slices.values() if r.y is not None)
