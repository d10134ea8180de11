"""The reference interpreter: every rank of a plan, every data replica, in one process.

This is the executable definition of the IR's semantics (docs/ir.md), under the rules of either
backend (tpc.ir.semantics), `RunOptions.comm`:

- a send appends to the in-memory FIFO channel of its (source, destination) direction; with
  gloo's rules (the default) it never blocks; with NCCL's (`comm="nccl"`) the rank does not go
  past it until the receiver has taken the message (a rendezvous), and past an `exchange` only
  when every send of it has been taken and every receive has arrived;
- a receive blocks until its message is at the head of that channel; the message must be the one
  the receive names (FIFO order per direction is part of the format);
- `allreduce stage S` waits for every replica's rank of stage S and sums their gradients;
  `reduce-tied "NAME"` waits for every rank of the replica whose stages hold NAME and sums;
- ranks run cooperatively: each runs until it blocks, then the next; when a full round makes no
  progress and some rank is unfinished, the plan deadlocks and the error lists every stuck
  rank's instruction with its line.

Scheduling order never changes a result (messages are matched by channel order, sums are taken in
rank order), so the interpreter is deterministic.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from tpc.executors.training.batches import BatchSource, RandomTokens
from tpc.executors.engine import Blocked, RankEngine, RankError, TraceEvent, stage_factory_from_model
from tpc.executors.options import RunOptions
from tpc.executors.plan_model import load_plan_model, slice_model
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Plan
from tpc.ir.verify import check
from tpc.ir.semantics import NCCL, Message, wait_chain


@dataclass
class RunResult:
    """What a run produced. `grads` are those of the last step, before its optimizer update,
    keyed by parameter name (a tie's gradient is the sum over its stages); `peak_live` is the
    largest number of slice activations any replica of each pipeline rank held at once."""

    losses: list[float]
    grads: dict[str, torch.Tensor]
    peak_live: list[int]
    state_dict: dict[str, torch.Tensor]
    events: list[TraceEvent] = field(default_factory=list)
    # the first step's gradients (the step where the weights are still the initial ones)
    first_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    # (completed steps, validation loss) of each evaluation (with `eval_batches`)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)


class _Hub:
    """The in-memory network shared by every rank: channels and pending collectives."""

    def __init__(self):
        self.channels: dict[tuple[int, int], deque[tuple[Message, torch.Tensor]]] = {}
        self.pending: dict[tuple, dict] = {}
        # per channel, how many messages were ever put on it and taken off it
        self.pushed: dict[tuple[int, int], int] = {}
        self.taken: dict[tuple[int, int], int] = {}

    def channel(self, src: int, dst: int) -> deque:
        return self.channels.setdefault((src, dst), deque())

    def collective(self, key: tuple, members: list[int], me: int, tensors: list[torch.Tensor],
                   what: str) -> None:
        """Sum `tensors` over `members` (global ranks) in place; `Blocked` until all arrived.
        Arriving twice is harmless: a blocked rank re-offers the same tensors on retry."""
        if len(members) == 1:
            return
        entry = self.pending.setdefault(key, {"arrived": {}, "result": None, "done": set()})
        entry["arrived"][me] = tensors
        missing = [r for r in members if r not in entry["arrived"]]
        if missing:
            raise Blocked(f"{what}: waiting for rank{'s' if len(missing) > 1 else ''} "
                          f"{', '.join(map(str, missing))}", ranks=missing)
        if entry["result"] is None:
            counts = {len(entry["arrived"][r]) for r in members}
            if len(counts) != 1:
                raise TpirError(Diagnostic(f"{what}: ranks offer different numbers of tensors",
                                           hint="replicas of a rank must hold the same stages"))
            entry["result"] = [_ordered_sum([entry["arrived"][r][j] for r in members])
                               for j in range(counts.pop())]
        for t, total in zip(tensors, entry["result"]):
            t.copy_(total)
        entry["done"].add(me)
        if len(entry["done"]) == len(members):
            del self.pending[key]


def _ordered_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum in member order, so every run adds in the same order."""
    total = tensors[0].clone()
    for t in tensors[1:]:
        total += t
    return total


class LocalTransport:
    """One rank's end of the in-memory network."""

    def __init__(self, hub: _Hub, plan: Plan, pipe_rank: int, data_rank: int,
                 rendezvous: bool = False):
        """`rendezvous`: NCCL's rules (the module docstring), else gloo's buffered sends."""
        self.hub, self.header = hub, plan.header
        self.pipe, self.data = plan.header.mesh.pipe, plan.header.mesh.data
        self.pipe_rank, self.data_rank = pipe_rank, data_rank
        self.me = data_rank * self.pipe + pipe_rank
        self.step = 0
        self.seen: dict[tuple, int] = {}
        self.rendezvous = rendezvous
        self.unreceived: list[tuple[Message, int, tuple[int, int], int]] = []  # sends not yet taken
        self.exchange_end = 0  # the instruction after the members of the current exchange

    def _global(self, pipe_rank: int) -> int:
        return self.data_rank * self.pipe + pipe_rank

    def exchange(self, index: int, count: int) -> None:
        self.exchange_end = index + 1 + count

    def before_instruction(self, index: int) -> None:
        """NCCL's rules: past a send (or an exchange) only once the receiver took the message."""
        if not self.unreceived or index < self.exchange_end:
            return
        taken = self.hub.taken
        self.unreceived = [u for u in self.unreceived if taken.get(u[2], 0) <= u[3]]
        if self.unreceived:
            key, dst, _, _ = self.unreceived[0]
            raise Blocked(f"the send of {key}: rank {dst} has not posted its receive (NCCL's "
                          "rules: a send completes only when its receive is posted)", ranks=(dst,))

    def send(self, key: Message, tensor: torch.Tensor, dst: int, index: int) -> None:
        chan = (self.me, self._global(dst))
        self.hub.channel(*chan).append((key, tensor.clone()))
        seq = self.hub.pushed.get(chan, 0)
        self.hub.pushed[chan] = seq + 1
        if self.rendezvous:
            self.unreceived.append((key, self._global(dst), chan, seq))

    def recv(self, key: Message, src: int, shape, dtype, index: int) -> torch.Tensor:
        queue = self.hub.channel(self._global(src), self.me)
        if not queue:
            raise Blocked(f"waiting for {key} from rank {src}", ranks=(self._global(src),))
        got, tensor = queue[0]
        if got != key:
            raise TpirError(Diagnostic(
                f"the next message from rank {src} is {got}, not {key}",
                hint="messages between two ranks are received in the order they were sent; "
                     "reorder the sends or the receives"))
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise TpirError(Diagnostic(
                f"received a {tuple(tensor.shape)} {tensor.dtype} tensor, the plan implies {tuple(shape)} {dtype}",
                hint="both ranks must run the same plan"))
        queue.popleft()
        chan = (self._global(src), self.me)
        self.hub.taken[chan] = self.hub.taken.get(chan, 0) + 1
        return tensor

    def _occurrence(self, kind: tuple) -> tuple:
        """A key for the n-th collective of a kind in this step (identical on all members)."""
        return (self.step, *kind)

    def allreduce(self, stage: int, tensors: list[torch.Tensor]) -> None:
        members = [d * self.pipe + self.pipe_rank for d in range(self.data)]
        self.hub.collective(self._occurrence(("allreduce", stage, self.pipe_rank)), members, self.me,
                            tensors, f"allreduce stage {stage}")

    def reduce_tied(self, name: str, tensor: torch.Tensor) -> None:
        tie = next(t for t in self.header.ties if t.name == name)
        ranks = sorted({self.header.stage_ranks(s)[0] for s in tie.stages})
        members = [self._global(r) for r in ranks]
        self.hub.collective(self._occurrence(("tie", name, self.data_rank)), members, self.me,
                            [tensor], f"reduce-tied {name!r}")

    def reduce_replicas(self, stage: int, tensors: list[torch.Tensor]) -> None:
        members = [self._global(r) for r in sorted(self.header.stage_ranks(stage))]
        self.hub.collective(self._occurrence(("replicas", stage, self.data_rank)), members, self.me,
                            tensors, f"reduce-replicas stage {stage}")

    def reduce_loss(self, tensor: torch.Tensor) -> None:
        members = [d * self.pipe + self.pipe_rank for d in range(self.data)]
        self.hub.collective(self._occurrence(("reduce-loss", self.pipe_rank)), members, self.me,
                            [tensor], "reduce-loss")

    def flush(self) -> None:
        pass  # in-memory sends complete at once

    def sum_over_pipeline(self, tensor: torch.Tensor) -> torch.Tensor:
        members = [self._global(r) for r in range(self.pipe)]
        self.hub.collective(self._occurrence(("pipeline-sum", self.data_rank)), members, self.me,
                            [tensor], "the global gradient norm")
        return tensor


def run_cooperatively(engines: list[RankEngine]) -> None:
    """Run every engine to the end of its stream; a round without progress is a deadlock."""
    while True:
        progressed = False
        waiting: dict[int, Blocked] = {}
        for e in engines:
            while not e.done:
                try:
                    e.execute_next()
                    progressed = True
                except Blocked as b:
                    waiting[id(e)] = b
                    break
        if all(e.done for e in engines):
            return
        if not progressed:
            raise deadlock_error(engines, waiting)


def deadlock_error(engines: list[RankEngine], waiting: dict[int, Blocked]) -> RankError:
    """One diagnostic for the deadlock, with the wait-for cycle, then one per stuck rank at its
    blocked instruction."""
    stuck = [e for e in engines if not e.done]
    finished = [e.rank_name for e in engines if e.done]
    by_rank = {e.global_rank: e for e in stuck}
    waits_for = {e.global_rank: [q for q in waiting[id(e)].ranks if q in by_rank]
                 for e in stuck if id(e) in waiting}

    def place(r: int) -> str:
        e = by_rank[r]
        return f"rank {e.rank_name} line {e.line_of(e.pc)}"

    chain = wait_chain(waits_for, stuck[0].global_rank) if stuck[0].global_rank in waits_for else []
    cycle = "".join((" waits for " if k == 1 else ", which waits for " if k else "") + place(r)
                    for k, r in enumerate(chain))
    head = Diagnostic(
        f"deadlock: no rank can make progress ({len(stuck)} of {len(engines)} ranks are blocked"
        + (f"; ranks {', '.join(finished)} finished" if finished else "") + ")"
        + (f": {cycle}" if len(chain) > 1 else ""),
        where=stuck[0].plan.source,
        hint="each blocked rank waits for a message or a collective that no runnable rank will "
             "produce; `tpc verify` explains the ordering rule that is broken")
    diags = [head]
    for e in stuck:
        why = waiting[id(e)].waiting_for if id(e) in waiting else "waiting"
        diags.append(Diagnostic(f"{e.where(e.pc)}: blocked, {why}", loc=e.current.loc, where=e.plan.source))
    return RankError(diags)


def interpret(plan: Plan, options: RunOptions | None = None, *, model: torch.nn.Module | None = None,
              sliced=None, stage_factory_for=None, hidden_size: int | None = None,
              batches: BatchSource | None = None, on_step=None, checkpoints=None,
              verify: bool = True, keep_grads: bool = True, eval_batches=None,
              on_eval=None) -> RunResult:
    """Run `plan` for `options.steps` training steps with every rank in this process.

    How to train is `options` (tpc.executors.options.RunOptions; the interpreter always keeps
    the gradients: `RunResult.grads` and `first_grads`). The model comes from the plan's model
    file (built after `torch.manual_seed(options.seed)`) unless `model` is given; `sliced` is
    its `SlicedModel` (built here when not given). Each (pipeline rank, replica) trains its own
    copy of the model, as separate processes would.
    `stage_factory_for(model_copy) -> StageFactory` replaces the front end (tests use a fake one,
    with `hidden_size`). `batches` default to random tokens from `options.seed`.
    `on_step(step, loss, info)` is called after every step; info has the step's "lr",
    "grad_norm" (when `options.needs_grad_norm`, else None) and "step_time" in seconds.
    `checkpoints` (`tpc.executors.training.run_checkpoints.RunCheckpoints`) first loads what
    the run starts from (the newest checkpoint when resuming: the run then goes from its step
    up to `options.steps`, and `losses` holds only the steps run here; or --init-from weights)
    and saves all ranks' state when due.
    `verify=False` skips the verifier (to study a broken plan). `keep_grads=False` keeps no
    copy of the gradients (`grads` and `first_grads` stay empty; benchmarks time steps without
    that copy). On CUDA each step's time is taken after the device has finished the step.
    `eval_batches` (`tpc.executors.training.eval_data.EvalBatches`: get(k), count) runs the
    plan's evaluation program (executors/evaluation.py) before the first step (of a run from
    step 0), after every `options.eval_every` steps and after the last, on every replica's
    ranks with their own weights; `on_eval(done, loss)` is called for the one before the first
    step, the others go to `on_step` as info["val_loss"]; all are in `RunResult.eval_losses`.
    """
    options = options or RunOptions()
    device = options.torch_device()
    rules = options.comm_rules(device, interpreted=True)
    if verify:
        check(plan, rules)
    header = plan.header
    if model is None and stage_factory_for is None:
        model = load_plan_model(plan, options.seed)
    if stage_factory_for is None:
        if sliced is None:
            sliced = slice_model(model, plan)
        hidden_size = sliced.hidden_size

        def stage_factory_for(copy_):
            return stage_factory_from_model(sliced, copy_)
    if hidden_size is None:
        raise TpirError(Diagnostic("the hidden size of the model is unknown",
                                   hint="pass hidden_size with stage_factory_for"))
    batches = batches or RandomTokens(options.seed, header.shape.batch, header.shape.seq, header.shape.vocab)
    if keep_grads:
        options = dataclasses.replace(options, record_grads=True)
    hub = _Hub()
    engines: list[RankEngine] = []
    copies = []
    for d in range(header.mesh.data):
        for p in range(header.mesh.pipe):
            copy_ = copy.deepcopy(model).to(device) if model is not None else None
            copies.append(copy_)
            engines.append(RankEngine(plan, p, d, LocalTransport(hub, plan, p, d, rules == NCCL),
                                      stage_factory_for(copy_),
                                      hidden_size=hidden_size, options=options, device=device))
    evaluation = None
    if eval_batches is not None:
        evaluation = _evaluation(plan, options, eval_batches, copies, sliced, hidden_size, device)
    start = checkpoints.start(engines) if checkpoints is not None else 0
    losses: list[float] = []
    eval_losses: list[tuple[int, float]] = []
    first_grads: dict[str, torch.Tensor] = {}
    if evaluation is not None and start == 0:
        eval_losses.append((0, evaluation.run()))
        if on_eval is not None:
            on_eval(0, eval_losses[-1][1])
    for step in range(start, options.steps):
        started = time.perf_counter()
        loss = _train_step(engines, step, batches.get(step))
        losses.append(loss)
        if step == start:
            first_grads = canonical_names(model, _gather(engines, lambda e: e.grads.items()))
        if device.type == "cuda":  # the optimiser's kernels may still be running
            torch.cuda.synchronize(device)
        step_time = time.perf_counter() - started
        val = None
        if evaluation is not None and evaluation.due(step + 1):
            val = evaluation.run()
            eval_losses.append((step + 1, val))
        if on_step is not None:
            on_step(step, loss, dict(lr=options.lr_at(step), grad_norm=engines[0].grad_norm,
                                     step_time=step_time, val_loss=val))
        if checkpoints is not None:
            checkpoints.after_step(engines, step + 1)
            if val is not None:
                checkpoints.after_eval(engines, step + 1, val)
    return RunResult(
        losses=losses,
        grads=canonical_names(model, _gather(engines, lambda e: e.grads.items())),
        peak_live=[max(e.peak_live for e in engines if e.pipe_rank == p) for p in range(header.mesh.pipe)],
        state_dict=_state_dict(model, engines),
        events=[ev for e in engines for ev in e.events],
        first_grads=first_grads,
        eval_losses=eval_losses,
    )


def _evaluation(plan: Plan, options: RunOptions, batches, copies, sliced, hidden_size: int,
                device: torch.device):
    """The evaluation program on engines of its own, one per (pipeline rank, replica), whose
    stages share the parameters of that rank's training copy (executors/evaluation.py)."""
    from tpc.executors.evaluation import Evaluation, check_eval_plan

    check_eval_plan(plan, dataclasses.replace(options, eval_data=options.eval_data or "--eval-data"))
    if sliced is None:
        raise TpirError(Diagnostic("evaluation needs the model's front end (`sliced`)",
                                   hint="run with the plan's model, not a stand-in stage factory"))
    view = plan.evaluation()
    hub = _Hub()
    pipe = view.header.mesh.pipe
    engines = [RankEngine(view, p, d, LocalTransport(hub, view, p, d),
                          stage_factory_from_model(sliced, copies[d * pipe + p], evaluation=True),
                          hidden_size=hidden_size, options=options, device=device)
               for d in range(view.header.mesh.data) for p in range(pipe)]
    last = view.header.stage_ranks(view.header.num_stages - 1)[0]  # replica 0's (data and weight)

    def run_batch(k: int, tokens: torch.Tensor) -> float:
        for e in engines:
            e.transport.step = k
            e.begin_step(k, tokens)
        run_cooperatively(engines)
        return [e.end_step() for e in engines][last]

    return Evaluation(batches, options.eval_every, options.steps, run_batch, device)
def interpret_bundle(plans: dict[int, Plan], length_of, options: RunOptions | None = None, *,
                     model: torch.nn.Module, batches: BatchSource, on_step=None,
                     checkpoints=None) -> RunResult:
    """Run a plan bundle's plans (`plans`: length -> verified plan, one stage split) for
    `options.steps` steps, step s running the plan of length `length_of(s)` on `batches.get(s)`
    (executors/curriculum.py). Every (pipeline rank, replica) keeps one copy of the model and
    one optimizer, which the engines of all lengths share: switching plans between steps moves
    no weight and keeps the optimizer state. Otherwise as `interpret` (`on_step`'s info also
    has the step's "seq" and "tokens")."""
    options = dataclasses.replace(options or RunOptions(), record_grads=True)
    device = options.torch_device()
    hub = _Hub()
    copies: dict[tuple[int, int], torch.nn.Module] = {}
    engines_of: dict[int, list[RankEngine]] = {}
    first: list[RankEngine] | None = None
    for seq, plan in sorted(plans.items()):
        sliced = slice_model(model, plan)
        mesh = plan.header.mesh
        engines: list[RankEngine] = []
        for d in range(mesh.data):
            for p in range(mesh.pipe):
                copy_ = copies.setdefault((p, d), copy.deepcopy(model).to(device))
                shared = first[len(engines)].optimizer if first is not None else None
                engines.append(RankEngine(plan, p, d, LocalTransport(hub, plan, p, d),
                                          stage_factory_from_model(sliced, copy_),
                                          hidden_size=sliced.hidden_size, options=options,
                                          device=device, optimizer=shared))
        engines_of[seq] = engines
        first = first or engines
    start = checkpoints.start(first) if checkpoints is not None else 0
    losses: list[float] = []
    first_grads: dict[str, torch.Tensor] = {}
    engines = first
    for step in range(start, options.steps):
        started = time.perf_counter()
        seq = length_of(step)
        engines = engines_of[seq]
        loss = _train_step(engines, step, batches.get(step))
        losses.append(loss)
        if step == start:
            first_grads = canonical_names(model, _gather(engines, lambda e: e.grads.items()))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if on_step is not None:
            on_step(step, loss, dict(lr=options.lr_at(step), grad_norm=engines[0].grad_norm,
                                     step_time=time.perf_counter() - started, seq=seq,
                                     tokens=plans[seq].header.tokens_per_step))
        if checkpoints is not None:
            checkpoints.after_step(engines, step + 1)
    mesh = first[0].header.mesh
    return RunResult(
        losses=losses,
        grads=canonical_names(model, _gather(engines, lambda e: e.grads.items())),
        peak_live=[max(e.peak_live for es in engines_of.values() for e in es if e.pipe_rank == p)
                   for p in range(mesh.pipe)],
        state_dict=_state_dict(model, engines),
        events=[ev for es in engines_of.values() for e in es for ev in e.events],
        first_grads=first_grads,
    )


def _gather(engines: list[RankEngine], items) -> dict[str, torch.Tensor]:
    """name -> tensor over replica 0's ranks; a tie is taken from the first rank holding it
    (after reduce-tied every holder has the same value)."""
    out: dict[str, torch.Tensor] = {}
    for e in engines:
        if e.data_rank == 0:
            for name, value in items(e):
                out.setdefault(name, value)
    return out


def _state_dict(model, engines: list[RankEngine]) -> dict[str, torch.Tensor]:
    """The whole model's state after training: each parameter from replica 0's rank that trains
    it, under every name the model gives it (a tie has several), and the model's buffers."""
    trained = _gather(engines, lambda e: ((n, p.detach()) for n, p in e.named_parameters))
    if model is None:
        return {n: v.clone() for n, v in trained.items()}
    whole = copy.deepcopy(model).cpu()
    by_name = dict(whole.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, value in trained.items():
            if name in by_name:
                by_name[name].copy_(value)
    return {k: v.detach().clone() for k, v in whole.state_dict().items()}


def canonical_names(model: torch.nn.Module | None, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` keyed by the model's own name of each parameter (the first name
    `named_parameters()` gives a tied parameter), whichever alias a stage used."""
    if model is None:
        return tensors
    canonical = {}
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical[name] = first.setdefault(id(p), name)
    return {canonical.get(n, n): t for n, t in tensors.items()}


def _train_step(engines: list[RankEngine], step: int, tokens: torch.Tensor) -> float:
    """One training step of every rank's stream on `tokens`, run cooperatively; the step's loss
    (a plan's run and a bundle's run take their steps alike)."""
    for e in engines:
        e.transport.step = step
        e.begin_step(step, tokens)
    run_cooperatively(engines)
    return sum(e.end_step() for e in engines)
