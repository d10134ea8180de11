"""The per-rank instruction engine: one dispatch per opcode over one rank's stream.

Both executors run a rank the same way; they differ only in the `Transport` that carries
messages and sums gradients (in-memory channels in the interpreter, torch.distributed under
torchrun). The engine follows the torch.fx Interpreter pattern:

- an environment of tensors keyed by `Message` (tpc.ir.semantics: payload, stage boundary,
  micro-batch, slice), the name a value has on both sides of a boundary: a compute stores its
  output activation or input gradient under it, and the consumer (the next stage on this rank,
  or a send) pops it; a receive stores the same name. Every value is popped by its one use:
  freed after last use;
- one handler per `Op`;
- any error raised by an instruction is re-raised as a located `TpirError`
  "rank r, line n: <instruction>: <cause>".

Shapes of everything a rank receives follow from the header (micro-batch rows, slice length,
hidden size), so receives are posted with known shapes and there is no shape handshake.

A transport may raise `Blocked` from a receive or collective whose partner has not arrived yet,
before it changes any state; the engine then leaves its program counter where it is, so a
cooperative scheduler (the interpreter) can run other ranks and retry.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

import torch

from tpc.compiler.lowering.lower import paired
from tpc.executors.training.batches import Batch, microbatch
from tpc.executors.training.documents import document_starts, mask_crossing_targets
from tpc.executors.options import RunOptions
from tpc.executors.training.optimizer import RankOptimizer
from tpc.executors.training.param_groups import unique_parameters
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Instr, Op, Payload, Plan, Stage
from tpc.ir.semantics import Message, input_message, message, message_shape, output_message
from tpc.ir.verify import DTYPES as PLAN_DTYPES

# the parameter dtypes a plan may name (the verifier's list), as torch dtypes
DTYPES = {name: getattr(torch, name) for name in PLAN_DTYPES}


class RankError(TpirError):
    """An error already located at a rank of the plan (and usually its instruction): the engine
    raises it as it is, never wrapped in a second location."""


class Blocked(Exception):
    """A receive or collective cannot complete yet; nothing was changed. `waiting_for` says on
    what, and `ranks` on which (global) ranks, for a deadlock report."""

    def __init__(self, waiting_for: str, ranks: tuple[int, ...] = ()):
        super().__init__(waiting_for)
        self.waiting_for = waiting_for
        self.ranks = tuple(ranks)


class Transport(Protocol):
    """Everything the engine asks of the wire; the engine calls nothing else. Ranks are pipeline
    ranks of the caller's replica; `index` is the instruction's position in the rank's stream."""

    def start_step(self, step: int) -> None:
        """A new pass over the stream begins (step `step`)."""
        ...

    def before_instruction(self, index: int) -> None:
        """About to run instruction `index` (gloo: post the receives due; NCCL's rules emulated:
        wait until the last sends were taken). May raise `Blocked`."""
        ...

    def claim(self, key: Message) -> None:
        """The engine is about to use the received value `key` (a wait deferred to its use)."""
        ...

    def send(self, key: Message, tensor: torch.Tensor, dst: int, index: int) -> None: ...

    def recv(self, key: Message, src: int, shape: tuple[int, ...], dtype: torch.dtype, index: int) -> torch.Tensor: ...

    def allreduce(self, stage: int, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Sum `tensors` (a stage's gradients) over the data-parallel group in place. May return
        views of a persistent flat buffer holding the sums, to become the gradients (so the next
        step's backward accumulates into the buffer and nothing is copied)."""
        ...

    def reduce_tied(self, name: str, tensor: torch.Tensor) -> None: ...

    def reduce_replicas(self, stage: int, tensors: list[torch.Tensor]) -> None:
        """Sum `tensors` (stage `stage`'s gradients) in place over the pipeline ranks holding
        the stage's weight replicas, within this data-parallel replica."""
        ...

    def reduce_loss(self, tensor: torch.Tensor) -> None:
        """Sum the evaluation loss (one float64) over the data-parallel group, in place."""
        ...

    def flush(self) -> None: ...

    def exchange(self, index: int, count: int) -> None:
        """The `count` sends and receives after instruction `index` are one exchange: issued
        together, complete together (tpc.ir.semantics)."""
        ...

    def sum_over_pipeline(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over the pipeline ranks of this replica (for the global gradient norm)."""
        ...

    # a sharded optimizer's collectives (training/sharded_optimizer.py): `flat` has d equal
    # chunks, d the data-parallel size, and this rank's is chunk `data_rank`

    def reduce_scatter(self, stage: int, flat: torch.Tensor) -> None:
        """Chunk `data_rank` of `flat` becomes its sum over the data-parallel group (the other
        chunks may change too; nothing reads them)."""
        ...

    def all_gather(self, stage: int, flat: torch.Tensor) -> None:
        """Chunk r of `flat` becomes data rank r's chunk r, for every r."""
        ...

    def sum_over_data(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over the data-parallel group (a sharded optimizer's gradient norm)."""
        ...


class Clock:
    """Where a run's trace times count from: every engine of a process shares one, started
    when the ranks meet before the first step (so the ranks' traces line up)."""

    def __init__(self):
        self.epoch = time.perf_counter()

    def start(self) -> None:
        self.epoch = time.perf_counter()


class StageRuntimeLike(Protocol):
    """The part of `tpc.executors.stage_runtime.StageRuntime` the engine uses."""

    live_activations: int

    def forward(self, mb, sl, x, offset, targets=None, checkpoint=False, capacity=None, documents=None): ...

    def recompute(self, mb, sl): ...

    def backward(self, mb, sl, grad_out=None): ...

    def backward_input(self, mb, sl, grad_out=None): ...

    def backward_weight(self, mb, sl): ...

    def free_kv(self, mb): ...


@dataclass
class BuiltStage:
    """A stage as the engine holds it: its runtime and its parameters with their model names."""

    runtime: StageRuntimeLike
    named_parameters: list[tuple[str, torch.nn.Parameter]]


# (stage, loss_scale) -> BuiltStage
StageFactory = Callable[[Stage, float], BuiltStage]


def stage_factory_from_model(sliced, model_copy: torch.nn.Module, evaluation: bool = False,
                             programs: Callable[[Stage], "ProgramOptions | None"] | None = None,
                             dropped: tuple[int, ...] = (), documents: bool = False) -> StageFactory:
    """Stages cut from the front end's `SlicedModel`, sharing parameters with `model_copy` (so
    that two stages of one rank share a tied parameter, and the copy's state_dict is current).
    `evaluation`: the stages of the evaluation program, as `model.eval()` runs them (dropout
    off), sharing the same parameters with the training stages. `programs(stage)`: how the
    stage runs its programs (`programs_for`), None for eager autograd. `dropped`: the units that
    run on their kept tokens only (random-LTD, `RunOptions.random_ltd`). `documents`: the plan's
    rows are packed documents (its `documents` line): the stages reset positions and attend within
    each document, eagerly."""

    def build(stage: Stage, loss_scale: float) -> BuiltStage:
        from tpc.compiler.programs.stage_programs import StagePrograms
        from tpc.executors.stage_runtime import StageRuntime

        lo, hi = stage.units
        module = sliced.stage_module(lo, hi, params_from=model_copy, evaluation=evaluation, dropped=dropped,
                                     documents=documents)
        how = programs(stage) if programs is not None else None
        if how is not None and module.dropped:
            raise TpirError(Diagnostic(
                f"stage {stage.index} runs its programs (the plan splits its backward, or --compile), "
                "and random-LTD runs the stages under eager autograd", where="--random-ltd",
                hint="use a schedule without a split backward (not zb-h1, zb-h2, seq-zb, zbv, dualpipev)"))
        if documents and how is not None:
            raise TpirError(Diagnostic(
                f"stage {stage.index}: packed documents run eagerly, and this run asks for the stage's traced "
                "programs (--compile, or a schedule that splits the backward)",
                hint="run without --compile, or compile the plan with a schedule whose backward is whole "
                     "(seq1f1b, terapipe, gpipe, 1f1b, ...)"))
        runtime = StageRuntime(module, loss_scale, None if how is None else StagePrograms(module, how))
        return BuiltStage(runtime, list(module.named_parameters()))

    return build


def programs_for(plan: Plan, options: RunOptions) -> Callable[[Stage], "ProgramOptions | None"]:
    """How each stage of `plan` runs: through its programs compiled (`options.compile`); through
    its traced programs where the plan splits the stage's backward (`backward-input`, what the
    programs' halves are for) or, with a tensor axis, runs the backwards of two slices as one
    program (`paired_backwards`); else eagerly under autograd (None), which costs no trace."""
    from tpc.compiler.programs.stage_programs import ProgramOptions

    split = {i.stage for prog in plan.ranks for i in prog.instrs if i.op is Op.BACKWARD_INPUT}
    if options.slice_pairs:
        split |= paired_backwards(plan)

    def how(stage: Stage):
        if options.compile:
            return ProgramOptions(compile=True)
        return ProgramOptions() if stage.index in split else None

    return how


def paired_backwards(plan: Plan) -> set[int]:
    """The stages whose backwards of two consecutive slices a rank's stream puts side by side
    (`backward` of slice i + 1 then of slice i, `lower.paired`), on a mesh with a tensor axis:
    an executor runs each such pair as one program (`StageRuntime.backward_pair`), which needs
    the stage's traced programs."""
    if plan.header.mesh.tensor == 1:
        return set()
    return {a.stage for prog in plan.ranks for a, b in zip(prog.instrs, prog.instrs[1:])
            if a.op is Op.BACKWARD and paired(a, b) is not None}


@dataclass
class TraceEvent:
    """One executed instruction: start and end in seconds since the engine's epoch."""

    rank: int
    line: int
    instr: str
    step: int
    start: float
    end: float


class RankEngine:
    """Runs pipeline rank `pipe_rank` of data replica `data_rank` of `plan`."""

    def __init__(self, plan: Plan, pipe_rank: int, data_rank: int, transport: Transport,
                 stage_factory: StageFactory, *, hidden_size: int, options: RunOptions | None = None,
                 device: torch.device | None = None,
                 before_instr: Callable[["RankEngine", int], None] | None = None,
                 optimizer: RankOptimizer | None = None, clock: Clock | None = None, tensor=None):
        """`options` say how to train (optimizer, learning rate, clipping, tracing, bf16, ...);
        `device` is where this rank computes (default: the CPU); `before_instr(engine, index)`
        runs before each instruction (tests inject faults with it). `optimizer`: the optimizer
        of another engine of this rank over the same parameters (the plans of a bundle share
        their weights and optimizer state); by default the engine builds its own. `clock`: where
        trace times count from (shared by a process's engines). `tensor`: on a mesh with a tensor
        axis, this rank's `TensorRank` (executors/tensor_ranks.py), whose stages `stage_factory`
        built."""
        self.plan, self.header = plan, plan.header
        self.pipe_rank, self.data_rank = pipe_rank, data_rank
        self.tensor = tensor
        self.tensor_rank = tensor.rank if tensor is not None else 0
        self.global_rank = self.header.mesh.value.rank(pipe=pipe_rank, data=data_rank, tensor=self.tensor_rank)
        self.transport = transport
        self.options = options or RunOptions()
        self.device = device if device is not None else torch.device("cpu")
        self.before_instr = before_instr
        self.hidden_size = hidden_size
        self.instrs: tuple[Instr, ...] = plan.program(pipe_rank).instrs
        self.dtype = DTYPES[self.header.shape.dtype]  # the plan was verified: a known name
        self.last_stage = self.header.num_stages - 1
        loss_scale = 1.0 / self.header.tokens_per_step
        self.stages: dict[int, BuiltStage] = {
            s: stage_factory(self.header.stages[s], loss_scale) for s in self.header.stages_of_rank(pipe_rank)
        }
        self.named_parameters = unique_parameters(
            (n, p) for s in sorted(self.stages) for n, p in self.stages[s].named_parameters)
        # the evaluation program (`Plan.evaluation()`) runs forward only: no optimizer
        self.forward_only = plan.forward_only
        if optimizer is not None:
            held = {id(p) for _, p in self.named_parameters}
            if held != {id(p) for p in optimizer.params}:
                raise TpirError(Diagnostic(
                    f"rank {pipe_rank}: the shared optimizer updates other parameters than this "
                    "plan's stages hold", hint="plans that share an optimizer must split the model alike"))
        self.optimizer = None if self.forward_only else (optimizer or self._build_optimizer())
        self.peak_live = 0
        self.events: list[TraceEvent] = []
        self.clock = clock or Clock()
        self.grads: dict[str, torch.Tensor] = {}
        # the step's global sum of squared gradients, on the device until the step's one read
        # (`read_step`), and the norm the read gives (None when not computed)
        self.grad_sq: torch.Tensor | None = None
        self.grad_norm: float | None = None
        self.step = -1
        self.pc = len(self.instrs)
        self.paired = False  # the last compute ran the next instruction with it (a pair)
        if self.options.compile:  # every program compiled before step 1 (prepare_programs.py)
            from tpc.executors.prepare_programs import prepare, progress_line

            self.programs_made, self.programs_seconds = prepare(
                self, progress=None if self.options.quiet else progress_line)
            if not self.options.quiet:
                from tpc.compiler.programs.compiled import cache_dir

                progress_line(f"rank {self.global_rank}: {self.programs_made} slice shapes compiled in "
                              f"{self.programs_seconds:.1f} s (cache: {cache_dir()})\n")
        self._dispatch: dict[Op, Callable[[Instr], None]] = {
            Op.LOAD: self._load,
            Op.FORWARD: self._forward,
            Op.RECOMPUTE: self._recompute,
            Op.BACKWARD: self._backward,
            Op.BACKWARD_INPUT: self._backward_input,
            Op.BACKWARD_WEIGHT: self._backward_weight,
            Op.SEND: self._send,
            Op.RECV: self._recv,
            Op.FREE_KV: self._free_kv,
            Op.ALLREDUCE: self._allreduce,
            Op.REDUCE_TIED: self._reduce_tied,
            Op.STEP: self._step,
            Op.EXCHANGE: self._exchange,
            Op.REDUCE_LOSS: self._reduce_loss,
            Op.REDUCE_REPLICAS: self._reduce_replicas,
        }

    # ------------------------------------------------------------------------- driving

    def begin_step(self, step: int, tokens: "torch.Tensor | Batch") -> None:
        """Start one pass over the stream with the global batch: `tokens` (batch, seq+1), or a
        `Batch` of ids and targets."""
        self.step, self.pc = step, 0
        self.transport.start_step(step)
        batch = Batch.of(tokens)
        # the ids as the host holds them: document boundaries are read there, never from the device
        self.host_ids = batch.ids if batch.ids.device.type == "cpu" else None
        # once per step onto the device; the loads cut the micro-batches from it there
        self.batch = batch.to(self.device)
        self.env: dict[Message, torch.Tensor] = {}
        self.ids: dict[int, torch.Tensor] = {}
        self.targets: dict[int, torch.Tensor] = {}
        # over packed documents: micro-batch -> each row's document starts (host ints)
        self.documents: dict[int, tuple] = {}
        self.step_loss: torch.Tensor | float = 0.0  # on the device from the first loss on
        self.grad_sq, self.grad_norm = None, None
        self.reduced: set[int] = set()  # ids of parameters already allreduced this step

    @property
    def done(self) -> bool:
        return self.pc >= len(self.instrs)

    @property
    def current(self) -> Instr | None:
        return None if self.done else self.instrs[self.pc]

    def run_step(self, step: int, tokens: torch.Tensor) -> torch.Tensor | float:
        """Run the whole stream once (a transport that blocks instead of raising `Blocked`);
        `end_step`'s loss, not read."""
        self.begin_step(step, tokens)
        while not self.done:
            self.execute_next()
        return self.end_step()

    def end_step(self) -> torch.Tensor | float:
        """Finish a pass: every message handed off, nothing left behind. Returns the loss this
        rank computed (the sum of its last-stage slices' scaled losses, a float64 scalar on the
        device; 0.0 elsewhere), not read: the executor reads it with the step's other values in
        one transfer (`read_step`)."""
        self.transport.flush()
        if self.env:
            left = ", ".join(str(k) for k in sorted(self.env, key=_key_order))
            raise TpirError(Diagnostic(
                f"rank {self.rank_name}: the stream ended with values nobody used: {left}",
                loc=self.plan.program(self.pipe_rank).loc, where=self.plan.source,
                hint="every forward output needs a send (or the next stage on this rank), every "
                     "received tensor a compute that uses it"))
        return self.step_loss

    def execute_next(self) -> None:
        """Run the instruction at the program counter and advance; `Blocked` leaves it there."""
        index = self.pc
        instr = self.instrs[index]
        start = time.perf_counter()
        self.paired = False  # set by a compute that ran the next instruction with it (a pair)
        try:
            self.transport.before_instruction(index)
            if self.before_instr is not None:
                self.before_instr(self, index)
            self._dispatch[instr.op](instr)
        except Blocked:
            raise
        except RankError:
            raise
        except TpirError as e:
            raise self.locate(index, "; ".join(d.message for d in e.diagnostics),
                              hint=e.diagnostics[0].hint if e.diagnostics else "") from e
        except Exception as e:  # noqa: BLE001 - every failure of an instruction is reported located
            raise self.locate(index, f"{type(e).__name__}: {e}") from e
        if self.options.traced and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        ran = (index, index + 1) if self.paired else (index,)
        if self.options.traced:
            for j in ran:  # a pair's two computes: one span each, the same (they run interleaved)
                self.events.append(TraceEvent(self.global_rank, self.line_of(j), str(self.instrs[j]),
                                              self.step, start - self.clock.epoch, end - self.clock.epoch))
        live = sum(getattr(b.runtime, "live_activations", 0) for b in self.stages.values())
        self.peak_live = max(self.peak_live, live)
        self.pc = ran[-1] + 1

    # ---------------------------------------------------------------------- diagnostics

    @property
    def rank_name(self) -> str:
        if self.header.mesh.data == 1:
            return str(self.pipe_rank)
        return f"{self.global_rank} (pipe {self.pipe_rank}, data {self.data_rank})"

    def line_of(self, index: int) -> int:
        loc = self.instrs[index].loc
        return loc.line if loc is not None else index

    def where(self, index: int) -> str:
        """"rank r, line n: <instruction>" (or "instruction n" for a plan not read from a file)."""
        instr = self.instrs[index]
        pos = f"line {instr.loc.line}" if instr.loc is not None else f"instruction {index}"
        return f"rank {self.rank_name}, {pos}: {instr}"

    def locate(self, index: int, cause: str, hint: str = "") -> RankError:
        step = f" (step {self.step})" if self.step >= 0 else ""
        return RankError(Diagnostic(
            f"{self.where(index)}: {cause}{step}", loc=self.instrs[index].loc, where=self.plan.source,
            hint=hint or "run `tpc verify` on the plan; with --debug the Python traceback is shown"))

    # ------------------------------------------------------------------------- helpers

    def _need(self, key: Message, what: str) -> torch.Tensor:
        try:
            value = self.env.pop(key)
        except KeyError:
            raise TpirError(Diagnostic(
                f"{what} ({key}) is not available",
                hint="an earlier instruction must produce it: a recv, or the compute of the "
                     "neighbouring stage on this rank; it is used once")) from None
        self.transport.claim(key)
        return value

    def _put(self, key: Message, value: torch.Tensor) -> None:
        if key in self.env:
            raise TpirError(Diagnostic(f"{key} is produced twice before it is used",
                                       hint="each slice's activation and gradient is produced once"))
        self.env[key] = value

    def _stage(self, stage: int) -> BuiltStage:
        if stage not in self.stages:
            raise TpirError(Diagnostic(f"stage {stage} does not run on rank {self.pipe_rank}",
                                       hint=f"this rank holds stages {sorted(self.stages)}"))
        return self.stages[stage]

    def _slice(self, mb: int, sl: int) -> tuple[int, int]:
        return self.header.microbatches[mb].slices[sl]

    def compute_context(self):
        """Where a stage computes: under bf16 autocast with `--bf16`, else as it is."""
        if self.options.bf16:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _message_shape(self, mb: int, sl: int) -> tuple[int, int, int]:
        return message_shape(self.header, mb, sl, self.hidden_size)

    # ------------------------------------------------------------------------ handlers

    def _load(self, instr: Instr) -> None:
        rows = microbatch(self.batch, self.header, self.data_rank, instr.mb)
        ids, targets = rows.ids, rows.targets
        docs = self.header.documents
        if docs is not None:
            # every stage's rank loads: the boundaries are read from the host's copy of the batch
            # (no transfer from the device, no message between ranks); the target after a
            # separator, the next document's first token, is not predicted
            host = self.host_ids if self.host_ids is not None else self.batch.ids.cpu()
            host_ids = microbatch(Batch(host, host), self.header, self.data_rank, instr.mb).ids
            self.documents[instr.mb] = document_starts(host_ids, docs.eos)
            targets = mask_crossing_targets(ids, targets, docs.eos)
        # this rank's ends for the micro-batch: with weight replicas (chimera), a rank holding
        # the first stage of one pipeline and the last of the other loads only what its runs use
        if self.header.stage_rank(0, instr.mb) == self.pipe_rank:
            self.ids[instr.mb] = ids.to(self.device)
        if self.header.stage_rank(self.last_stage, instr.mb) == self.pipe_rank:
            self.targets[instr.mb] = targets.to(self.device)

    def _forward_inputs(self, instr: Instr, stage: BuiltStage):
        """(x, offset, targets, extra keyword arguments) of a forward instruction."""
        s, m, i = instr.key
        lo, hi = self._slice(m, i)
        if s == 0:
            if m not in self.ids:
                raise TpirError(Diagnostic(f"micro-batch {m} is not loaded",
                                           hint=f"put `load mb {m}` before the first forward of it"))
            x = self.ids[m][:, lo:hi]
        else:
            x = self._need(input_message(Payload.ACT, s, m, i), "the input activation")
        targets = None
        if s == self.last_stage:
            if m not in self.targets:
                raise TpirError(Diagnostic(f"micro-batch {m} is not loaded",
                                           hint=f"put `load mb {m}` before the first forward of it"))
            targets = self.targets[m][:, lo:hi]
        extra = {}
        if self.header.documents is not None:
            if m not in self.documents:
                raise TpirError(Diagnostic(f"micro-batch {m} is not loaded: its document boundaries are unknown",
                                           hint=f"put `load mb {m}` before the first forward of it"))
            extra["documents"] = self.documents[m]
        return x, lo, targets, extra

    def _partner(self, instr: Instr, stage: BuiltStage) -> Instr | None:
        """The next instruction, entered, when `instr` and it are a pair (`lower.paired`: the
        forwards of slices i and i + 1, or the backwards of slices i + 1 and i) that this rank
        runs as one program whose collectives overlap the other slice's compute: a tensor axis,
        pairs not turned off, a stage that can (`StageRuntime.forward_pair`, `backward_pair`),
        and the second's input at hand (received before the first compute). Else None."""
        if self.tensor is None or not self.options.slice_pairs or self.pc + 1 >= len(self.instrs):
            return None
        nxt = self.instrs[self.pc + 1]
        payload = paired(instr, nxt)
        if payload is None:
            return None
        able = getattr(stage.runtime, "pairs" if payload is Payload.ACT else "backward_pairs", None)
        if able is None or not able():  # (not a stage that drops tokens)
            return None
        s, m, i = nxt.key
        local = s == 0 if payload is Payload.ACT else s == self.last_stage  # its input made here
        if not local and input_message(payload, s, m, i) not in self.env:
            return None
        self.transport.before_instruction(self.pc + 1)
        if self.before_instr is not None:
            self.before_instr(self, self.pc + 1)
        return nxt

    def _forward(self, instr: Instr) -> None:
        s, m, i = instr.key
        stage = self._stage(s)
        capacity = self.header.microbatches[m].slices[-1][1]
        nxt = self._partner(instr, stage)
        if nxt is not None:
            (xa, oa, ta, _), (xb, ob, tb, _) = self._forward_inputs(instr, stage), self._forward_inputs(nxt, stage)
            run = stage.runtime.evaluate_pair if self.forward_only else stage.runtime.forward_pair
            with self.compute_context():
                outs = run(m, i, (xa, xb), (oa, ob), (ta, tb), capacity)
            for j, out in zip((i, i + 1), outs):
                self._forward_output(s, m, j, out)
            self.paired = True
            return
        x, lo, targets, extra = self._forward_inputs(instr, stage)
        keep = self._kept(stage, m, i)
        with self.compute_context():
            if self.forward_only:
                out = stage.runtime.evaluate(m, i, x, lo, targets=targets, capacity=capacity, **extra)
            elif keep is not None:
                out = stage.runtime.forward(m, i, x, lo, targets=targets, checkpoint=instr.checkpoint,
                                            capacity=capacity, keep=keep)
            else:
                out = stage.runtime.forward(m, i, x, lo, targets=targets, checkpoint=instr.checkpoint,
                                            capacity=capacity, **extra)
        self._forward_output(s, m, i, out)

    def _forward_output(self, s: int, m: int, i: int, out: torch.Tensor) -> None:
        if s == self.last_stage:
            self.step_loss = self.step_loss + out.detach().double()  # on the device: no sync per slice
        else:
            self._put(output_message(Payload.ACT, s, m, i), out)

    def _kept(self, stage: BuiltStage, m: int, i: int) -> list | None:
        """Random-LTD: per dropped unit of the stage, the kept positions of slice i of
        micro-batch m this step (the seeded draw every rank and the oracle make alike,
        tpc.compiler.random_ltd); None when the stage drops nothing."""
        ltd = self.options.random_ltd
        dropped = getattr(getattr(stage.runtime, "module", None), "dropped", ())
        if ltd is None or not dropped:
            return None
        lengths = self.header.microbatches[m].lengths
        count = ltd.slice_counts(ltd.kept(self.step), lengths)[i]
        return [ltd.keep(self.step, self.data_rank, m, u, i, lengths[i], count).to(self.device) for u in dropped]

    def _recompute(self, instr: Instr) -> None:
        s, m, i = instr.key
        with self.compute_context():
            self._stage(s).runtime.recompute(m, i)

    def _grad_out(self, s: int, m: int, i: int) -> torch.Tensor | None:
        if s == self.last_stage:
            return None  # the last stage starts from its loss
        return self._need(input_message(Payload.GRAD, s, m, i), "the output gradient")

    def _hand_down(self, s: int, m: int, i: int, grad_in: torch.Tensor | None) -> None:
        if s > 0:
            if grad_in is None:
                raise TpirError(Diagnostic(f"stage {s} returned no input gradient",
                                           hint="a stage after the first must return the gradient of its input"))
            self._put(output_message(Payload.GRAD, s, m, i), grad_in)

    def _backward(self, instr: Instr) -> None:
        self._input_gradient(instr, whole=True)

    def _backward_input(self, instr: Instr) -> None:
        self._input_gradient(instr, whole=False)

    def _input_gradient(self, instr: Instr, whole: bool) -> None:
        """`backward` (`whole`: input and weight gradients) or `backward-input`: the gradient of
        the slice's input goes on to the previous stage."""
        s, m, i = instr.key
        stage = self._stage(s)
        runtime = stage.runtime
        if self._partner(instr, stage) is not None:
            grads = self._grad_out(s, m, i), self._grad_out(s, m, i - 1)
            with self.compute_context():
                got = runtime.backward_pair(m, i, grads, whole)
            for j, grad_in in zip((i, i - 1), got):
                self._hand_down(s, m, j, grad_in)
            self.paired = True
            return
        grad_out = self._grad_out(s, m, i)
        with self.compute_context():
            run = runtime.backward if whole else runtime.backward_input
            grad_in = run(m, i, grad_out)
        self._hand_down(s, m, i, grad_in)

    def _backward_weight(self, instr: Instr) -> None:
        s, m, i = instr.key
        with self.compute_context():
            self._stage(s).runtime.backward_weight(m, i)

    def _send(self, instr: Instr) -> None:
        s, m, i = instr.key
        self._stage(s)
        key = message(instr)
        what = "the output activation" if instr.payload is Payload.ACT else "the input gradient"
        tensor = self._need(key, what)
        self.transport.send(key, tensor.detach().to(self.dtype).contiguous(), instr.peer, self.pc)

    def _recv(self, instr: Instr) -> None:
        s, m, i = instr.key
        self._stage(s)
        key = message(instr)
        tensor = self.transport.recv(key, instr.peer, self._message_shape(m, i), self.dtype, self.pc)
        self._put(key, tensor)

    def _exchange(self, instr: Instr) -> None:
        self.transport.exchange(self.pc, instr.count)

    def _free_kv(self, instr: Instr) -> None:
        self._stage(instr.stage).runtime.free_kv(instr.mb)

    def _build_optimizer(self) -> "RankOptimizer | ShardedOptimizer | ExternalOptimizer":
        """This rank's optimizer: over its stages' parameters, or with `--shard-optimizer` on a
        mesh with data-parallel replicas, over its share of them (training/sharded_optimizer.py)."""
        if self.options.external_optimizer:
            from tpc.executors.training.optimizer import ExternalOptimizer

            return ExternalOptimizer(self.named_parameters)
        if not (self.options.shard_optimizer and self.header.mesh.data > 1):
            return RankOptimizer(self.named_parameters, self.options.optim)
        from tpc.executors.training.sharded_optimizer import ShardedOptimizer

        # the stages in the order the stream reduces them (a tie of two stages goes with the first)
        order = list(dict.fromkeys(i.stage for i in self.instrs if i.op is Op.ALLREDUCE))
        order += [s for s in sorted(self.stages) if s not in order]
        header = self.header
        whole = {t.name for t in header.ties if len(header.tie_ranks(t.name)) > 1}
        whole |= {n for s, st in self.stages.items() if header.stages[s].replicas for n, _ in st.named_parameters}
        return ShardedOptimizer({s: self.stages[s].named_parameters for s in order}, self.options.optim,
                                data_rank=self.data_rank, data_size=header.mesh.data, whole=whole,
                                device=self.device)

    @property
    def sharded(self) -> bool:
        return self.optimizer is not None and self.optimizer.sharded

    def _allreduce(self, instr: Instr) -> None:
        if self.sharded:  # reduce-scatter: each replica gets the sums of its chunk
            self._stage(instr.stage)
            self.optimizer.reduce(instr.stage, self.transport, self.step)
            return
        # a parameter of two stages on this rank (a tie) is one object: reduce it once
        params = [p for _, p in unique_parameters(self._stage(instr.stage).named_parameters)
                  if id(p) not in self.reduced]
        grads = [_grad_of(p) for p in params]
        views = self.transport.allreduce(instr.stage, grads)
        if views is not None:  # the gradients live in the transport's flat buffer from now on
            for p, v in zip(params, views):
                p.grad = v
            self.optimizer.keep_grads = True
        self.reduced.update(id(p) for p in params)

    def _reduce_tied(self, instr: Instr) -> None:
        param = self.parameter(instr.tie)
        if param is None:
            raise TpirError(Diagnostic(f"no stage of rank {self.pipe_rank} holds {instr.tie!r}",
                                       hint="reduce-tied belongs on the ranks whose stages hold the tie"))
        self.transport.reduce_tied(instr.tie, _grad_of(param))

    def _reduce_replicas(self, instr: Instr) -> None:
        # a tied parameter is left to its reduce-tied, whose ranks are every rank holding a
        # replica of a tied stage: one sum over each replica of each tied stage (docs/ir.md, W1)
        tied = {t.name for t in self.header.ties}
        grads = [_grad_of(p) for n, p in unique_parameters(self._stage(instr.stage).named_parameters)
                 if n not in tied]
        self.transport.reduce_replicas(instr.stage, grads)

    def _reduce_loss(self, instr: Instr) -> None:
        total = loss_vector(self.step_loss, self.device)
        self.transport.reduce_loss(total)
        self.step_loss = total[0]

    def _step(self, instr: Instr) -> None:
        self.transport.flush()
        if self.sharded:
            self._sharded_step()
            return
        if self.options.keeps_grads:  # the model's gradients, before clipping changes them
            self.grads = {n: _grad_of(p).detach().clone() for n, p in self.named_parameters}
        if self.options.needs_grad_norm:
            from tpc.executors.training.clip import clip_global

            for _, p in self.named_parameters:
                _grad_of(p)
            self.grad_sq = clip_global(self.named_parameters, self.options.grad_clip, skip=self._counted_elsewhere(),
                                       sum_over_pipeline=self._sum_over_model, device=self.device)
        self.optimizer.set_lr(self.options.lr_at(self.step))
        self.optimizer.step()

    def _sharded_step(self) -> None:
        """`step` with the optimizer state sharded: the kept gradients gathered from the chunks,
        the global norm over every chunk, the update of this replica's chunk, the weights
        gathered (training/sharded_optimizer.py). A collective that raises `Blocked` leaves the
        parts before it done: the optimizer runs each part of a step once."""
        if self.options.keeps_grads:
            got = self.optimizer.gradients(self.transport, self.step)
            self.grads = {n: got[n] for n, _ in self.named_parameters}
        if self.options.needs_grad_norm:
            self.grad_sq = self.optimizer.clip(self.options.grad_clip, self._counted_elsewhere(), self.transport,
                                               self.device, self.step)
        self.optimizer.set_lr(self.options.lr_at(self.step))
        self.optimizer.step(self.transport, self.step)

    def _counted_elsewhere(self) -> frozenset[str]:
        """The parameters whose squared gradients another rank adds to the global norm: the
        copies of a tie or of a weight replica this rank does not own, and on a tensor rank
        other than 0 every parameter it holds whole (tensor rank 0 counts those)."""
        from tpc.executors.training.clip import copies_not_owned

        skip = copies_not_owned(self.header, self.pipe_rank, {
            s: [n for n, _ in st.named_parameters] for s, st in self.stages.items()})
        if self.tensor_rank:
            skip = skip | self.tensor.replicated_names(n for n, _ in self.named_parameters)
        return frozenset(skip)

    def _sum_over_model(self, sq: torch.Tensor) -> torch.Tensor:
        """A rank's share of the squared gradients summed over this replica's pipeline ranks
        and, with a tensor axis, over the tensor group."""
        total = self.transport.sum_over_pipeline(sq)
        return self.tensor.sum(total) if self.tensor is not None else total

    # -------------------------------------------------------------------------- access

    def parameter(self, name: str) -> torch.nn.Parameter | None:
        for n, p in self.named_parameters:
            if n == name:
                return p
        return None


STEP_READ = "the step's loss and gradient norm"


def read_step(losses: list, engines: list[RankEngine]) -> list[float]:
    """The step's one wait for the device: `losses` (tensors on the device, or numbers) and the
    summed squared gradients of every engine that computed them, read in one transfer
    (tpc.executors.host_sync.read). Sets each engine's `grad_norm`; returns the losses."""
    from tpc.executors.host_sync import read
    from tpc.executors.training.clip import grad_norm

    got = read([*losses, *(e.grad_sq for e in engines)], STEP_READ)
    for e, sq in zip(engines, got[len(losses):]):
        e.grad_norm = None if sq is None else grad_norm(sq)
    return got[:len(losses)]


def loss_vector(loss: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    """A rank's loss as a fresh float64 vector of one element on `device`, to sum over ranks in
    place (a rank without the last stage has 0.0: a zero made there, nothing copied over)."""
    if isinstance(loss, torch.Tensor):
        return loss.detach().to(torch.float64).reshape(1).clone()
    return torch.full((1,), float(loss), dtype=torch.float64, device=device)


def _grad_of(p: torch.nn.Parameter) -> torch.Tensor:
    """The parameter's gradient, zeros where backward left none (a reduction must see the same
    tensors on every rank)."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def _key_order(key: Message):
    return (key.payload.value, key.receiver_stage, key.mb, key.slice)


def measured_trace(events: Iterable[TraceEvent]) -> dict:
    """The measured timeline in the one trace format (tpc.compiler.predict.chrome_trace): one
    "X" event per executed instruction, pid = the global rank, microseconds (to the ns)."""
    from tpc.compiler.predict.chrome_trace import TimedInstr, trace_document

    instrs = [TimedInstr(rank=e.rank, instr=e.instr, ts=round(e.start * 1e6, 3),
                         dur=round((e.end - e.start) * 1e6, 3), step=e.step, line=e.line)
              for e in events]
    return trace_document(instrs, ranks={t.rank for t in instrs}, source="run")
