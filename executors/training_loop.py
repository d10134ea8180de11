"""The one training loop: both executors, one plan or a plan bundle, with evaluation,
checkpoints, progress and the curriculum wired here and nowhere else.

    loop = TrainingLoop(plans, executor, options, batches=..., eval_batches=..., checkpoints=...,
                        on_step=..., on_eval=...)
    outcome = loop.run()

`plans` is a `PlanSet` (executors/pipeline.py): the plans a run may step with, by sequence
length, and which one step s uses (`length_of`). The loop steps them through a `Pipeline`
(executors/pipeline.py), the object a library user steps too (`import tpc`): one way to run a
plan. The `Executor` is how this process runs ranks: the reference interpreter runs every rank
of the plan here (executors/interpreter.py), the distributed executor one rank per process
(executors/distributed.py).

What the loop does, in order:
1. the pipeline is built: every plan's ranks (the optimizer of the first serves the others), and
   the evaluation program's (the longest plan's `eval` section) when `eval_batches` are given;
2. the checkpoint (or --init-from weights) is loaded into the first plan's engines, and the
   step to start at read from it;
3. `executor.start()` (the distributed executor: a barrier, and the trace clock);
4. an evaluation before the first step, when the run starts at step 0;
5. each step: the plan of its length runs on `batches.get(step)` and gives the global loss
   (a loss that is not a finite number stops the run there, before anything of the step is
   saved, unless `options.allow_nonfinite_loss`); the step reads the device once, for its loss
   and gradient norm together (executors/host_sync.py: each step and evaluation is `watched`);
   the first step's gradients are kept; the evaluation when due; `on_step(step, loss, info)`;
   a checkpoint when due (and the best one after an evaluation, with --save-best).

The loop holds no process state of its own beyond what `run` returns.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from tpc.executors.host_sync import watched
from tpc.executors.pipeline import Pipeline, PlanSet, Ranks
from tpc.ir.diagnostics import Diagnostic, TpirError


@dataclass
class LoopOutcome:
    """What a run of the loop produced: each step's global loss, the first step's gradients (this
    process's parameters, before the update), the evaluations (completed steps, validation
    loss), every plan's ranks by length, and the ranks of the last step."""

    losses: list[float]
    first_grads: dict[str, torch.Tensor]
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    ranks: dict[int, Ranks] = field(default_factory=dict)
    last: Ranks | None = None

    @property
    def engines(self) -> list:
        """Every engine of every plan, each once."""
        return [e for r in self.ranks.values() for e in r.engines]


class CheckpointHook:
    """What the loop calls of its `checkpoints` (RunCheckpoints saves and loads; a stand-in
    overrides what it needs): `lock()` before anything is loaded, `start(engines)` -> the step
    the run starts from, `after_step(engines, done)` and `after_eval(engines, done, loss)` when
    due, `unlock()` on every way out. These defaults take no folder and save nothing."""

    def lock(self) -> None:
        return None

    def unlock(self) -> None:
        return None

    def start(self, engines) -> int:
        return 0

    def after_step(self, engines, done: int):
        return None

    def after_eval(self, engines, done: int, loss: float):
        return None


class TrainingLoop:
    """Steps `plans` on `executor` up to `options.steps` (the module docstring). `on_step(step,
    loss, info)`: info has "lr", "grad_norm" (None unless computed), "step_time" (seconds),
    "val_loss" (None unless evaluated after this step), and under a curriculum "seq" and
    "tokens". `on_eval(done, loss)`: the evaluation before the first step."""

    def __init__(self, plans: PlanSet, executor: Executor, options, *, batches, eval_batches=None,
                 checkpoints=None, on_step=None, on_eval=None):
        self.plans, self.executor, self.options = plans, executor, options
        self.batches, self.eval_batches = batches, eval_batches
        self.checkpoints, self.on_step, self.on_eval = checkpoints, on_step, on_eval

    def run(self) -> LoopOutcome:
        from tpc.executors.evaluation import Evaluation, require_eval_program

        options, executor, plans = self.options, self.executor, self.plans
        if self.eval_batches is not None:
            require_eval_program(plans.full)  # before anything is built
        out = LoopOutcome(losses=[], first_grads={})
        try:  # from the first build on: the executor may hold a thread (the watchdog) to end
            pipe = Pipeline(plans, executor, evaluation=self.eval_batches is not None)
            out.ranks, out.last = pipe.ranks, pipe.first
            first = pipe.first
            evaluation = None
            if self.eval_batches is not None:
                evaluation = Evaluation(self.eval_batches, options.eval_every, options.steps,
                                        pipe.evaluate, executor.device)
            start = 0
            if self.checkpoints is not None:
                with executor.waiting("rank 0 to lock the checkpoint folder"):
                    self.checkpoints.lock()  # one run per folder: before anything is loaded or saved
                with executor.waiting("the other ranks to load the checkpoint"):
                    start = self.checkpoints.start(first.engines)
            executor.start()
            if evaluation is not None and start == 0:
                with executor.waiting("the evaluation before the first step"), watched("the evaluation"):
                    out.eval_losses.append((0, evaluation.run()))
                if self.on_eval is not None:
                    self.on_eval(0, out.eval_losses[-1][1])
            for step in range(start, options.steps):
                seq, plan = plans.plan_at(step)
                with watched(f"step {step + 1}"):  # the device is read once, by the step itself
                    started = time.perf_counter()
                    loss = pipe.run(step, self.batches.get(step))
                    current = out.last = pipe.last
                    if not math.isfinite(loss) and not options.allow_nonfinite_loss:
                        raise nonfinite_loss(step, loss, self.checkpoints)
                    out.losses.append(loss)
                    if step == start:
                        out.first_grads = current.gradients()
                    step_time = time.perf_counter() - started
                    val = None
                    if evaluation is not None and evaluation.due(step + 1):
                        with executor.waiting("the evaluation"):
                            val = evaluation.run()
                        out.eval_losses.append((step + 1, val))
                    if self.on_step is not None:
                        info = dict(lr=options.lr_at(step), grad_norm=current.engines[0].grad_norm,
                                    step_time=step_time, val_loss=val)
                        if plans.curriculum:
                            info.update(seq=seq, tokens=plan.header.tokens_per_step)
                        self.on_step(step, loss, info)
                if self.checkpoints is not None:
                    with executor.waiting("the other ranks to write their checkpoint shards"):
                        self.checkpoints.after_step(current.engines, step + 1)
                        if val is not None:
                            self.checkpoints.after_eval(current.engines, step + 1, val)
        finally:
            executor.close()
            if self.checkpoints is not None:
                self.checkpoints.unlock()
        return out


def nonfinite_loss(step: int, loss: float, checkpoints) -> TpirError:
    """The error that stops a run whose loss is not a finite number, before anything of that
    step is saved (the loss is the global one, the same on every rank: all stop alike)."""
    kept = ("the checkpoints saved before it are as they were"
            if checkpoints is not None and checkpoints.dir is not None else "nothing was saved")
    return TpirError(Diagnostic(
        f"step {step + 1}: the loss is {loss}; the run stops before saving anything of this step "
        f"({kept})", where="the loss",
        hint="lower --lr, clip gradients (--grad-clip 1.0), or check the data; resume from the last "
             "checkpoint with --resume. --allow-nonfinite-loss trains on regardless"))
