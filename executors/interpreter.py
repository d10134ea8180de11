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

import contextlib
import copy
import dataclasses
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from tpc.executors.training.batches import BatchSource, RandomTokens
from tpc.executors.engine import Blocked, Clock, RankEngine, RankError, TraceEvent, read_step
from tpc.executors.options import RunOptions
from tpc.executors.plan_model import StageSource, load_plan_model
from tpc.executors.random_ltd_plan import run_options
from tpc.executors.tensor_ranks import TensorRank, check_tensor_run, held_bytes
from tpc.compiler.tensor import thread_groups
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Plan
from tpc.executors.pipeline import PlanSet
from tpc.executors.training_loop import TrainingLoop
from tpc.ir.mesh import DATA, PIPE
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
    # global rank -> (parameter bytes, optimizer-state bytes) it holds after the run
    held_bytes: dict[int, tuple[int, int]] = field(default_factory=dict)


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

    def _arrive(self, key: tuple, members: list[int], me: int, offered, what: str) -> dict:
        """Record that `me` offers `offered` to the collective `key` of `members`; its pending
        entry once every member has, `Blocked` (naming the missing ranks) until then."""
        entry = self.pending.setdefault(key, {"arrived": {}, "result": None, "done": set()})
        entry["arrived"][me] = offered
        missing = [r for r in members if r not in entry["arrived"]]
        if missing:
            raise Blocked(f"{what}: waiting for rank{'s' if len(missing) > 1 else ''} "
                          f"{', '.join(map(str, missing))}", ranks=missing)
        return entry

    def collective(self, key: tuple, members: list[int], me: int, tensors: list[torch.Tensor],
                   what: str) -> None:
        """Sum `tensors` over `members` (global ranks) in place; `Blocked` until all arrived.
        Arriving twice is harmless: a blocked rank re-offers the same tensors on retry."""
        if len(members) == 1:
            return
        entry = self._arrive(key, members, me, tensors, what)
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


    def gather(self, key: tuple, members: list[int], me: int, tensor: torch.Tensor, what: str,
               combine) -> torch.Tensor | None:
        """`combine(members' tensors, in member order)`, computed once all arrived (before any
        of them changes its tensor); `Blocked` until then; None for a group of one."""
        if len(members) == 1:
            return None
        entry = self._arrive(key, members, me, tensor, what)
        if entry["result"] is None:
            shapes = {tuple(entry["arrived"][r].shape) for r in members}
            if len(shapes) != 1:
                raise TpirError(Diagnostic(f"{what}: ranks offer buffers of different sizes",
                                           hint="replicas of a rank must hold the same stages"))
            entry["result"] = combine([entry["arrived"][r] for r in members])
        result = entry["result"]
        entry["done"].add(me)
        if len(entry["done"]) == len(members):
            del self.pending[key]
        return result


