"""Optimizer parameter groups: which parameters get weight decay, and the optimizer over them.

Weight decay pulls weights towards zero. On matrices (linear weights, embeddings: dim >= 2) it
regularises; on biases and norm gains (dim < 2) it only fights the scale the network needs, so
they get none, as in GPT-2/nanoGPT.

Each pipeline rank builds its own optimizer over the parameters of the stages it holds. AdamW
and SGD update each parameter from its own gradient and state only, so per-rank optimizers give
exactly the weights one optimizer over the whole model gives. A tied parameter (one tensor used
by several stages) is held as a separate copy by every rank that uses it; `reduce-tied` gives
all copies the same summed gradient, so each copy's optimizer makes the same update and nothing
special is needed here. A tie between two stages of one rank is one Python object and is put in
a group once.
"""

from __future__ import annotations

from typing import Iterable

import torch

from tpc.ir.diagnostics import Diagnostic, TpirError

KINDS = ("adamw", "sgd")


def adamw_groups(named_params: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict]:
    """Two kinds of group, `decay` (dim >= 2) and `no_decay` (dim < 2), each sorted by parameter
    name so the groups (and so the optimizer state order) do not depend on module registration
    order, and cut into groups of at most `GROUP_BYTES` (`bounded_runs`).
    Frozen parameters are left out, an empty group is dropped. Each group carries the names of
    its parameters under "names" (torch.optim keeps extra keys; checkpoints use them)."""
    if weight_decay < 0:
        raise TpirError(Diagnostic(f"weight decay must be >= 0, got {weight_decay}", where="--weight-decay",
                                   hint="e.g. --weight-decay 0.1, or 0 for none"))
    decay: list[tuple[str, torch.nn.Parameter]] = []
    no_decay: list[tuple[str, torch.nn.Parameter]] = []
    for name, p in unique_parameters(named_params):
        (decay if p.dim() >= 2 else no_decay).append((name, p))
    groups = []
    for members, wd in ((decay, weight_decay), (no_decay, 0.0)):
        members.sort(key=lambda item: item[0])
        for run in bounded_runs(members, lambda item: item[1]):
            groups.append({"params": [p for _, p in run], "names": [n for n, _ in run], "weight_decay": wd})
    return groups


GROUP_BYTES = 64 << 20


def bounded_runs(items: list, tensor_of) -> list[list]:
    """`items` cut, in order, into runs whose tensors (`tensor_of(item)`) hold at most
    `GROUP_BYTES` together (a larger tensor is a run of its own). torch's multi-tensor AdamW
    makes each of its temporaries (the square root of the second moment, say) for a whole group
    at once: one group over a rank's parameters would add their full size to the rank's peak
    at every step (1 GB for a quarter of a 1B model); per run it adds at most 64 MiB. The
    arithmetic of each element is the same, so the weights are too."""
    runs: list[list] = []
    size = GROUP_BYTES
    for item in items:
        t = tensor_of(item)
        nbytes = t.numel() * t.element_size()
        if not runs or size + nbytes > GROUP_BYTES:
            runs.append([])
            size = 0
        runs[-1].append(item)
        size += nbytes
    return runs


def build_optimizer(kind: str, named_params: Iterable[tuple[str, torch.nn.Parameter]], lr: float,
                    weight_decay: float, betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.Optimizer:
    """AdamW over `adamw_groups`, or plain SGD (no momentum, no decay) over all parameters by name.

    `foreach=True`: one multi-tensor kernel per operation instead of one per parameter; each
    element gets the same arithmetic as in the per-parameter loop, whichever parameters a rank
    holds, so a model split over ranks steps to bit-identical weights as the whole model would
    (tests/executors/training/test_param_groups.py checks it against foreach=False).
    The rate is a starting value; the training loop sets each group's "lr" from `lr_at` per step.
    """
    if kind not in KINDS:
        raise TpirError(Diagnostic(f"unknown optimizer {kind!r}", where="--optimizer",
                                   hint=f"use one of: {', '.join(KINDS)}"))
    if not lr > 0:
        raise TpirError(Diagnostic(f"learning rate must be > 0, got {lr}", where="--lr", hint="e.g. --lr 3e-4"))
    named = list(named_params)
    if kind == "sgd":
        params = sorted(unique_parameters(named), key=lambda item: item[0])
        if not params:
            raise _no_params()
        group = {"params": [p for _, p in params], "names": [n for n, _ in params]}
        return torch.optim.SGD([group], lr=lr, foreach=True)
    groups = adamw_groups(named, weight_decay)
    if not groups:
        raise _no_params()
    return torch.optim.AdamW(groups, lr=lr, betas=betas, foreach=True)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's rate (groups differ in decay only, never in rate)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def unique_parameters(named_params: Iterable[tuple[str, torch.nn.Parameter]]):
    """Trainable (name, parameter) pairs, each tensor once under its first name (a tie held by
    two stages of one rank is one object), in first-seen order."""
    seen: set[int] = set()
    out = []
    for name, p in named_params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def _no_params() -> TpirError:
    return TpirError(Diagnostic("no trainable parameters to optimize", where="optimizer",
                                hint="a rank whose stages hold no parameters needs no optimizer; skip building one"))
