"""The oracle: plain single-process autograd on the unsliced model. Every executor and schedule
must reproduce its loss and gradients (fp32: relative error <= 1e-5)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def reference_step(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss (mean next-token cross-entropy over all tokens) and each parameter's gradient.
    The model's existing .grad fields are left as they were."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    logits = model(ids)  # (B, T, V)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
    grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
    out = {n: (g if g is not None else torch.zeros_like(p)).detach() for (n, p), g in zip(params, grads)}
    return float(loss.detach()), out


def max_rel_error(grads_a: dict[str, torch.Tensor], grads_b: dict[str, torch.Tensor]) -> float:
    """max over parameters of ||a - b|| / max(||b||, tiny); b is the reference. A parameter
    present in only one of the two is an infinite error."""
    if set(grads_a) != set(grads_b):
        return float("inf")
    worst = 0.0
    for name, b in grads_b.items():
        a = grads_a[name].detach().to(torch.float64).cpu()
        b = b.detach().to(torch.float64).cpu()
        denom = max(float(b.norm()), 1e-30)
        worst = max(worst, float((a - b).norm()) / denom)
    return worst
