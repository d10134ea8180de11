"""The learning-rate schedule: linear warm-up, then cosine decay to a floor.

    lr
    peak ┤    ╭──╮
         │   ╱    ╲_
         │  ╱       ╲_
    floor┤ ╱          ╲______   floor = min_ratio * peak
       0 ┼─────┬──────────┬──── step
           warmup       total

A pure function of the step, so a resumed run needs no scheduler state: the step counter in
the checkpoint is enough to continue on the same curve.

`total == 0` means "no decay": the run's length is unknown (or irrelevant), so after warm-up the
rate stays at `peak`. Steps past `total` stay at the floor rather than rising again as the
cosine would.
"""

from __future__ import annotations

import math

from tpc.ir.diagnostics import Diagnostic, TpirError


def lr_at(step: int, *, peak: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """The learning rate for optimizer step `step` (counting from 0).

    Warm-up: step s < warmup gets peak * (s + 1) / warmup, so the first step already moves the
    weights and step warmup-1 reaches the peak. Decay: from `warmup` to `total` the rate follows
    half a cosine from `peak` to `min_ratio * peak`; at and after `total` it is the floor.
    """
    _check(step, peak=peak, warmup=warmup, total=total, min_ratio=min_ratio)
    if step < warmup:
        return peak * (step + 1) / warmup
    if total == 0:
        return peak
    floor = min_ratio * peak
    if step >= total:
        return floor
    span = total - warmup
    progress = (step - warmup) / span  # in [0, 1)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _check(step: int, *, peak: float, warmup: int, total: int, min_ratio: float) -> None:
    """Refuse settings that would give a meaningless curve, naming the option to change."""
    if step < 0:
        raise TpirError(Diagnostic(f"learning-rate schedule asked for step {step}", where="lr schedule",
                                   hint="steps count from 0"))
    if not peak > 0:
        raise TpirError(Diagnostic(f"peak learning rate must be > 0, got {peak}", where="--lr",
                                   hint="e.g. --lr 3e-4"))
    if warmup < 0:
        raise TpirError(Diagnostic(f"warm-up steps must be >= 0, got {warmup}", where="--warmup",
                                   hint="use 0 for no warm-up"))
    if total < 0 or (total and total < warmup):
        raise TpirError(Diagnostic(f"decay ends at step {total}, before warm-up ends at step {warmup}",
                                   where="--steps",
                                   hint="train for at least as many steps as --warmup, or lower --warmup"))
    if not 0.0 <= min_ratio <= 1.0:
        raise TpirError(Diagnostic(f"min_ratio must lie in [0, 1], got {min_ratio}", where="lr schedule",
                                   hint="the floor is min_ratio * peak, e.g. 0.1"))
