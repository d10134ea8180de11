"""Global gradient-norm clipping when the model's parameters are spread over ranks.

The norm to clip by is the whole model's: sqrt of the sum of every parameter's squared gradient
norm, over all stages. No rank sees all gradients, so the work is split in three small steps,
each usable by the interpreter (all ranks in one process) and by torchrun (one per process):

    sq = local_sq_norm(rank_named_params, skip=copies_not_owned)   # this rank's share
    total = sum of sq over the pipeline ranks of one replica            # all_reduce, or a sum
    apply_clip(rank_params, clip_coef(total, max_norm))

All three stay on the device: the summed squares are a tensor until the step's one read (with
the loss, tpc.executors.host_sync; the norm is their root, taken on the host), and the factor
is computed and applied there.

Why one replica's pipeline ranks suffice: clipping runs after the data-parallel allreduce, when
every replica holds the same (summed) gradients, so the pipeline sum of any replica is the
global norm and every replica computes the same coefficient. A tied parameter is held by several
ranks with the same gradient after `reduce-tied`; all but one of them pass its name in `skip` so
it is counted once, as `torch.nn.utils.clip_grad_norm_` on the unsliced model counts it.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

# clip_grad_norm_'s guard against dividing by a zero norm; the same value keeps results equal
_EPS = 1e-6


def local_sq_norm(named_params: Iterable[tuple[str, torch.nn.Parameter]], skip: frozenset[str] | set[str] = frozenset(),
                  device: torch.device | None = None) -> torch.Tensor:
    """Sum of squared gradient entries of the named parameters, as a float64 scalar tensor on
    the gradients' device (float64 so summing many ranks' shares loses nothing; on the device
    so that nothing here waits for it: the step reads it once, with its loss). Parameters
    without a gradient, names in `skip`, and a tensor listed twice under two names (a tie within
    one rank) add nothing beyond their first appearance; with none left, a zero on `device`."""
    total = None
    seen: set[int] = set()
    for name, p in named_params:
        if name in skip or p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        g = p.grad.detach()
        sq = g.to(torch.float64).pow(2).sum()
        total = sq if total is None else total + sq
    return torch.zeros((), dtype=torch.float64, device=device) if total is None else total


def clip_coef(total_sq_norm: float | torch.Tensor, max_norm: float) -> float | torch.Tensor:
    """The factor to scale every gradient by: max_norm / (norm + 1e-6) when the norm exceeds
    max_norm, else 1.0. `max_norm <= 0` means clipping is off (always 1.0). A non-finite norm
    gives a non-finite factor on purpose: the step is bad and the caller should see NaNs rather
    than a silently rescaled update (clip_grad_norm_ behaves the same way).

    For a tensor the factor is a float64 tensor on its device, computed there, so nothing waits
    for the device: the add and the (true) division round as Python's do (`max_norm / tensor`
    would multiply by a reciprocal), `clamp` keeps a NaN as `min` does here. torch's float64
    `sqrt` on the CPU is faithful, not always correctly rounded as `math.sqrt` is: the factor
    may differ from the number's in its last bit (of 53; for a few norms in a thousand), which
    changes a gradient only when that bit moves the factor across a rounding point of the
    gradient's precision (for fp32, a chance of about 2**-28 when it differs at all)."""
    if max_norm <= 0:
        return 1.0
    if isinstance(total_sq_norm, torch.Tensor):
        norm = total_sq_norm.to(torch.float64).sqrt()
        return torch.full_like(norm, max_norm).div_(norm + _EPS).clamp_(max=1.0)
    norm = math.sqrt(float(total_sq_norm))
    coef = max_norm / (norm + _EPS)
    return min(coef, 1.0) if math.isfinite(coef) else coef


def grad_norm(total_sq_norm: float | torch.Tensor) -> float:
    """The global gradient norm (for logging) from the summed squares, on the host: the executors
    read the summed squares with the step's loss and take the root here."""
    return math.sqrt(float(total_sq_norm))


def apply_clip(params: Iterable[torch.nn.Parameter], coef: float | torch.Tensor) -> None:
    """Scale every gradient in place by `coef` (a number: nothing to do when it is 1.0; a
    tensor on the gradients' device: always, as its value is not read, and multiplying by 1.0
    changes no bit). A float64 factor rounds to the gradient's precision exactly as a Python
    number does. A tensor listed twice is scaled once."""
    if not isinstance(coef, torch.Tensor) and coef == 1.0:
        return
    seen: set[int] = set()
    for p in params:
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        p.grad.detach().mul_(coef)


def copies_not_owned(header, pipe_rank: int, stage_names=None) -> frozenset[str]:
    """The `skip` set of pipeline rank `pipe_rank` for a plan header (`tpc.ir.nodes.Header`):
    each tie is counted by the rank of its first stage; every other rank holding it skips it.
    Stages name a tied parameter by the tie's name (its canonical name) on every rank. A stage
    with weight replicas is counted by its replica 0's rank: the others skip its parameters
    (`stage_names[s]`, the names of stage s's parameters on this rank), except a tied one, which
    the tie's rule counts (its first stage's replica 0 rank) whichever replica holds it."""
    tied = {t.name for t in header.ties}
    ties = {t.name for t in header.ties
            if header.stage_ranks(min(t.stages))[0] != pipe_rank
            and any(pipe_rank in header.stage_ranks(s) for s in t.stages)}
    replicas = {n for s, names in (stage_names or {}).items()
                if header.stage_ranks(s)[0] != pipe_rank for n in names if n not in tied}
    return frozenset(ties | replicas)


def clip_global(named_params: list[tuple[str, torch.nn.Parameter]], max_norm: float, *,
                skip: frozenset[str] | set[str] = frozenset(),
                sum_over_pipeline: Callable[[torch.Tensor], torch.Tensor],
                device: torch.device | None = None) -> torch.Tensor:
    """The three steps in one call, for an executor: this rank's share, summed by
    `sum_over_pipeline` over the pipeline ranks of this replica (an all_reduce over that group
    under torchrun; the plain sum of every rank's share in the interpreter), then the scaling.
    Returns the global sum of squared gradients (before clipping) as a float64 scalar tensor
    on the device (`grad_norm` of its value is the norm, worth logging even when max_norm is 0).
    Nothing here waits for the device: the factor is computed and applied there, and the
    executor reads the sum once per step, with the loss (tpc.executors.host_sync).
    """
    total = sum_over_pipeline(local_sq_norm(named_params, skip, device))
    if max_norm > 0:
        apply_clip((p for _, p in named_params), clip_coef(total, max_norm))
    return total
