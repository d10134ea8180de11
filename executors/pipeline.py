"""A pipeline: this process's part of a plan (or of a plan set) on an executor, one global batch
a step. It is what `import tpc` hands a user (`tpc.pipeline(...)`, executors/library.py) and
what `tpc run`'s training loop steps (executors/training_loop.py): one way to run a plan.

    pipe = Pipeline(plans, executor, evaluation=True)
    loss = pipe.step(inputs, targets)          # all micro-batches and slices of one step
    val = pipe.eval_step(inputs, targets)      # the plan's evaluation program
    pipe.named_parameters()                    # this process's, by the unsliced model's names

A step runs the plan whose sequence length is the batch's (a plan set holds one per length: a
bundle under a curriculum). Whether the step's `step` instruction updates the weights is the
executor's options' (`RunOptions.external_optimizer`): `tpc run` updates with tpc's optimizer;
a library user's pipeline leaves the gradients, summed over every rank that holds each
parameter, for the user's own optimizer, gradient clipping (`clip_grad_norm_`: the global norm
over all ranks) and learning-rate scheduler.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator, Mapping, Protocol

import torch

from tpc.executors.engine import read_step
from tpc.executors.host_sync import read
from tpc.executors.training.batches import Batch
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Plan


@dataclass(frozen=True)
class PlanSet:
    """The plans of a run by sequence length, and the length step s runs at. `curriculum` says
    whether the set came from a curriculum (its steps then report their length and tokens)."""

    plans: Mapping[int, Plan]
    length_of: Callable[[int], int]
    curriculum: bool = False

    @staticmethod
    def single(plan: Plan) -> "PlanSet":
        seq = plan.header.shape.seq
        return PlanSet({seq: plan}, lambda step: seq)

    @property
    def lengths(self) -> list[int]:
        return sorted(self.plans)

    @property
    def full(self) -> Plan:
        """The longest plan: batches are drawn at its length, and its evaluation program
        measures the validation loss."""
        return self.plans[max(self.plans)]

    def plan_at(self, step: int) -> tuple[int, Plan]:
        seq = self.length_of(step)
        return seq, self.plans[seq]


class Ranks(Protocol):
    """This process's ranks of one plan."""

    plan: Plan
    engines: list  # RankEngine: what checkpoints load into and save from

    def step(self, step: int, tokens: torch.Tensor) -> float:
        """Run one training step on the global batch `tokens`; the global loss."""
        ...

    def gradients(self) -> dict[str, torch.Tensor]:
        """The gradients of the last step (before its update) of this process's parameters."""
        ...

    def weights(self) -> dict[str, torch.Tensor]:
        """This process's parameters by name: a rank's (its parts, with a tensor axis), or,
        where every rank is here, the whole model's."""
        ...


class EvalRanks(Protocol):
    def evaluate(self, k: int, tokens: torch.Tensor) -> float:
        """Run the evaluation program once on batch `tokens`; its loss (the same everywhere)."""
        ...


class Executor(Protocol):
    """How this process runs the ranks of a plan."""

    # every rank of a plan runs in this process (the interpreter), each on a copy of the model
    every_rank: bool

    device: torch.device

    def build(self, plan: Plan, shared: Ranks | None) -> Ranks:
        """The ranks of a training plan; `shared`: ranks of another plan of the set, whose
        weights and optimizer these share."""
        ...

    def build_eval(self, plan: Plan, training: Ranks) -> EvalRanks:
        """The ranks of `plan`'s evaluation program, sharing `training`'s weights."""
        ...

    def waiting(self, what: str) -> ContextManager:
        """Marks a wait on the other ranks (for the watchdog's report)."""
        ...

    def start(self) -> None:
        """Before the first step, after loading: the ranks meet; trace times count from here."""
        ...

    def about_to_step(self, ranks: Ranks) -> None:
        """`ranks` run the next step (what the watchdog watches)."""
        ...

    def close(self) -> None:
        ...


