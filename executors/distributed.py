"""The distributed executor: one process per rank under torchrun (gloo on CPU, NCCL on CUDA).

Every process reads the plan (or the plan bundle) and the model file itself and refuses to
start, before any communication, when the world does not match the plan's mesh or the model
file is not the one the plan was compiled from (all ranks see the same files, so all refuse
alike).

The parts: `executors/world.py` (this process's place, the process groups the mesh implies,
joining them), `executors/dist_transport.py` (point-to-point and collectives under the
backend's rules), and here the executor the one training loop drives
(executors/training_loop.py), the watchdog, and the entry point of `tpc run` under torchrun.

Faults: a rank whose instruction fails prints its located error and leaves with status 1 at
once (os._exit: no teardown that could wait for peers). A rank waiting for a peer gives up after
--timeout seconds, or as soon as gloo reports the peer's connection closed, and says which rank,
step and instruction it was blocked on; a watchdog thread backs this up for any wait that does
not honour the timeout, and on NCCL (whose waits do not block the host) watches every work
handle until it completes. So no run hangs.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tpc.executors.dist_transport import Channels, DistTransport, Wire, peer_gone
from tpc.executors.engine import DTYPES, Clock, RankEngine, RankError, loss_vector, read_step
from tpc.executors.options import RunOptions
from tpc.compiler.frontend.weightless import move_real
from tpc.executors.plan_model import StageSource, load_rank_model, rank_parameter_names, slice_model
from tpc.executors.random_ltd_plan import run_options
from tpc.executors.run import CurriculumFlags, RunSetup, write_trace
from tpc.executors.tensor_ranks import TensorRank
from tpc.compiler.tensor import DistGroup
from tpc.executors.training.dir_lock import release_held
from tpc.executors.pipeline import PlanSet
from tpc.executors.training_loop import TrainingLoop
from tpc.executors.world import World, backend_cause, check_world, init, make_groups, report_layout
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Plan

__all__ = ["World", "init", "fail", "run_plan", "main", "RankOutcome", "Distributed"]


# ------------------------------------------------------------------------------ the watchdog


class Watchdog(threading.Thread):
    """Ends the process when its rank has waited on one message or collective far longer than
    --timeout: the backstop for a wait the backend does not time out itself."""

    def __init__(self, executor: "Distributed", timeout: float):
        super().__init__(daemon=True, name="tpc-watchdog")
        self.executor = executor  # its `current` ranks are the ones watched
        self.limit = timeout * 1.5 + 5.0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(min(1.0, self.limit / 10)):
            current = self.executor.current
            what = current.transport.overdue(self.limit)
            if what is not None:
                e = current.engine
                where = e.where(e.pc) if not e.done else f"rank {e.rank_name}, end of the stream"
                fail(f"{where} (step {e.step}): no progress for {self.limit:.0f} s waiting for {what}",
                     hint="a peer failed or is stuck: see its own error; if it is merely slow, raise --timeout")


def fail(message: str | TpirError, hint: str = "") -> None:
    """Print the error and leave at once with status 1 (no teardown that might wait on peers)."""
    text = message.render() if isinstance(message, TpirError) else TpirError(Diagnostic(message, hint=hint)).render()
    try:
        release_held()  # os._exit runs no `finally`: the checkpoint folder's lock goes first
        sys.stdout.flush()
        print(text, file=sys.stderr, flush=True)
    finally:
        os._exit(1)


# --------------------------------------------------------------------------------- running


@dataclass
class RankOutcome:
    """What one rank's run produced: losses per step (the global loss, the same on every rank),
    the gradients of the first step before its update (this rank's parameters, by name), the
    rank's parameters after the last step, and its trace events."""

    losses: list[float]
    first_grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    peak_live: int
    events: list
    # (completed steps, validation loss) of each evaluation, the same on every rank
    eval_losses: list = field(default_factory=list)
    # with a tensor axis: how each parameter is cut (name -> ParamShard) and this rank's part
    shards: dict = field(default_factory=dict)
    tensor_rank: int = 0


class DistRanks:
    """This process's rank of one plan: its engine and transport."""

    def __init__(self, plan: Plan, engine: RankEngine, transport: DistTransport, device: torch.device,
                 loss_rank: int | None = None):
        self.plan, self.engine, self.transport, self.device = plan, engine, transport, device
        self.engines = [engine]
        self.loss_rank = loss_rank  # evaluation: the global rank whose loss is broadcast

    def step(self, step: int, tokens: torch.Tensor) -> float:
        """One training step; the step's loss, summed over all ranks. The sum stays on the
        device until the step's one read, with the gradient norm."""
        try:
            loss = self.engine.run_step(step, tokens)
            # the T ranks of a tensor group compute the same loss: tensor rank 0's counts
            total = loss_vector(loss if self.engine.tensor_rank == 0 else 0.0, self.device)
            with self.transport.waiting("the loss of the other ranks"):
                dist.all_reduce(total)
        except RankError:
            raise  # located at its instruction already
        except Exception as e:  # noqa: BLE001 - after the stream's last instruction: say where
            raise self.after_stream(e, "the step's loss summed over the ranks") from None
        return read_step([total], [self.engine])[0]

    def after_stream(self, e: Exception, what: str) -> RankError:
        """`e`, raised once this rank's stream has run (its sends flushed, the loss summed over
        the ranks), located at the stream's last instruction and said in words (a peer that
        died, not gloo's bare "Connection reset by peer")."""
        engine = self.engine
        last = len(engine.instrs) - 1
        if isinstance(e, TpirError):
            cause, hint = "; ".join(d.message for d in e.diagnostics), e.diagnostics[0].hint if e.diagnostics else ""
        else:
            cause, hint = backend_cause(e), ""
            if peer_gone(cause):
                cause = f"a peer rank died while this rank waited for {what} (its connection closed: {cause})"
                hint = ("the rank that ended first says why in its own error, or torchrun in its exit status "
                        "(-9: killed, e.g. out of memory)")
            else:
                cause = f"waiting for {what}: {type(e).__name__}: {cause}"
        return RankError(Diagnostic(
            f"{engine.where(last)}: after the last instruction of rank {engine.rank_name}'s stream "
            f"(step {engine.step}): {cause}", loc=engine.instrs[last].loc if last >= 0 else None,
            where=self.plan.source, hint=hint or "a peer failed or is stuck: see its own error"))

    def evaluate(self, k: int, tokens: torch.Tensor) -> torch.Tensor:
        """The evaluation program on batch `tokens`; the loss is broadcast from the last stage's
        rank of replica 0 (after `reduce-loss` it holds the sum over the replicas). On the
        device: the evaluation reads its batches' losses once."""
        own = self.engine.run_step(k, tokens)
        mine = self.engine.global_rank == self.loss_rank
        loss = loss_vector(own if mine else 0.0, self.device)
        work = dist.broadcast(loss, src=self.loss_rank, async_op=True)
        self.transport.wait(work, f"the evaluation loss from rank {self.loss_rank}")
        return loss[0]

    def gradients(self) -> dict[str, torch.Tensor]:
        return dict(self.engine.grads)

    def weights(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by name (with a tensor axis, its parts)."""
        return {n: p.detach() for n, p in self.engine.named_parameters}


class Distributed:
    """The distributed executor as the training loop's executor: this process's rank of each
    plan, over one set of process groups (the plans of a set share mesh and ties), one model
    and one optimizer; each plan has its own engine and transport, which share the channels'
    message counts, so switching plans between steps needs no communication.

    `stages` (a StageSource) says where a plan's stages come from. `before_instr(engine,
    index)` runs before each instruction (tests inject faults with it)."""

    every_rank = False  # (pipeline.Executor)

    def __init__(self, world: World, options: RunOptions, device: torch.device, plans: PlanSet, *,
                 stages: StageSource, model: torch.nn.Module | None = None, before_instr=None):
        self.world, self.options, self.device = world, options, device
        self.stages, self.model = stages, model
        self.before_instr = before_instr
        # the pipeline group sums the global gradient norm: of the step, or of a library user's
        # clip_grad_norm_
        self.groups = make_groups(plans.full, world, options.timeout,
                                  pipeline=options.needs_grad_norm or options.external_optimizer)
        self.wire = Wire.of(dist.get_backend(), options.comm_rules(device))
        self.dtype = DTYPES[plans.full.header.shape.dtype]  # the plan was verified: a known name
        self.channels = Channels()
        self.clock = Clock()
        self.current: DistRanks | None = None  # what the watchdog watches
        self.watchdog: Watchdog | None = None
        # the library joined the process group for this executor: `close` leaves it (`tpc run`
        # leaves it itself, after the run's last barrier)
        self.leave_group = False
        mesh = plans.full.header.mesh
        # this rank's TensorRank on a mesh with a tensor axis
        self.tensor = TensorRank.of(mesh, mesh.value.tensor_rank(world.rank),
                                    DistGroup(self.groups.tensor) if mesh.tensor > 1 else None)

    def _ranks(self, plan: Plan, *, evaluation: bool, channels: Channels, optimizer=None,
               loss_rank: int | None = None) -> DistRanks:
        mesh = plan.header.mesh.value
        hidden = self.stages.hidden_size(plan)
        transport = DistTransport(plan, self.world.rank, self.groups, wire=self.wire, device=self.device,
                                  hidden_size=hidden, dtype=self.dtype, timeout=self.options.timeout,
                                  channels=channels)
        engine = RankEngine(plan, mesh.pipe_rank(self.world.rank), mesh.data_rank(self.world.rank), transport,
                            self.stages.stages(plan, self.model, evaluation, self.options, tensor=self.tensor),
                            hidden_size=hidden, options=self.options, device=self.device,
                            before_instr=None if evaluation else self.before_instr,
                            optimizer=optimizer, clock=self.clock, tensor=self.tensor)
        return DistRanks(plan, engine, transport, self.device, loss_rank)

    def build(self, plan: Plan, shared: DistRanks | None) -> DistRanks:
        ranks = self._ranks(plan, evaluation=False, channels=self.channels,
                            optimizer=shared.engine.optimizer if shared is not None else None)
        if self.current is None:
            self.current = ranks
            self.watchdog = Watchdog(self, self.options.timeout)
            self.watchdog.start()
        return ranks

    def build_eval(self, plan: Plan, training: DistRanks) -> DistRanks:
        view = plan.evaluation()
        h = view.header
        # the evaluation's loss is on data replica 0 and weight replica 0
        src = h.mesh.value.rank(pipe=h.stage_ranks(h.num_stages - 1)[0])
        return self._ranks(view, evaluation=True, channels=Channels(), loss_rank=src)

    def waiting(self, what: str):
        return self.current.transport.waiting(what)

    def start(self) -> None:
        # a collective of every rank before any send or receive: NCCL wants the first use of a
        # group by batch_isend_irecv (an exchange) preceded by one involving all its ranks
        dist.barrier()
        self.clock.start()  # trace times count from a common start

    def about_to_step(self, ranks: DistRanks) -> None:
        self.current = ranks

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop.set()
        if self.leave_group and dist.is_initialized():
            # every rank done before any leaves: a rank exiting with the group alive while a
            # peer still talks to it aborted at exit ("terminate called without an active exception")
            dist.barrier()
            dist.destroy_process_group()
            self.leave_group = False


def run_plan(plan: "Plan | PlanSet", world: World, options: RunOptions, *, model: torch.nn.Module,
             device: torch.device, sliced=None, stage_factory=None, hidden_size: int | None = None,
             batches, on_step=None, checkpoints=None, before_instr=None, eval_batches=None,
             on_eval=None) -> RankOutcome:
    """Run this rank's stream of `plan` (one plan, or a `PlanSet`: a bundle's plans and the length
    each step runs) up to step `options.steps` in an initialised process group, by the one
    training loop (executors/training_loop.py): from step 0 (from --init-from weights, when
    `checkpoints` has them), or, when `checkpoints` resumes, from the newest checkpoint's step.
    Every rank saves its own parameters when a checkpoint is due. A failure of this rank's
    instruction raises (located); the caller decides how to leave. `sliced`: the front end's
    sliced model (or a mapping length -> sliced model; traced here when not given);
    `stage_factory` with `hidden_size` replaces the front end (tests)."""
    plans = plan if isinstance(plan, PlanSet) else PlanSet.single(plan)
    options = run_options(plans, options)  # the plan's random-LTD, if it records one
    stages = StageSource.of(plans, model, sliced=sliced, hidden_size=hidden_size,
                            factory_for=None if stage_factory is None else (lambda _copy: stage_factory))
    executor = Distributed(world, options, device, plans, stages=stages, model=model, before_instr=before_instr)
    out = TrainingLoop(plans, executor, options, batches=batches, eval_batches=eval_batches,
                       checkpoints=checkpoints, on_step=on_step, on_eval=on_eval).run()
    engine = out.last.engine
    return RankOutcome(out.losses, out.first_grads,
                       {n: p.detach().cpu() for n, p in engine.named_parameters},  # no copy on the CPU: the run is over
                       max(e.peak_live for e in out.engines), [ev for e in out.engines for ev in e.events],
                       out.eval_losses, shards=dict(executor.tensor.shards) if executor.tensor else {},
                       tensor_rank=engine.tensor_rank)


def main(path: str, options: RunOptions, world: World, curriculum: CurriculumFlags | None = None) -> int:
    """`tpc run PLAN` (or `tpc run PLANS --curriculum SPEC`) under torchrun: this process runs
    rank `world.rank` (World.from_env()). Returns the exit status (the same on every rank); a
    failure ends the process with status 1 (see `fail`)."""
    torch.set_num_threads(1)
    # every rank checks the same files: all refuse alike, before any communication; the plan
    # under the rules of the backend it will run on
    device = options.torch_device(world.local_rank)
    setup = RunSetup.load(path, options, device, curriculum=curriculum, interpreted=False)
    options = setup.options  # with the plan's random-LTD
    check_world(setup.plans.full, world)
    sliced = {seq: slice_model(setup.model, p) for seq, p in setup.plans.plans.items()}  # traced on the CPU
    # this rank builds only the parameters its stages hold (the seed's values: weightless.py)
    mesh = setup.plans.full.header.mesh.value
    names = rank_parameter_names(setup.plans, sliced, mesh.pipe_rank(world.rank))
    model = move_real(load_rank_model(setup.plans.full, options.seed, names), device)
    try:
        init(world, device, options.timeout)
    except Exception as e:  # noqa: BLE001 - whatever the rendezvous raises, say what it means
        fail(f"rank {world.rank}: could not join the other {world.size - 1} rank(s) within "
             f"{options.timeout:g} s: {backend_cause(e)}",
             hint="every rank must start (torchrun --nproc-per-node N, and --nnodes K on each of K "
                  "machines) and reach MASTER_ADDR:MASTER_PORT")
    show = setup.reporter(world.rank)
    report_layout(setup.plans.full, world, show.message)
    checkpoints = setup.checkpoints(show.message)
    try:
        outcome = run_plan(setup.plans, world, options, model=model, device=device, sliced=sliced,
                           batches=setup.batches, on_step=show, checkpoints=checkpoints,
                           eval_batches=setup.validation, on_eval=show.evaluation)
        show.close()
    except TpirError as e:
        fail(e)
    except Exception as e:  # noqa: BLE001 - outside an instruction (setup): still report and leave
        _fail_outside(world, e, "the run (outside any instruction of the plan)")
    status = 0
    try:
        if options.trace_path:
            gathered = [None] * world.size if world.rank == 0 else None
            dist.gather_object(outcome.events, gathered, dst=0)
            if world.rank == 0:
                write_trace(options.trace_path, [ev for evs in gathered for ev in evs])
        if setup.gradient_check is not None:
            status = _check_gradients(world, outcome, setup.gradient_check, setup.batches)
        dist.barrier()
    except TpirError as e:
        fail(e)
    except Exception as e:  # noqa: BLE001 - after the last step: the trace, the check, the last barrier
        _fail_outside(world, e, "the end of the run (the trace, the gradient check, the last barrier)")
    dist.destroy_process_group()
    return status


def _fail_outside(world: World, e: Exception, during: str) -> None:
    """Leave with what `e`, raised outside the plan's instructions, means: a peer that died is
    said so (gloo says only "Connection reset by peer")."""
    cause = backend_cause(e)
    if peer_gone(cause):
        fail(f"rank {world.rank}: a peer rank died during {during} (its connection closed: {cause})",
             hint="the rank that ended first says why in its own error, or torchrun in its exit status "
                  "(-9: killed, e.g. out of memory)")
    fail(f"rank {world.rank}: during {during}: {type(e).__name__}: {e}")


def _check_gradients(world: World, outcome: RankOutcome, check, batches) -> int:
    """Every rank compares its own parameters' first-step gradients with plain autograd; the
    worst error over all ranks decides, the same on every rank; rank 0 prints it."""
    worst, name, held = check.compare_part(outcome.first_grads, batches.get(0), outcome.shards, outcome.tensor_rank)
    everyone = [None] * world.size
    dist.all_gather_object(everyone, (worst, name, sorted(held)))
    return check.conclude(outcome.losses[0], everyone, show=world.rank == 0)
