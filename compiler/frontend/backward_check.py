"""The self-check's backward: a plan is written only when its stages can train.

The forward self-check (`sliced.py`, `unit_check.py`) compares outputs; a stage whose forward
is right may still hold an op autograd cannot differentiate (functional `copy`, once written by
the in-place rewrite), and the plan would then stop at its first backward. So the check also
runs the stage **backward**, sliced as the plan slices it: the slices one after another, each
later slice reading the earlier slices' cached keys, values and carried inputs (joined with
`cat`, so their gradients flow back as the runtime feeds them), one backward of
`sum(output * r)` for a fixed random `r`. An op without a derivative is refused at its source
line. Then the gradients of the input and of every parameter are compared with the reference's
(the unsliced model's own code under autograd) within 1e-4 x (1 + the largest reference
gradient): a difference is refused naming the parameter.
"""

from __future__ import annotations

import re

import torch
import torch.fx as fx

from tpc.compiler.frontend.source_locations import refuse
from tpc.ir.diagnostics import Diagnostic, TpirError

_NO_DERIVATIVE = re.compile(r"derivative for (?:'?)(\w+)::(\w+)")


def sliced_backward(stage, x: torch.Tensor, lens, weight: torch.Tensor, model_file: str | None):
    """Run `stage` on `x` slice by slice (lengths `lens`) and back-propagate
    `sum(output * weight)` through every slice; returns the gradient of `x` (None for ids).
    Parameters of `stage` that require grad accumulate theirs. An op with no derivative is
    refused at its line."""
    x = x.detach()
    if x.is_floating_point():
        x.requires_grad_(True)
    prefix = stage.empty_kv(x.size(0))
    total, off = None, 0
    for ln in lens:
        y, kv = stage(x[:, off:off + ln], off, prefix)
        prefix = [torch.cat([p, k], dim=d) for p, k, d in zip(prefix, kv, stage.kv_dims)]
        part = (y * weight[:, off:off + ln]).sum()
        total = part if total is None else total + part
        off += ln
    if total is None or not total.requires_grad:
        return None
    try:
        total.backward()
    except RuntimeError as e:
        raise no_derivative(stage.graph, e, model_file) from None
    return x.grad


def no_derivative(graph: fx.Graph, e: RuntimeError, model_file) -> TpirError:
    """The error of a backward through `graph` that failed with `e`: at the line of the op
    without a derivative when the message names one the graph holds."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    m = _NO_DERIVATIVE.search(text)
    what = f"the plan cannot train: its backward fails ({text})"
    hint = ("write the value with operations autograd differentiates (torch.cat, torch.where, "
            "index or slice assignment into a tensor the forward creates)")
    if m is not None:
        name = m.group(2)
        for n in graph.nodes:
            target = getattr(n.target, "__name__", "") if n.op == "call_function" else ""
            if target.split(".")[0] == name and n.meta.get("stack_trace"):
                return refuse(n, model_file, f"the plan cannot train: `{name}` (node {n.name}) has no "
                                             "derivative", hint)
    return TpirError(Diagnostic(what, where="backward", hint=hint))


def compare_gradients(got: dict, ref: dict, where: str) -> None:
    """Each gradient of `got` within 1e-4 x (1 + max |reference|) of `ref`'s, else refused
    naming the first that differs."""
    for name, r in ref.items():
        g = got.get(name)
        if r is None and g is None:
            continue
        if r is None or g is None:
            r = torch.zeros_like(g) if r is None else r
            g = torch.zeros_like(r) if g is None else g
        lo, hi = r.aminmax() if r.numel() else (torch.zeros(()), torch.zeros(()))
        tol = 1e-4 * (1.0 + max(-lo.item(), hi.item()))  # max |r| without a copy of |r|
        err = (g - r).abs_().max().item() if r.numel() else 0.0
        if err > tol:
            raise TpirError(Diagnostic(
                f"slicing changes the gradient of `{name}` (in {where}): it differs from the unsliced "
                f"model's by {err:.3g} (tolerance {tol:.3g}); the model mixes tokens in a way the front "
                "end does not recognise", where=name,
                hint="use only per-token operations, causal attention and positions from arange(T) or buf[:T]"))