class Pipeline:
    """This process's ranks of every plan of `plans` on `executor` (the plans share weights),
    and, with `evaluation`, the evaluation program of the longest plan."""

    def __init__(self, plans: PlanSet, executor: Executor, *, evaluation: bool = False):
        self.plans, self.executor = plans, executor
        self.ranks: dict[int, Ranks] = {}
        first = None
        for seq in plans.lengths:  # the optimizer of the first serves the others
            self.ranks[seq] = executor.build(plans.plans[seq], first)
            first = first or self.ranks[seq]
        self.first: Ranks = first
        self.last: Ranks = first  # the ranks of the latest step
        self.eval_ranks = None
        if evaluation:
            from tpc.executors.evaluation import require_eval_program

            require_eval_program(plans.full)
            self.eval_ranks = executor.build_eval(plans.full, self.ranks[max(self.ranks)])
        self.steps = 0  # steps run by `step`
        self.training = True
        self.model_names: dict[int, str] = {}  # id -> name of the user's model's parameters (library)
        self.holders: dict[str, int] = {}  # parameter name -> the pipeline rank whose stages train it
        # every rank of the plan in this process (the interpreter: each trains a copy of the model)
        self.interpreted = executor.every_rank
        _live.add(self)

    # ------------------------------------------------------------------ what the loop drives

    def run(self, step: int, batch: "Batch | torch.Tensor") -> float:
        """Training step `step` (from 0: its learning rate under tpc's schedule) on the global
        batch (a `Batch`, or tokens (rows, seq+1)) by the plan of the batch's length; the
        global loss."""
        batch = Batch.of(batch)
        ranks = self._ranks_for(batch, "step")
        self.executor.about_to_step(ranks)
        self.last = ranks
        return ranks.step(step, batch)

    def evaluate(self, k: int, batch: "Batch | torch.Tensor") -> torch.Tensor:
        """The evaluation program once on the global batch; its loss on the device, not read."""
        if self.eval_ranks is None:
            from tpc.executors.evaluation import require_eval_program

            require_eval_program(self.plans.full)  # a plan from before the evaluation program
            raise TpirError(Diagnostic("this pipeline was built without the evaluation program",
                                       hint="build it with evaluation=True"))
        batch = Batch.of(batch)
        self._check_shape(batch, self.eval_ranks.plan, "eval_step")
        return self.eval_ranks.evaluate(k, batch)

    @property
    def engines(self) -> list:
        """This process's engines of the first plan (the others share their parameters)."""
        return self.first.engines

    # ---------------------------------------------------------------- what a library user calls

    def step(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """One training step of the plan on the global batch: `inputs` (rows, seq) token ids and
        `targets` (rows, seq) the token each position predicts (None: the next input token,
        with the last position of each row dropped, so `inputs` is then (rows, seq+1)). All
        micro-batches and token slices of the plan run; the gradient of the whole batch's mean
        token loss is then added to each of this process's parameters' `.grad` (the sum over
        every rank that holds it), as `loss.backward()` adds it in one process: zero the
        gradients between steps (`optimizer.zero_grad()`) unless accumulating. Returns that
        loss, the same on every rank, as a 0-dim float64 tensor."""
        if not self.training:
            raise TpirError(Diagnostic("step() on a pipeline in eval mode",
                                       hint="call pipe.train() first (eval_step() evaluates)"))
        batch = _batch(inputs, targets, "step")
        self._check_tokens(batch, "step")
        # gradients the user left (accumulating over steps, as two backward passes do) are set
        # aside: the plan's reductions sum each rank's gradient of this step only, and the sum
        # is added to them after
        kept = {id(p): (p, p.grad.detach().clone()) for p in self.parameters() if p.grad is not None}
        for p, _ in kept.values():
            p.grad = None
        with self._own_precision():
            loss = self.run(self.steps, batch)
        for p, g in kept.values():
            p.grad = g if p.grad is None else p.grad.add_(g)
        self.steps += 1
        return torch.tensor(loss, dtype=torch.float64)

    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The plan's evaluation program (forward only, dropout off) on the global batch; its
        mean token loss, the same on every rank, as a 0-dim float64 tensor. Changes no weight
        and no gradient."""
        batch = _batch(inputs, targets, "eval_step")
        self._check_tokens(batch, "eval_step")
        with self._own_precision():
            loss = self.evaluate(0, batch)
        return torch.tensor(read([loss], "the evaluation loss")[0], dtype=torch.float64)

    def _own_precision(self):
        """A script's autocast (nanoGPT's `with ctx:`) switched off around the plan: the plan's
        stages compute in its dtype, under bf16 autocast only with `pipeline(..., bf16=True)`,
        and its messages travel in the plan's dtype."""
        return torch.autocast(device_type=self.engines[0].device.type, enabled=False)

    def train(self, mode: bool = True) -> "Pipeline":
        self.training = mode
        return self

    def eval(self) -> "Pipeline":
        return self.train(False)

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This process's parameters by the unsliced model's names, each once (a rank holding two
        stages of a tie holds one tensor)."""
        seen: set[int] = set()
        for e in self.engines:
            for n, p in e.named_parameters:
                if id(p) not in seen:
                    seen.add(id(p))
                    yield n, p

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients of the whole model (every rank's) to a global norm of `max_norm`,
        as `torch.nn.utils.clip_grad_norm_` on the unsliced model does; returns the global norm
        before clipping. Every rank calls it (a sum over the ranks). `clip_grad_norm_` of torch
        on `pipe.parameters()` would clip each rank by its own share of the norm."""
        from tpc.executors.training.clip import apply_clip, clip_coef, local_sq_norm

        engines = self.engines
        device = engines[0].device
        if not self.interpreted:  # one rank in this process: the others' shares over the wire
            e = engines[0]
            total = e._sum_over_model(local_sq_norm(e.named_parameters, e._counted_elsewhere(), device))
        else:  # every rank is here; the replicas hold the same (summed) gradients: count one
            total = torch.stack([local_sq_norm(e.named_parameters, e._counted_elsewhere(), device)
                                 for e in engines if e.data_rank == 0]).sum()
        coef = clip_coef(total, float(max_norm))
        apply_clip(self.parameters(), coef)
        return total.sqrt()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This process's parameters by the unsliced model's names (with a tensor axis, this
        rank's part of each parameter it cuts). Every rank's together are the whole model's;
        with every rank in this process (`interpret=True`), the whole model's."""
        return self.first.weights()

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load this process's parameters from `state`, keyed by the unsliced model's names: a
        whole model's state_dict, or this rank's part. `strict`: every parameter of this
        process must be in it."""
        missing = []
        with torch.no_grad():
            for e in self.engines:
                for n, p in e.named_parameters:
                    if n not in state:
                        missing.append(n)
                        continue
                    value = state[n]
                    shard = e.tensor.split(n) if e.tensor is not None else None
                    if shard is not None and tuple(value.shape) != tuple(p.shape):
                        value = shard.take(value, e.tensor_rank)
                    if tuple(value.shape) != tuple(p.shape):
                        raise TpirError(Diagnostic(
                            f"load_state_dict: {n} has shape {tuple(value.shape)}, the model's is "
                            f"{tuple(p.shape)}", hint="load a state_dict of the model the plan was compiled from"))
                    p.copy_(value.to(p.device, p.dtype))
        if strict and missing:
            raise TpirError(Diagnostic(
                f"load_state_dict: {len(missing)} parameter(s) of this rank are not in the state_dict, "
                f"first {missing[0]!r}", hint="pass the whole model's state_dict (or this rank's part), "
                "or strict=False to keep their values"))

    def close(self) -> None:
        self.executor.close()
        _live.discard(self)

    # ----------------------------------------------------------------------------- checks

    def _ranks_for(self, batch: Batch, call: str) -> Ranks:
        seq = batch.ids.shape[1] if batch.ids.dim() == 2 else None
        if seq not in self.ranks:
            full = self.plans.full.header.shape
            lengths = ", ".join(map(str, self.plans.lengths))
            raise TpirError(Diagnostic(
                f"{call}(): a batch of shape {tuple(batch.ids.shape)}, but the plan trains batches of "
                f"{full.batch} rows of {lengths} tokens", where=self.plans.full.source,
                hint=f"pass (rows, seq) token ids with seq in ({lengths}), or compile a plan for this length"))
        ranks = self.ranks[seq]
        self._check_shape(batch, ranks.plan, call)
        return ranks

    def _check_shape(self, batch: Batch, plan, call: str) -> None:
        h = plan.header
        want = (h.shape.batch, h.shape.seq)
        for what, t in (("inputs", batch.ids), ("targets", batch.targets)):
            if tuple(t.shape) != want:
                mbs = ", ".join(str(m.size) for m in h.microbatches)
                raise TpirError(Diagnostic(
                    f"{call}(): {what} of shape {tuple(t.shape)}, but the plan's step takes the whole "
                    f"batch, {want[0]} rows of {want[1]} tokens (micro-batches of {mbs} rows"
                    + (f" over {h.mesh.data} data replicas" if h.mesh.data > 1 else "") + ")",
                    where=plan.source,
                    hint=f"pass all {want[0]} rows of the step at once (the plan cuts its micro-batches from "
                         f"them), or compile with batch={t.shape[0]}" if t.dim() == 2 else
                         "pass (rows, seq) token ids"))
            if t.dtype != torch.int64:
                raise TpirError(Diagnostic(f"{call}(): {what} of dtype {t.dtype}; token ids are int64",
                                           where=plan.source, hint=f"pass {what}.long()"))

    def _check_tokens(self, batch: Batch, call: str) -> None:
        """A user's batch holds vocabulary indices (checked where it lies on the CPU: on a GPU
        this would wait for the device; `tpc run`'s batch sources check their files)."""
        plan = self.plans.full
        vocab = plan.header.shape.vocab
        for what, t in (("inputs", batch.ids), ("targets", batch.targets)):
            if t.device.type == "cpu" and t.numel():
                lo, hi = int(t.min()), int(t.max())
                if lo < 0 or hi >= vocab:
                    raise TpirError(Diagnostic(
                        f"{call}(): {what} hold token {lo if lo < 0 else hi}, outside the vocabulary "
                        f"[0, {vocab})", where=plan.source,
                        hint="every token must be a vocabulary index; tpc's loss is the mean over all tokens "
                             "(no ignore index)"))


def _batch(inputs, targets, call: str) -> Batch:
    if not isinstance(inputs, torch.Tensor) or (targets is not None and not isinstance(targets, torch.Tensor)):
        raise TpirError(Diagnostic(f"{call}(): inputs and targets must be tensors of token ids",
                                   hint=f"{call}(inputs, targets) with (rows, seq) int64 tensors"))
    if targets is None:
        if inputs.dim() != 2 or inputs.shape[1] < 2:
            raise TpirError(Diagnostic(f"{call}(inputs): tokens of shape {tuple(inputs.shape)}",
                                       hint="without targets, pass (rows, seq+1) tokens: the ids and the "
                                            "token after each"))
        return Batch.of(_long(inputs))
    return Batch(_long(inputs), _long(targets))


def _long(t: torch.Tensor) -> torch.Tensor:
    """Token ids of a narrower integer type (int32, uint16 from a memmap) as int64."""
    return t.long() if t.dtype in (torch.int32, torch.int16, torch.uint8, torch.uint16) else t


# the pipelines alive in this process: an optimizer's step checks it updates their parameters
_live: "weakref.WeakSet[Pipeline]" = weakref.WeakSet()


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer over parameters of the user's model that no stage of this process
    trains (they live on another rank; this rank would never give them a gradient): located by
    the parameter and the rank that holds it, with the fix."""
    for pipe in list(_live):
        if not pipe.model_names:
            continue
        mine = {id(p) for p in pipe.parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = pipe.model_names.get(id(p))
                if name is None or id(p) in mine:
                    continue
                where = pipe.holders.get(name)
                holder = (f"pipeline rank {where}'s stages train it" if where is not None else
                          "the interpreter's ranks train copies of the model's parameters" if pipe.interpreted
                          else "no stage of this process trains it")
                raise TpirError(Diagnostic(
                    f"{type(optimizer).__name__}.step(): the optimizer holds {name!r}, a parameter this "
                    f"rank does not train ({holder})",
                    hint="build the optimizer over this rank's parameters: "
                         f"{type(optimizer).__name__}(pipe.parameters(), ...) (or groups of "
                         "pipe.named_parameters())"))
