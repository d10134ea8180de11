"""Runs one pipeline stage one token slice at a time, owning its KV caches and their gradients.

Semantics (design card, section 4): the keys/values a slice produces are kept as detached leaves
that require grad; a later slice of the same micro-batch concatenates them into its cached prefix,
so its backward accumulates gradients into those leaves. When the earlier slice runs backward, the
accumulated gradients are the upstream gradients of its K/V outputs: one autograd call over
[output, k..., v...] per slice. Parameter gradients accumulate in .grad across slices and
micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tpc.compiler.frontend import StageModule


@dataclass
class _Slice:
    x: torch.Tensor  # input (leaf requiring grad, or ids on the first stage)
    offset: int
    targets: torch.Tensor | None
    kv_leaves: list  # this slice's K/V outputs as leaves (what later slices read)
    prefix_leaves: list  # leaves of earlier slices this slice read, per cached tensor
    y: torch.Tensor | None = None  # graph-connected output (None while checkpointed)
    kv_out: list = field(default_factory=list)  # graph-connected K/V outputs
    grads: list | None = None  # upstream grads saved by backward_input for backward_weight
    sent_kv_grads: bool = False  # backward (or backward_input) ran: earlier slices' K/V grads are final


class StageRuntime:
    def __init__(self, module: StageModule, loss_scale: float):
        self.module = module
        self.loss_scale = float(loss_scale)
        self._slices: dict[tuple[int, int], _Slice] = {}
        self._empty: dict[tuple[int, torch.device], list] = {}

    # ------------------------------------------------------------------ forward

    def forward(self, mb: int, sl: int, x: torch.Tensor, offset: int, targets=None, checkpoint: bool = False):
        """Forward one slice; returns the detached activation to send (or the scaled loss)."""
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
        prefix_leaves = [[self._slices[(mb, i)].kv_leaves[t] for i in range(sl)] for t in range(self.module.num_kv)]
        rec = _Slice(x, int(offset), targets, [], prefix_leaves)
        with torch.set_grad_enabled(not checkpoint):
            y, kv = self._run(rec)
        rec.kv_leaves = [k.detach().requires_grad_(True) for k in kv]
        if not checkpoint:
            rec.y, rec.kv_out = y, kv
        self._slices[(mb, sl)] = rec
        return self._scaled(y).detach()

    def recompute(self, mb: int, sl: int) -> None:
        """Rebuild the autograd graph of a checkpointed forward (same inputs, same cached prefix)."""
        rec = self._get(mb, sl, "recompute")
        if rec.y is not None:
            raise RuntimeError(f"recompute of micro-batch {mb} slice {sl}: its graph is already held")
        with torch.enable_grad():
            rec.y, rec.kv_out = self._run(rec)

    def _run(self, rec: _Slice):
        # the earlier slices' leaves joined (one alone is passed as is: no copy); none: empty
        if any(not leaves for leaves in rec.prefix_leaves):
            empty = self._empty_kv(rec.x.size(0), rec.x.device)
        prefix = [empty[t] if not leaves else leaves[0] if len(leaves) == 1 else torch.cat(leaves, dim=d)
                  for t, (leaves, d) in enumerate(zip(rec.prefix_leaves, self.module.kv_dims))]
        return self.module(rec.x, rec.offset, prefix, rec.targets)

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
        """Outputs and their upstream gradients: [y, k..., v...] (K/V only where later slices used them)."""
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
        for out, leaf in zip(rec.kv_out, rec.kv_leaves):
            if leaf.grad is not None:
                outs.append(out)
                grads.append(leaf.grad)
        return outs, grads

    def backward(self, mb: int, sl: int, grad_out=None):
        """Input and weight gradients of one slice; returns the input gradient (None on stage 0)."""
        rec = self._get(mb, sl, "backward")
        outs, grads = self._upstream(mb, sl, rec, grad_out)
        torch.autograd.backward(outs, grads)
        rec.sent_kv_grads = True
        rec.y, rec.kv_out = None, []
        return None if self.module.is_first else rec.x.grad

    def backward_input(self, mb: int, sl: int, grad_out=None):
        """Split backward, first half: gradients of the input and of the cached prefix (what the
        previous stage and the earlier slices wait for). The graph is kept for backward_weight."""
        rec = self._get(mb, sl, "backward-input")
        outs, grads = self._upstream(mb, sl, rec, grad_out)
        rec.grads = grads
        inputs = ([] if self.module.is_first else [rec.x]) + [l for ls in rec.prefix_leaves for l in ls]
        if inputs:
            got = torch.autograd.grad(outs, inputs, grads, retain_graph=True, allow_unused=True)
            for t, g in zip(inputs, got):
                if g is not None:
                    t.grad = g if t.grad is None else t.grad + g
        rec.sent_kv_grads = True
        return None if self.module.is_first else rec.x.grad

    def backward_weight(self, mb: int, sl: int) -> None:
        """Split backward, second half: parameter gradients, accumulated into .grad."""
        rec = self._slices.get((mb, sl))
        if rec is None or rec.grads is None:
            raise RuntimeError(f"backward-weight of micro-batch {mb} slice {sl} needs its backward-input first")
        params = [p for p in self.module.parameters() if p.requires_grad]
        outs = [self._scaled(rec.y) if self.module.is_last else rec.y] + \
               [o for o, l in zip(rec.kv_out, rec.kv_leaves) if l.grad is not None]
        if params:
            torch.autograd.backward(outs, rec.grads, inputs=params)
        rec.y, rec.kv_out, rec.grads = None, [], None

    def _get(self, mb: int, sl: int, what: str) -> _Slice:
        rec = self._slices.get((mb, sl))
        if rec is None:
            raise RuntimeError(f"{what} of micro-batch {mb} slice {sl} on stage {self.module.lo}:{self.module.hi}: "
                               "its forward has not run (or its KV cache was freed)")
        if rec.sent_kv_grads:
            raise RuntimeError(f"{what} of micro-batch {mb} slice {sl}: its backward already ran")
        return rec

    # ------------------------------------------------------------------ memory

    def free_kv(self, mb: int) -> None:
        """Drop every slice of a micro-batch: KV caches, their gradients, saved inputs."""
        for key in [k for k in self._slices if k[0] == mb]:
            del self._slices[key]

    @property
    def live_activations(self) -> int:
        """Slices whose autograd graph is currently held."""
        return sum(1 for r in self._slices.values() if r.y is not None)