def _ordered_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum in member order, so every run adds in the same order."""
    total = tensors[0].clone()
    for t in tensors[1:]:
        total += t
    return total


class LocalTransport:
    """One rank's end of the in-memory network."""

    def __init__(self, hub: _Hub, plan: Plan, pipe_rank: int, data_rank: int,
                 rendezvous: bool = False, tensor_rank: int = 0):
        """`rendezvous`: NCCL's rules (the module docstring), else gloo's buffered sends.
        `tensor_rank`: the rank's tensor coordinate; its peers and groups are the ranks at the
        same one (each tensor coordinate has a hub of its own)."""
        self.hub, self.header = hub, plan.header
        self.mesh = plan.header.mesh.value
        self.pipe_rank, self.data_rank, self.tensor_rank = pipe_rank, data_rank, tensor_rank
        self.me = self.mesh.rank(pipe=pipe_rank, data=data_rank, tensor=tensor_rank)
        # the groups this rank's collectives sum over, once
        self.peers = tuple(self.mesh.rank(pipe=p, data=data_rank, tensor=tensor_rank) for p in range(self.mesh.pipe))
        self.data_group = self.mesh.group(DATA, self.me)
        self.pipeline = self.mesh.group(PIPE, self.me)
        self.step = 0
        self.rendezvous = rendezvous
        self.counts: dict[tuple[str, int], int] = {}  # (collective, stage) -> how many this step
        self.unreceived: list[tuple[Message, int, tuple[int, int], int]] = []  # sends not yet taken
        self.exchange_end = 0  # the instruction after the members of the current exchange

    def _global(self, pipe_rank: int) -> int:
        return self.peers[pipe_rank]

    def start_step(self, step: int) -> None:
        self.step = step
        self.counts = {}

    def claim(self, key: Message) -> None:
        pass  # a received value is here as soon as its receive returned

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
        members = self.data_group
        self.hub.collective(self._occurrence(("allreduce", stage, self.pipe_rank)), members, self.me,
                            tensors, f"allreduce stage {stage}")

    def reduce_tied(self, name: str, tensor: torch.Tensor) -> None:
        members = self.mesh.select(self.header.tie_ranks(name), data=self.data_rank, tensor=self.tensor_rank)
        self.hub.collective(self._occurrence(("tie", name, self.data_rank)), members, self.me,
                            [tensor], f"reduce-tied {name!r}")

    def reduce_replicas(self, stage: int, tensors: list[torch.Tensor]) -> None:
        members = self.mesh.select(self.header.stage_ranks(stage), data=self.data_rank, tensor=self.tensor_rank)
        self.hub.collective(self._occurrence(("replicas", stage, self.data_rank)), members, self.me,
                            tensors, f"reduce-replicas stage {stage}")

    def reduce_loss(self, tensor: torch.Tensor) -> None:
        members = self.data_group
        self.hub.collective(self._occurrence(("reduce-loss", self.pipe_rank)), members, self.me,
                            [tensor], "reduce-loss")

    def _nth(self, kind: str, stage: int, flat: torch.Tensor, what: str, combine) -> torch.Tensor | None:
        """This rank's n-th `kind` collective of `stage` in this step (a sharded optimizer
        gathers twice in a step when the run keeps its gradients): counted once it completed,
        so a blocked rank's retry is the same occurrence."""
        n = self.counts.get((kind, stage), 0)
        key = self._occurrence((kind, stage, self.pipe_rank, n))
        out = self.hub.gather(key, self.data_group, self.me, flat, what, combine)
        self.counts[(kind, stage)] = n + 1
        return out

    def reduce_scatter(self, stage: int, flat: torch.Tensor) -> None:
        """Chunk `data_rank` of `flat` becomes the sum of every replica's chunk (in member
        order); the other chunks are left as they were: nothing may read them."""
        d = self.mesh.data
        sums = self._nth("reduce-scatter", stage, flat, f"allreduce stage {stage} (reduce-scatter)",
                         _ordered_sum)
        if sums is not None:
            flat.chunk(d)[self.data_rank].copy_(sums.chunk(d)[self.data_rank])

    def all_gather(self, stage: int, flat: torch.Tensor) -> None:
        """Chunk r of `flat` becomes data rank r's chunk r."""
        d = self.mesh.data
        whole = self._nth("all-gather", stage, flat, f"step (all-gather of stage {stage}'s weights)",
                          lambda flats: torch.cat([f.chunk(d)[r] for r, f in enumerate(flats)]))
        if whole is not None:
            flat.copy_(whole)

    def sum_over_data(self, tensor: torch.Tensor) -> torch.Tensor:
        self.hub.collective(self._occurrence(("data-sum", self.pipe_rank)), self.data_group, self.me,
                            [tensor], "the global gradient norm (over the data-parallel replicas)")
        return tensor

    def flush(self) -> None:
        pass  # in-memory sends complete at once

    def sum_over_pipeline(self, tensor: torch.Tensor) -> torch.Tensor:
        members = self.pipeline
        self.hub.collective(self._occurrence(("pipeline-sum", self.data_rank)), members, self.me,
                            [tensor], "the global gradient norm")
        return tensor


def run_tensor_threads(engines: list[RankEngine], groups: list) -> None:
    """Run the engines of each tensor coordinate cooperatively on a thread of their own (their
    stages' collectives meet at `groups[t]`); the first failure is raised, after the group is
    broken so that the other threads stop waiting for the failed one."""
    by_t: dict[int, list[RankEngine]] = {}
    for e in engines:
        by_t.setdefault(e.tensor_rank, []).append(e)
    _on_threads(sorted(by_t), lambda t: run_cooperatively(by_t[t]), groups)


