"""The optimizer of one rank: torch.optim over the parameters of the rank's stages.

Every rank builds the same kind of optimizer over the parameters it holds. SGD and AdamW update
each parameter from its own gradient and state only, so optimizing the stages separately gives
exactly the weights one optimizer over the whole model gives, as long as the gradients are the
whole model's (after allreduce and reduce-tied). A tied parameter held by several ranks gets the
same summed gradient everywhere, so its copies stay equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

from tpc.executors.training.param_groups import unique_parameters
from tpc.ir.diagnostics import Diagnostic, TpirError

KINDS = ("adamw", "sgd")


@dataclass(frozen=True)
class OptimSpec:
    """What to build: `kind` is adamw or sgd; AdamW's weight decay applies to matrices only
    (embeddings and linear weights), never to biases and norm gains, as in nanoGPT."""

    kind: str = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise TpirError(Diagnostic(f"unknown optimizer {self.kind!r}",
                                       where="--optimizer", hint=f"use one of: {', '.join(KINDS)}"))
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise TpirError(Diagnostic(f"learning rate must be a finite number > 0, got {self.lr}",
                                       where="--lr", hint="e.g. --lr 3e-4"))
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise TpirError(Diagnostic(f"weight decay must be a finite number >= 0, got {self.weight_decay}",
                                       where="--weight-decay", hint="e.g. --weight-decay 0.1"))


class RankOptimizer:
    """`step()` updates the parameters and zeroes their gradients (set to None). The torch
    optimizer is `tpc.executors.training.param_groups.build_optimizer`'s: decay on matrices only, and
    multi-tensor (foreach) kernels with per-element arithmetic, so a split model steps exactly as
    the whole one. With `keep_grads` (set when the gradients live in a transport's flat buffer)
    the gradients are zeroed in place instead of dropped, so they stay in the buffer."""

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]], spec: OptimSpec):
        from tpc.executors.training.param_groups import build_optimizer as torch_optimizer

        params = unique_parameters(named_params)
        self.spec = spec
        self.params = [p for _, p in params]
        # a rank may hold no trainable parameter; step is then a no-op
        self.opt = torch_optimizer(spec.kind, params, spec.lr, spec.weight_decay, spec.betas) if params else None
        self.keep_grads = False

    def set_lr(self, lr: float) -> None:
        if self.opt is not None:
            for group in self.opt.param_groups:
                group["lr"] = lr

    def step(self) -> None:
        if self.opt is not None:
            self.opt.step()
            self.opt.zero_grad(set_to_none=not self.keep_grads)

    # ------------------------------------------------- what checkpoints ask (model_state.py)

    sharded = False  # each parameter's whole state is here (sharded_optimizer.py keeps parts)

    def optimizes(self, p: torch.nn.Parameter) -> bool:
        return self.opt is not None and any(q is p for g in self.opt.param_groups for q in g["params"])

    def state_of(self, p: torch.nn.Parameter) -> dict | None:
        """The live state tensors of `p` by field (AdamW: step, exp_avg, exp_avg_sq), or None
        when it has none yet."""
        if self.opt is None or p not in self.opt.state:
            return None
        return dict(self.opt.state[p])

    def init_state(self) -> None:
        """Create every state tensor, for a checkpoint load to fill (changes no weight)."""
        if self.opt is not None:
            from tpc.executors.training.checkpoint import init_optimizer_state

            init_optimizer_state(self.opt)

    def forget(self, p: torch.nn.Parameter) -> None:
        """Drop `p`'s state (it had none in the checkpoint)."""
        if self.opt is not None:
            self.opt.state.pop(p, None)


class ExternalOptimizer:
    """The `step` instruction of a pipeline whose optimizer is the user's (`tpc.Pipeline`): it
    updates nothing and zeroes nothing. The gradients stay in the parameters' `.grad`, summed
    over every rank that holds each parameter (the plan's allreduce and reduce-tied ran before
    it), for the user's optimizer to step on, exactly as after `loss.backward()` in one process."""

    sharded = False

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]]):
        self.params = [p for _, p in unique_parameters(named_params)]
        self.keep_grads = False

    def set_lr(self, lr: float) -> None:
        return None

    def step(self) -> None:
        return None


def build_optimizer(named_params, spec: OptimSpec) -> RankOptimizer:
    return RankOptimizer(named_params, spec)
