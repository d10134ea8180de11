"""Validation during training: `tpc run --eval-data FILE --eval-every N --eval-batches K`.

The plan's evaluation program (format version 2, `Plan.evaluation()`: forward only) runs on the
K batches of `EvalBatches` (the same every time) through engines of its own, whose stages share
the training stages' parameters and run as `model.eval()` does (dropout off). The validation loss
is the mean over the K batches of each batch's mean token loss (equal batches: the mean over all
their tokens); its perplexity is exp of it.

When: before the first step (the loss the run starts from), after every N-th step, and after the
last step (N = 0: only before and after). Evaluation changes nothing training reads: no weight, no
gradient, no optimizer state (the forward keeps no graph and the stages have no optimizer), and no
random stream (it runs inside `torch.random.fork_rng`, so the RNG of the next training step is
the one it would have been).

Each executor gives `Evaluation` one function, `run_batch(k, tokens) -> loss`, that runs the
evaluation program once on every rank it holds and returns the loss (the same on every rank:
the interpreter takes it from the last stage, the distributed executor broadcasts it from
there), on the device: the evaluation reads its batches' losses in one transfer at its end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from tpc.executors.host_sync import read
from tpc.executors.options import RunOptions
from tpc.executors.training.progress import perplexity  # noqa: F401 - the one definition, re-exported
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Plan


def check_eval_plan(plan: Plan, options: RunOptions) -> None:
    """Refuse --eval-data with a plan that has no evaluation program (one written before format
    version 2 added it), before any training."""
    if options.eval_data:
        require_eval_program(plan)


def require_eval_program(plan: Plan) -> None:
    """Refuse to evaluate with a plan that has no evaluation program."""
    if plan.eval is None:
        raise TpirError(Diagnostic(
            f"--eval-data: the plan {plan.source} has no evaluation program (an `eval` section)",
            loc=plan.header.version_loc, where=plan.source,
            hint="compile the plan again with this tpc (`tpc compile` writes the evaluation program, "
                 "format version 2)"))


def eval_batches(plan: Plan, options: RunOptions):
    """The validation batches of the run, or None without --eval-data. Read and checked now,
    before any training."""
    if not options.eval_data:
        return None
    check_eval_plan(plan, options)
    from tpc.executors.training.eval_data import EvalBatches

    s = plan.header.shape
    return EvalBatches(options.eval_data, batch=s.batch, seq=s.seq, vocab=s.vocab,
                       count=options.eval_batches, train_data=options.data)


@dataclass
class Evaluation:
    """When to evaluate, and how: `run_batch(k, tokens) -> loss` runs the program once."""

    batches: object  # EvalBatches: get(k), count
    every: int
    total: int  # the step the run ends at
    run_batch: Callable[[int, torch.Tensor], "torch.Tensor | float"]
    device: torch.device = torch.device("cpu")

    def due(self, done: int) -> bool:
        """After `done` completed steps: at the start, every `every` steps, at the end."""
        return done == 0 or done >= self.total or (self.every > 0 and done % self.every == 0)

    def run(self) -> float:
        """The validation loss: the mean over the batches, every random stream left as it was."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            losses = [self.run_batch(k, self.batches.get(k)) for k in range(self.batches.count)]
        losses = read(losses, "the validation loss")  # one wait for the device, for all batches
        return math.fsum(losses) / len(losses)