def _on_threads(coordinates, work, groups: list) -> None:
    """`work(t)` for each tensor coordinate t on a thread of its own; the first failure is
    raised, after `groups[t]` is broken so that the other threads stop waiting for the failed
    one."""
    failures: dict[int, BaseException] = {}

    def run(t: int) -> None:
        try:
            work(t)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            failures[t] = e
            groups[t].abort()

    threads = [threading.Thread(target=run, args=(t,), name=f"tpc-tensor-{t}") for t in coordinates]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if failures:
        # the failure that broke the group, not a thread's broken wait that followed it
        first = [e for e in failures.values() if not _broken_wait(e)] or list(failures.values())
        raise first[0]


def _broken_wait(e: BaseException) -> bool:
    while e is not None:
        if isinstance(e, threading.BrokenBarrierError):
            return True
        e = e.__cause__ or e.__context__
    return False


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


class Interpreted:
    """The interpreter as the training loop's executor (executors/training_loop.py): every
    (pipeline rank, replica) of a plan in this process, cooperatively. Each of them trains its
    own copy of the model, as separate processes would, and the plans of a set share those
    copies (and, through `shared`, the optimizers): switching plans moves no weight.

    `stages` (a StageSource) says where a plan's stages come from (the front end's sliced
    model, or a stand-in in tests)."""

    every_rank = True  # (pipeline.Executor)

    def __init__(self, options: RunOptions, device: torch.device, model: torch.nn.Module | None,
                 stages: StageSource, rendezvous: bool, mesh=None):
        """`mesh`: the plans' mesh line; with a tensor axis of T ranks, the ranks of each tensor
        coordinate run on a thread of their own (their stages' collectives meet the other
        threads' at a `ThreadGroup`), over a network of their own: a message or a data-parallel
        sum never crosses tensor coordinates."""
        self.options, self.device, self.model, self.stages = options, device, model, stages
        self.rendezvous = rendezvous
        # the training plans' networks, one per tensor coordinate: the channels' counts run on
        # across plans
        self.mesh = mesh
        tensor = mesh.tensor if mesh is not None else 1
        self.hubs = [_Hub() for _ in range(tensor)]
        self.copies: dict[int, torch.nn.Module | None] = {}  # global rank -> its model copy
        self.clock = Clock()
        self.tensor_ranks: dict[int, TensorRank | None] = {}  # global rank -> its TensorRank
        # one group for every stage: each thread runs the same instructions in the same order,
        # so its collectives meet the other threads' in order
        self.groups = thread_groups(tensor) if tensor > 1 else None

    def _tensor_rank(self, rank: int, t: int) -> TensorRank | None:
        if rank not in self.tensor_ranks:
            self.tensor_ranks[rank] = TensorRank.of(self.mesh, t, self.groups[t]) if self.groups else None
        return self.tensor_ranks[rank]

    def _copy(self, rank: int) -> torch.nn.Module | None:
        if rank not in self.copies:
            self.copies[rank] = copy.deepcopy(self.model).to(self.device) if self.model is not None else None
        return self.copies[rank]

    def _engines(self, plan: Plan, hubs: list[_Hub], *, evaluation: bool, rendezvous: bool,
                 shared: "InterpretedRanks | None" = None) -> list[RankEngine]:
        mesh = plan.header.mesh.value

        def engine(r: int) -> RankEngine:
            p, d, t = mesh.pipe_rank(r), mesh.data_rank(r), mesh.tensor_rank(r)
            tensor = self._tensor_rank(r, t)
            return RankEngine(
                plan, p, d, LocalTransport(hubs[t], plan, p, d, rendezvous, tensor_rank=t),
                self.stages.stages(plan, self._copy(r), evaluation, self.options, tensor=tensor),
                hidden_size=self.stages.hidden_size(plan), options=self.options, device=self.device,
                clock=self.clock, optimizer=shared.engines[r].optimizer if shared is not None else None,
                tensor=tensor)

        if mesh.tensor == 1:
            return [engine(r) for r in mesh.ranks()]
        # each tensor coordinate's engines on a thread of its own: building one may run its
        # stages' programs (--compile prepares them before step 1), whose collectives meet the
        # other coordinates' at the same stage
        built: dict[int, RankEngine] = {}

        def coordinate(t: int) -> None:
            for r in mesh.ranks():
                if mesh.tensor_rank(r) == t:
                    built[r] = engine(r)

        _on_threads(range(mesh.tensor), coordinate, self.groups)
        return [built[r] for r in mesh.ranks()]

    def build(self, plan: Plan, shared: "InterpretedRanks | None") -> "InterpretedRanks":
        engines = self._engines(plan, self.hubs, evaluation=False, rendezvous=self.rendezvous, shared=shared)
        return InterpretedRanks(plan, engines, self.model, self.device, groups=self.groups)

    def build_eval(self, plan: Plan, training: "InterpretedRanks") -> "InterpretedRanks":
        view = plan.evaluation()
        # replica 0's (data and weight) last-stage rank holds the loss
        last = view.header.mesh.value.rank(pipe=view.header.stage_ranks(view.header.num_stages - 1)[0])
        engines = self._engines(view, [_Hub() for _ in self.hubs], evaluation=True, rendezvous=False)
        return InterpretedRanks(view, engines, self.model, self.device, loss_rank=last, groups=self.groups)

    def waiting(self, what: str):
        return contextlib.nullcontext()  # a blocked rank here raises Blocked; nothing waits

    def start(self) -> None:
        self.clock.start()

    def about_to_step(self, ranks) -> None:
        pass  # no watchdog: a stuck plan is a deadlock `run_cooperatively` reports

    def close(self) -> None:
        pass  # no thread or process group of its own to let go of


