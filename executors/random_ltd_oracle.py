"""The oracle of random layerwise token dropping: the model itself, in plain PyTorch, each dropped
block run on its kept tokens (DeepSpeed's gather, run, scatter), on whole sequences.

Each dropped unit is a numbered block of the model (`transformer.h.1`, `model.layers.2`: its
label); while the oracle runs, that module's forward gathers the kept tokens of every argument
that runs over the sequence, runs the block's own forward on them, and scatters its output
back over its input (a token not kept skips the block). Arguments over the sequence, for a
batch of B sequences of T tokens, told by their sizes (the tests keep B, T and the widths
apart): a mask of (T, T) in its last two axes is cut to its top-left (k, k) block (DeepSpeed's
causal mask of the kept tokens); a tensor of (B or 1, T, ...) (the hidden states, positions,
RoPE's cos/sin) is gathered on axis 1; one of (T, ...) (a RoPE table, cache positions) on axis
0. The block computes its causal mask from its input otherwise, among the k kept tokens in
order.

The kept positions are the same `RandomLTD` draws the stages make (`tpc.compiler.random_ltd`):
per micro-batch, the union of its slices' subsets. The oracle runs micro-batch by micro-batch
and the loss is the mean next-token cross-entropy over every token of the batch, as the plan's.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from tpc.compiler.frontend.model_file import logits_of
from tpc.compiler.random_ltd import RandomLTD
from tpc.executors.oracle import Reference


def _gather(a, keep: torch.Tensor, T: int, B: int):
    if isinstance(a, (tuple, list)):
        return type(a)(_gather(x, keep, T, B) for x in a)
    if not isinstance(a, torch.Tensor):
        return a
    k = keep.numel()
    if a.dim() >= 2 and a.size(-1) == T and a.size(-2) == T:
        return a[..., :k, :k]  # a (T, T) mask: the kept tokens' top-left block
    if a.dim() >= 2 and a.size(1) == T and a.size(0) in (1, B):  # (batch or 1, T, ...)
        return a.index_select(1, keep.to(a.device))
    if a.dim() >= 1 and a.size(0) == T:  # (T, ...): positions, a RoPE table
        return a.index_select(0, keep.to(a.device))
    return a


@contextmanager
def dropping(model: nn.Module, blocks: dict[str, torch.Tensor]):
    """While inside, each module named in `blocks` (label -> kept positions of the sequence)
    runs on those tokens only (the module docstring)."""
    patched = []
    try:
        for label, keep in blocks.items():
            mod = model.get_submodule(label)
            own = mod.forward

            def forward(*args, _own=own, _keep=keep, **kwargs):
                hidden = args[0] if args else next(iter(kwargs.values()))
                B, T = hidden.size(0), hidden.size(1)
                out = _own(*_gather(tuple(args), _keep, T, B),
                           **{n: _gather(v, _keep, T, B) for n, v in kwargs.items()})
                first = out[0] if isinstance(out, (tuple, list)) else out
                merged = hidden.index_copy(1, _keep.to(hidden.device), first)
                return (merged, *out[1:]) if isinstance(out, (tuple, list)) else merged

            mod.forward = forward
            patched.append(mod)
        yield
    finally:
        for mod in patched:
            del mod.forward  # the instance attribute: the class's forward is back


def ltd_reference(model: nn.Module, tokens: torch.Tensor, ltd: RandomLTD, labels: list[str], step: int,
                  rows: list[tuple[int, int, int, tuple[int, ...]]]) -> Reference:
    """Loss and gradients of one step with random-LTD. `tokens`: (batch, seq + 1); `labels`: the
    model's unit labels; `rows`: per micro-batch (first row, rows, data replica, slice lengths),
    its index within its replica being its place among that replica's entries."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    total, seen = 0.0, {}
    count = tokens.size(0) * (tokens.size(1) - 1)
    loss_sum = None
    for first, n, replica, lengths in rows:
        mb = seen.get(replica, 0)
        seen[replica] = mb + 1
        keep = ltd.positions(step, replica, mb, lengths)
        ids, targets = tokens[first:first + n, :-1], tokens[first:first + n, 1:]
        with dropping(model, {labels[u]: k for u, k in keep.items()}):
            logits = logits_of(model(ids.contiguous()))
        part = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.contiguous().reshape(-1),
                               reduction="sum")
        loss_sum = part if loss_sum is None else loss_sum + part
    loss = loss_sum / count
    grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
    out = {n: (g if g is not None else torch.zeros_like(p)).detach().cpu() for (n, p), g in zip(params, grads)}
    unused = frozenset(n for (n, _), g in zip(params, grads) if g is None)
    total = float(loss.detach())
    return Reference(total, out, unused)
