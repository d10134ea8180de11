"""The oracle: plain single-process autograd on the unsliced model. Every executor and schedule
must reproduce its loss and gradients (fp32: relative error <= 1e-5).

The one measure of a gradient's error, used by `--verify-grads`, the tests and the benchmarks
(`gradient_error`): for each parameter,

    max |a - b| / max(max |b|, F)        (a: the plan's gradient, b: autograd's; max over elements)

that is, the largest elementwise difference relative to the reference's largest entry. It is
stricter than a norm ratio: one wrong entry of a large matrix is not averaged away. F, a
thousandth of the largest gradient entry of the whole model, keeps a parameter whose true
gradient is zero from dividing rounding noise by rounding noise (OPT's key bias: softmax
cancels it exactly, and both sides hold 1e-11-sized residues); such a parameter is held to an
absolute error of F times the tolerance. The error of a set of parameters is the worst
one. A parameter the model's forward never uses gets no gradient from autograd; the plan holds
no gradient for it either, so it is not an error when one side lacks it and autograd gave it
none. Any other parameter missing on either side is an infinite error.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from tpc.compiler.frontend.model_file import logits_of


class Reference(NamedTuple):
    """Loss and gradients of one step of plain autograd: `unused` names the parameters the
    forward never reached (autograd gives them no gradient; their entries in `grads` are 0)."""

    loss: float
    grads: dict[str, torch.Tensor]
    unused: frozenset[str]


def reference_step(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss (mean next-token cross-entropy over all tokens) and each parameter's gradient.
    The model's existing .grad fields are left as they were."""
    ref = reference(model, ids, targets)
    return ref.loss, ref.grads


def reference(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> Reference:
    """`reference_step`, also saying which parameters the forward never used. The ids are made
    contiguous first: a model may `.view` its input."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    logits = logits_of(model(ids.contiguous()))  # (B, T, V)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.contiguous().reshape(-1))
    grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
    out = {n: (g if g is not None else torch.zeros_like(p)).detach() for (n, p), g in zip(params, grads)}
    unused = frozenset(n for (n, _), g in zip(params, grads) if g is None)
    return Reference(float(loss.detach()), out, unused)


def batch_reference(model: nn.Module, tokens: torch.Tensor, eos: int | None = None) -> Reference:
    """The reference for a batch of tokens (batch, seq + 1): ids are all but the last token of
    each row, targets all but the first; gradients on the CPU. `eos`: the rows are packed
    documents ended by that separator, and the reference is `document_reference`'s."""
    if eos is not None:
        ref = document_reference(model, tokens[:, :-1], tokens[:, 1:], eos)
    else:
        ref = reference(model, tokens[:, :-1], tokens[:, 1:])
    return ref._replace(grads={n: g.cpu() for n, g in ref.grads.items()})


def document_reference(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor, eos: int) -> Reference:
    """The reference over packed documents: every document of every row through the unsliced
    model on its own (no mask: it is the whole input; its positions start at 0), next-token
    cross-entropy summed over its tokens but its separator's (whose target is the next
    document's first token), divided by all the batch's tokens, as the plan's loss is."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    total = None
    for row_ids, row_targets in zip(ids, targets):
        ends = [int(i) + 1 for i in (row_ids == eos).nonzero().flatten()]
        bounds = [0, *[e for e in ends if e < len(row_ids)], len(row_ids)]
        for a, b in zip(bounds, bounds[1:]):
            doc = row_ids[a:b].contiguous()[None]  # (1, n): one document alone
            logits = logits_of(model(doc))
            keep = doc[0] != eos
            if not bool(keep.any()):
                continue
            part = F.cross_entropy(logits[0][keep].float(), row_targets[a:b][keep], reduction="sum")
            total = part if total is None else total + part
    loss = total / ids.numel()
    grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
    out = {n: (g if g is not None else torch.zeros_like(p)).detach() for (n, p), g in zip(params, grads)}
    unused = frozenset(n for (n, _), g in zip(params, grads) if g is None)
    return Reference(float(loss.detach()), out, unused)


def gradient_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                   unused: frozenset[str] = frozenset(), floor: float | None = None) -> tuple[float, str]:
    """The largest relative error over parameters (see the module docstring) and the name of
    the worst. `want` is the reference; `unused` the parameters it says the forward never used;
    `floor` is F (default: a thousandth of the largest entry of `want`; pass the whole model's
    when `want` is a share of it)."""
    if floor is None:
        floor = gradient_floor(want)
    worst, worst_name = 0.0, ""
    for name in sorted(set(got) | set(want)):
        if name not in got or name not in want:
            if name in unused:
                continue
            return math.inf, name
        err = relative_error(got[name], want[name], floor)
        if err > worst or not worst_name:
            worst, worst_name = err, name
    return worst, worst_name


def relative_error(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> float:
    """The measure of the module docstring for one tensor: max |a - b| / max(max |b|, floor),
    the absolute difference where both are 0. `gradient_error` applies it per parameter; the
    tests use it for a single tensor (a weight after a step, a loss)."""
    a, b = got.detach().double().cpu(), want.detach().double().cpu()
    scale = max(float(b.abs().max()), floor) if b.numel() else floor
    diff = float((a - b).abs().max()) if b.numel() else 0.0
    return diff / scale if scale > 0 else diff


def gradient_floor(want: dict[str, torch.Tensor]) -> float:
    """F of the module docstring: a thousandth of the largest gradient entry of `want`."""
    return 1e-3 * max((float(g.detach().abs().max()) for g in want.values() if g.numel()), default=0.0)


def max_rel_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """`gradient_error` without the name: the worst relative error."""
    return gradient_error(got, want)[0]