class InterpretedRanks:
    """Every rank of one plan, run cooperatively in this process."""

    def __init__(self, plan: Plan, engines: list[RankEngine], model, device: torch.device,
                 loss_rank: int | None = None, groups: list | None = None):
        """`groups`: with a tensor axis, the `ThreadGroup` of each tensor coordinate, whose
        ranks run on a thread each."""
        self.plan, self.engines, self.model, self.device = plan, engines, model, device
        self.loss_rank = loss_rank
        self.groups = groups

    def _run(self, step: int, tokens: torch.Tensor) -> list:
        """Every engine's stream once; their losses, on the device (not read)."""
        for e in self.engines:
            e.begin_step(step, tokens)
        if self.groups is None:
            run_cooperatively(self.engines)
        else:
            run_tensor_threads(self.engines, self.groups)
        return [e.end_step() for e in self.engines]

    def step(self, step: int, tokens: torch.Tensor) -> float:
        # the step's one read: every rank's loss and gradient norm in one transfer, queued after
        # the optimizer's kernels, so the step is done on the device when it returns; the T
        # ranks of a tensor group compute the same loss: tensor rank 0's counts
        losses = [loss if e.tensor_rank == 0 else 0.0 for e, loss in zip(self.engines, self._run(step, tokens))]
        return sum(read_step(losses, self.engines))

    def evaluate(self, k: int, tokens: torch.Tensor) -> torch.Tensor | float:
        """The loss of batch `k`, on the device: the evaluation reads its batches' losses once."""
        return self._run(k, tokens)[self.loss_rank]

    def gradients(self) -> dict[str, torch.Tensor]:
        return canonical_names(self.model, _gather(self.engines, lambda e: e.grads.items()))

    def weights(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters by name (replica 0's; a tensor axis's parts joined)."""
        return canonical_names(self.model, _gather(self.engines, lambda e: ((n, p.detach()) for n, p in e.named_parameters)))


def interpret(plan: "Plan | PlanSet", options: RunOptions | None = None, *,
              model: torch.nn.Module | None = None, sliced=None, stage_factory_for=None,
              hidden_size: int | None = None, batches: BatchSource | None = None, on_step=None,
              checkpoints=None, verify: bool = True, keep_grads: bool = True, eval_batches=None,
              on_eval=None) -> RunResult:
    """Run `plan` (one plan, or a `PlanSet`: a bundle's plans and the length each step runs) for
    `options.steps` training steps with every rank in this process, by the one training loop
    (executors/training_loop.py).

    How to train is `options` (tpc.executors.options.RunOptions; the interpreter keeps the
    gradients unless `keep_grads=False`: `RunResult.grads` and `first_grads`). The model comes
    from the plan's model file (built after `torch.manual_seed(options.seed)`) unless `model` is
    given; `sliced` is its `SlicedModel` (or a mapping length -> SlicedModel for a set; built here
    when not given). Each (pipeline rank, replica) trains its own copy of the model, as separate
    processes would. `stage_factory_for(model_copy) -> StageFactory` replaces the front end
    (tests use a fake one, with `hidden_size`). `batches` default to random tokens from
    `options.seed`.
    `on_step(step, loss, info)` is called after every step; info has the step's "lr",
    "grad_norm" (when `options.needs_grad_norm`, else None), "step_time" in seconds and
    "val_loss" (None unless evaluated then); under a curriculum also "seq" and "tokens".
    `checkpoints` (`tpc.executors.training.run_checkpoints.RunCheckpoints`) first loads what
    the run starts from (the newest checkpoint when resuming: the run then goes from its step
    up to `options.steps`, and `losses` holds only the steps run here; or --init-from weights)
    and saves all ranks' state when due.
    `verify=False` skips the verifier (to study a broken plan). `keep_grads=False` keeps no
    copy of the gradients (benchmarks time steps without that copy). On CUDA each step's time
    is taken after the device has finished the step (the step's one read waits for it).
    `eval_batches` (`tpc.executors.training.eval_data.EvalBatches`: get(k), count) runs the
    (longest) plan's evaluation program (executors/evaluation.py) before the first step (of a
    run from step 0), after every `options.eval_every` steps and after the last; `on_eval(done,
    loss)` is called for the one before the first step; all are in `RunResult.eval_losses`.
    """
    options = options or RunOptions()
    plans = plan if isinstance(plan, PlanSet) else PlanSet.single(plan)
    options = run_options(plans, options)  # the plan's random-LTD, if it records one
    device = options.torch_device()
    rules = options.comm_rules(device, interpreted=True)
    if verify:
        for p in plans.plans.values():
            check(p, rules)
    full = plans.full
    if model is None and stage_factory_for is None:
        model = load_plan_model(full, options.seed)
    stages = StageSource.of(plans, model, sliced=sliced, factory_for=stage_factory_for, hidden_size=hidden_size)
    shape = full.header.shape
    batches = batches or RandomTokens(options.seed, shape.batch, shape.seq, shape.vocab)
    if keep_grads:
        options = dataclasses.replace(options, record_grads=True)
    check_tensor_run(full, options, "the interpreter")
    executor = Interpreted(options, device, model, stages, rules == NCCL, mesh=full.header.mesh)
    loop = TrainingLoop(plans, executor, options, batches=batches, eval_batches=eval_batches,
                        checkpoints=checkpoints, on_step=on_step, on_eval=on_eval)
    out = loop.run()
    engines = out.last.engines
    mesh = full.header.mesh.value
    every = out.engines
    return RunResult(
        losses=out.losses,
        grads=out.last.gradients(),
        peak_live=[max(e.peak_live for e in every if e.pipe_rank == p) for p in range(mesh.pipe)],
        state_dict=_state_dict(model, engines),
        events=[ev for e in every for ev in e.events],
        first_grads=out.first_grads,
        eval_losses=out.eval_losses,
        held_bytes={e.global_rank: held_bytes(e) for e in engines},
    )


def _gather(engines: list[RankEngine], items) -> dict[str, torch.Tensor]:
    """name -> tensor over replica 0's ranks; a tie is taken from the first rank holding it
    (after reduce-tied every holder has the same value); a parameter cut over a tensor axis is
    put together from every tensor rank's part (tpc.compiler.tensor.ParamShard.join)."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, tuple]] = {}  # a split parameter -> tensor rank -> (shard, part)
    for e in engines:
        if e.data_rank == 0:
            for name, value in items(e):
                shard = e.tensor.split(name) if e.tensor is not None else None
                if shard is None:
                    out.setdefault(name, value)
                else:
                    parts.setdefault(name, {}).setdefault(e.tensor_rank, (shard, value))
    for name, by_rank in parts.items():
        shard = by_rank[0][0]
        out[name] = shard.join([by_rank[t][1] for t in range(shard.degree)])
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
