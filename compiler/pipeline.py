"""The passes of `tpc compile`, and the pipeline the options make of them.

    load -> trace -> partition -> header [-> tensor]                    (no cost model)
    load -> trace -> costs -> search [-> tensor] -> eval-dp             (--cost / --device-model)
         -> self-check -> schedule [-> recompute] -> lower -> eval [-> write]

`tensor` runs with `--tensor` (T other than 1): Megatron's split of every stage of the
plan, found in the stage's graph (compiler/tensor), or the split's located refusal.

Each pass is a small named object with its options as fields (compiler/passes.py says what a
pass is and what the driver does between passes: the plan verified after `lower` and `eval`,
the IR printed after any pass `--print-after` names). `compile_passes(options)` is the list a
compile runs; `tpc compile --schedule-file` runs the same front half (`front_passes`) and its
own passes after it (compiler/torch_schedule/compile.py). `PASS_NAMES` are every pass's names,
in pipeline order, for `--print-after` and `--help`.

Every pass imports what it runs when it runs: this module, like the options, reads without torch.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass

from tpc.compiler.header import (
    check_plan_slices,
    header_maker,
    place_chunks,
    slicing_summary,
    slicings,
)
from tpc.compiler.lowering.lower import DEFAULT_EXCHANGES, Exchanges
from tpc.compiler.options import CompileOptions
from tpc.compiler.passes import Pass
from tpc.compiler.schedules import splits_backward, stages_per_rank
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Plan
from tpc.ir.semantics import DEFAULT_COMM, CommRules


def _error(option: str, message: str, hint: str) -> TpirError:
    return TpirError(Diagnostic(message, hint=hint, where=option))


def _say(quiet: bool, text: str) -> None:
    if not quiet:
        print(text, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ the front half


@dataclass(frozen=True)
class Load(Pass):
    """The model file: its module, content hash and vocabulary (or a model object given)."""

    name = "load"
    summary = "the model file: module, content hash, vocabulary"
    factory: str = "model"

    def run(self, state, note):
        from tpc.compiler.frontend import file_sha256
        from tpc.compiler.frontend.weightless import build_weightless

        if state.model is not None:  # a model object (the library's `tpc.compile(model)`), as it is
            note(f"{sum(p.numel() for p in state.model.parameters()):,} parameters, the object given")
            return state.but(sha256=file_sha256(state.model_path), vocab=None, factory=self.factory)
        # built without weights: every parameter on the meta device (compiler/frontend/weightless.py);
        # the vocabulary is read from the trace
        model, _ = build_weightless(state.model_path, self.factory)
        note(f"{sum(p.numel() for p in model.parameters()):,} parameters, on the meta device")
        return state.but(model=model, sha256=file_sha256(state.model_path), vocab=None, factory=self.factory)


@dataclass(frozen=True)
class Trace(Pass):
    """The front end: capture, refuse token mixing, rewrite attention and positions, cut units
    (compiler/frontend/sliced.py). The numeric self-check waits for the plan's own slices
    (`self-check`). `stages`: refused when the model has fewer units (None: not known yet)."""

    name = "trace"
    summary = "the front end: capture, rewrite for token slices, cut units"
    seq_len: int
    stages: int | None = None
    stages_option: str = "--stages"
    schedule_file: str | None = None  # the stages are the schedule file's (`--schedule-file`)
    documents: int | None = None  # `--documents eos:ID`: the model must reset at a document boundary
    random_ltd: object = None  # `--random-ltd`: its units must be middle units that can drop tokens

    def run(self, state, note):
        from tpc.compiler.frontend import SlicedModel

        sliced = SlicedModel.from_model(state.model, seq_len=self.seq_len, vocab=state.vocab, check_slices=None)
        note(f"{sliced.num_units} units, vocab {sliced.vocab}")
        if self.documents is not None:
            if self.documents >= sliced.vocab:
                raise _error("--documents", f"--documents eos:{self.documents}: the separator id is outside the "
                             f"model's vocabulary of {sliced.vocab}",
                             f"give the corpus's end-of-document token, an id below {sliced.vocab}")
            sliced.check_documents()
        if self.random_ltd is not None:
            from tpc.compiler.frontend.random_ltd import check_droppable
            from tpc.compiler.random_ltd import parse_units

            parse_units(",".join(map(str, self.random_ltd.units)), sliced.num_units)
            check_droppable(sliced.context, self.random_ltd.units)
        if self.stages is not None and self.stages > sliced.num_units:
            if self.schedule_file is not None:
                raise _error("--schedule-file", f"{self.schedule_file} runs {self.stages} stages but the model "
                             f"has only {sliced.num_units} partition units", "use a schedule with fewer stages")
            raise _error(self.stages_option,
                         f"{self.stages} stages but the model has only {sliced.num_units} partition units",
                         f"use at most {sliced.num_units} stages")
        return state.but(sliced=sliced, vocab=sliced.vocab)


@dataclass(frozen=True)
class Partition(Pass):
    """Stage partition without a cost model: parameter-balanced (or the bundle's `split`)."""

    name = "partition"
    summary = "the stages' units, balanced by parameters (no cost model)"
    stages: int
    ranges: tuple[tuple[int, int], ...] | None = None  # fixed (a bundle's shared split)

    def run(self, state, note):
        ranges = self.ranges if self.ranges is not None else tuple(
            tuple(r) for r in state.sliced.partition_by_params(self.stages))
        note(" | ".join(f"{lo}:{hi}" for lo, hi in ranges))
        return state.but(ranges=tuple(ranges))


@dataclass(frozen=True)
class BuildHeader(Pass):
    """The header of the options on the partition: mesh, stages on ranks, ties, micro-batches
    and slices (with several stages per rank, in the placement the schedule is made for)."""

    name = "header"
    summary = "the plan header: mesh, stages, ties, micro-batches, slices"
    options: CompileOptions

    def run(self, state, note):
        o = self.options
        make = header_maker(model_path=state.model_path, sha256=state.sha256, factory=o.factory, opts=o,
                            vocab=state.vocab, sliced=state.sliced)
        ranges = list(state.ranges)
        if o.chunks > 1 and stages_per_rank(o.schedule) == 1:
            header = place_chunks(make(o.num_stages, o.dp, ranges, o.schedule), o.pipe)
        else:
            header = make(o.pipe, o.dp, ranges, o.schedule)
        if o.slices_auto:  # no cost model: the equal slices of `cuts`, said in one line
            _say(o.quiet, f"--slices auto: {len(o.cuts)} equal slices of ~{o.seq_len // len(o.cuts)} "
                 "tokens (give --cost or --device-model for the optimiser's choice)")
        note(slicing_summary(header))
        check_weights_fit(header, state.sliced, o.memory_per_rank, o.dp if o.shard_optimizer else 1)
        return state.but(header=header)


@dataclass(frozen=True)
class TensorSplit(Pass):
    """Megatron's split of every stage of the header over its mesh's tensor ranks, found in the
    stage's captured graph (`compiler.tensor.find_split`): a tensor degree that does not divide
    the heads, a hidden width or the vocabulary, or an op that mixes the split dimension, is
    refused here, at the model's line, rather than when the plan runs."""

    name = "tensor"
    summary = "each stage's tensor split (compiler/tensor), or its refusal at the model's line"

    def run(self, state, note):
        T = state.header.mesh.tensor
        if T == 1:
            note("no tensor axis")
            return state
        plans = check_tensor_split(state.sliced, T, [st.units for st in state.header.stages])
        note(f"tensor {T}: " + " | ".join(f"{len(p.column)} column, {len(p.row)} row" for p in plans)
             + " parallel matmuls")
        return state


def check_tensor_split(sliced, tensor: int, ranges) -> list:
    """The `SplitPlan` of each stage [lo, hi) of `ranges` over `tensor` ranks (the stage graph
    the tensor ranks will run: the last stage with its loss), or the first stage's located
    TpirError."""
    from tpc.compiler.frontend.stage import build_stage_graph
    from tpc.compiler.tensor import find_split

    ctx = sliced.context
    out = []
    for lo, hi in ranges:
        graph, _ = build_stage_graph(ctx, lo, hi, True)
        out.append(find_split(graph, tensor, ctx.param_names, ctx.model_file))
    return out


def tensor_degrees(sliced, candidates) -> tuple[list[int], list[str]]:
    """Of the tensor degrees `candidates`, those the whole model's split accepts (ascending),
    and why each other is refused (its diagnostic's first line): what `--tensor auto` searches."""
    accepted, refused = [], []
    for t in sorted(set(candidates)):
        if t == 1:
            accepted.append(t)
            continue
        try:
            check_tensor_split(sliced, t, [(0, sliced.num_units)])
        except TpirError as e:
            refused.append(f"tensor {t}: {_first_line(e)}")
        else:
            accepted.append(t)
    return accepted, refused


def _first_line(e: TpirError) -> str:
    """What a diagnostic says, without its location and source lines."""
    return e.diagnostics[0].message if e.diagnostics else str(e).splitlines()[0]


# what a parameter keeps allocated on its rank through a run: fp32 weight and gradient (8 bytes),
# AdamW's two moments (8 bytes, divided over the data-parallel ranks with --shard-optimizer)
WEIGHT_BYTES_PER_PARAM, MOMENT_BYTES_PER_PARAM = 8, 8
STATE_BYTES_PER_PARAM = WEIGHT_BYTES_PER_PARAM + MOMENT_BYTES_PER_PARAM


def check_weights_fit(header, sliced, limit: float | None, shards: int = 1) -> None:
    """With `--memory-per-rank` and no cost model (a search fits the limit itself): refuse a
    plan where some rank cannot hold even its stages' parameters, gradients and optimizer state
    (16 bytes a parameter; the moments' 8 over `shards` data-parallel ranks when sharded, for a
    stage without weight replicas), before activations, saying the predicted bytes of every
    rank against the limit and what would help."""
    if limit is None:
        return
    from tpc.compiler.predict.quantities import format_bytes

    per_rank = {}
    for r in range(header.mesh.value.pipe):
        per_rank[r] = 0.0
        for s in header.stages_of_rank(r):
            # each tensor rank holds 1/T of the stage's (split) weights
            params = sliced.stage_param_count(*header.stages[s].units) / header.mesh.tensor
            moments = MOMENT_BYTES_PER_PARAM / (1 if header.stages[s].replicas else max(1, shards))
            per_rank[r] += params * (WEIGHT_BYTES_PER_PARAM + moments)
    over = {r: b for r, b in per_rank.items() if b > limit}
    if not over:
        return
    largest = max(sliced.unit_param_counts) * STATE_BYTES_PER_PARAM
    listing = ", ".join(f"rank {r} {format_bytes(b)}" for r, b in sorted(per_rank.items()))
    helps = ([f"more pipeline stages (--stages; the model has {sliced.num_units} units, the largest needs "
              f"{format_bytes(largest)})"] if largest <= limit else
             [f"more memory per rank: one unit alone needs {format_bytes(largest)}"])
    if shards == 1:
        helps.append("sharding the optimizer state over data-parallel ranks (--shard-optimizer with --dp > 1)")
    raise _error("--memory-per-rank",
                 f"the parameters, gradients and optimizer state of a rank's stages "
                 f"({'8 + 8/' + str(shards) if shards > 1 else '16'} bytes a parameter, before activations) exceed --memory-per-rank {format_bytes(limit)}: {listing}",
                 "; or ".join(helps) + " (recomputation, --recompute, lowers only the activations on top)")


def front_passes(options: CompileOptions, *, split=None, schedule_file: str | None = None) -> list[Pass]:
    """What a compile without a cost model starts with: load, trace, partition, header (`split`:
    a bundle's fixed stage partition; `schedule_file`: the stages are that file's)."""
    o = options
    option = "--virtual-stages" if o.virtual_stages > 1 else "--stages"
    ranges = None if split is None else tuple(tuple(r) for r in split[2])
    if o.documents is not None and not o.schedule_auto and splits_backward(o.schedule):
        raise _error("--schedule", f"--documents with schedule {o.schedule!r}, which splits each backward in "
                     "two: packed documents run each stage eagerly, and a split backward runs its traced programs",
                     "choose a schedule whose backward is whole (seq1f1b, terapipe, 1f1b, gpipe, ...)")
    return [Load(o.factory), Trace(o.seq_len, o.num_stages, option, schedule_file, o.documents, o.random_ltd),
            Partition(o.num_stages, ranges), BuildHeader(o)] + ([TensorSplit()] if o.tensor != 1 else [])


# ------------------------------------------------------------------------------ the plan search


@dataclass(frozen=True)
class Costs(Pass):
    """The cost models --cost / --device-model name, for any stage partition of this model. A
    device model prices the traced graph's own FLOPs, bytes and kernels (costmodel/graph.py)."""

    name = "costs"
    summary = "cost models for any partition (--cost or --device-model)"
    cost: str | None = None
    device_model: str | None = None
    # packed documents: their mean length, which the traced-graph model prices attention by
    document_length: int | None = None
    # random-LTD: (unit, kept fraction) of the dropped units, which the traced-graph model prices
    # at that many tokens (costmodel/dropped.py)
    kept: tuple = ()

    def run(self, state, note):
        from tpc.compiler.costmodel.resolve import load_cost_source

        sliced = state.sliced
        source = load_cost_source(cost=self.cost, device_model=self.device_model,
                                  sliced=sliced if self.device_model else None, num_units=sliced.num_units,
                                  model_sha256=state.sha256 if self.cost else None,
                                  document_length=self.document_length, kept=dict(self.kept))
        note((f"--cost {self.cost}" if self.cost else f"--device-model {self.device_model}")
             + (f", attention over documents of mean length {self.document_length}"
                if self.document_length is not None and self.device_model else "")
             + (f", random-LTD units {', '.join(str(u) for u, _ in self.kept)} priced at "
                f"{self.kept[0][1]:.0%} of their tokens" if self.kept and self.device_model else ""))
        return state.but(source=source)


def search_space(opts: CompileOptions, num_units: int, split=None, tensors=None, refused=()):
    """What the plan search may choose (compiler/optimise/search.py): the meshes of --stages auto
    --ranks N or the given one, every schedule or the given one, the optimiser's slicing or
    the given slices. `split` (pipe, data, ranges) fixes the mesh and the stage partition.
    `tensors`: the tensor degrees --tensor auto may choose (the model's split accepts them;
    `refused` says why the others are not), by default every divisor of --ranks."""
    from tpc.compiler.optimise.search import AUTO_SCHEDULES, RECOMPUTE_SCHEDULES, Space, meshes_for_ranks

    if opts.stages_auto:
        if not opts.tensor_auto:
            tensors = (opts.tensor,)
        elif tensors is None:
            tensors = tuple(t for t in range(1, opts.ranks + 1) if opts.ranks % t == 0)
        meshes, skipped = meshes_for_ranks(opts.ranks, num_units, opts.batch, opts.microbatch_count or 1,
                                           tuple(tensors))
        skipped = [*refused, *skipped]
        if not meshes:
            axes = "pipeline x data x tensor" if opts.tensor_auto else "pipeline x data"
            of = f"--ranks {opts.ranks}" + (f" / --tensor {opts.tensor}" if opts.tensor not in (1, "auto") else "")
            raise _error(
                "--stages",
                f"no {axes} split of {of} fits: " + "; ".join(skipped),
                "change --ranks, --batch or --microbatches",
            )
    else:
        meshes, skipped = [(opts.pipe, opts.dp, opts.tensor_size)], []
    return Space(
        seq_len=opts.seq_len, batch=opts.batch, microbatches=opts.microbatch_count,
        meshes=tuple(meshes), schedules=tuple(
            s for s in (AUTO_SCHEDULES + (RECOMPUTE_SCHEDULES if opts.recompute == "full" else ())
                        if opts.schedule_auto else (opts.schedule,))
            # documents and random-LTD: whole backwards only
            if (opts.documents is None and opts.random_ltd is None) or not splits_backward(s)),
        # with --recompute auto the budget is met by recomputation after the search
        slices=None if opts.slices_auto else opts.cuts,
        budget=None if opts.recompute == "auto" else opts.memory_per_rank,
        skipped=tuple(skipped),
        ranges=None if split is None else tuple(split[2]),
        comm=opts.comm,
        exchanges=opts.exchanges,
        shard_optimizer=opts.shard_optimizer,
        recompute="full" if opts.recompute == "full" else "none",
    )  # fmt: skip


@dataclass(frozen=True)
class Search(Pass):
    """The header of the plan the search chooses among what the 'auto' options leave open, by
    simulated step time under the options' communication rules; with nothing open, the given
    plan on the cost-balanced partition (on `split`'s, when given)."""

    name = "search"
    summary = "mesh x partition x slicing x schedule, by simulated step time (a cost model)"
    options: CompileOptions
    split: tuple | None = None  # (pipe, data, ranges): a bundle's shared mesh and partition

    def run(self, state, note):
        from tpc.compiler.optimise.search import explain as explain_search
        from tpc.compiler.optimise.search import search_plan

        o = self.options
        make = header_maker(model_path=state.model_path, sha256=state.sha256, factory=o.factory, opts=o,
                            vocab=state.vocab, sliced=state.sliced)
        tensors, refused = None, ()
        if o.stages_auto and o.tensor_auto:  # the degrees the model's split accepts
            tensors, refused = tensor_degrees(state.sliced, [t for t in range(1, o.ranks + 1) if o.ranks % t == 0])
        elif o.stages_auto and o.tensor != 1:  # the given degree, refused here at the model's line
            check_tensor_split(state.sliced, o.tensor, [(0, state.sliced.num_units)])
        space = search_space(o, state.source.num_units, self.split, tensors, refused)
        result = search_plan(state.source, space, make)
        best = result.best
        # (with a cost model the search fits --memory-per-rank itself, by the memory model it
        # prices every candidate with, and refuses when nothing fits)
        note(f"{len(result.candidates)} candidates; {best.mesh} {best.schedule}, "
             f"predicted step {best.time:.4g} s")
        if o.explain:
            _say(o.quiet, explain_search(result))
        # the passes after this one price the chosen plan: its stages split over its tensor ranks
        return state.but(header=best.header, source=state.source.split(best.tensor))


@dataclass(frozen=True)
class EvalSlicing(Pass):
    """The evaluation program's own micro-batches and slices: the DP without backward."""

    name = "eval-dp"
    summary = "the evaluation's micro-batches and slices (the DP without backward)"
    microbatches: int | None = None

    def run(self, state, note):
        from tpc.compiler.lowering.eval_program import eval_slicing

        header = state.header
        mbs = eval_slicing(state.source.for_stages([st.units for st in header.stages]), header,
                           microbatches=self.microbatches)
        note(slicing_summary(dataclasses.replace(header, microbatches=mbs)))
        return state.but(eval_microbatches=tuple(mbs))


# ------------------------------------------------------------------------------ the back half


@dataclass(frozen=True)
class SelfCheck(Pass):
    """The front end's numeric self-check (sliced vs unsliced model at the full length) with each
    slicing the plan uses, the evaluation's too: what the plan will run is what is checked."""

    name = "self-check"
    summary = "sliced vs unsliced model, with every slicing the plan uses"

    def run(self, state, note):
        extra = state.eval_microbatches or ()
        done = check_plan_slices(state.sliced, state.header, extra)
        full = state.header.shape.seq
        if done is None or not done.units:
            note(f"{len(slicings(state.header, extra))} slicing(s) at length {full}")
        else:
            at = f"length {full}" if done.length == full else (
                f"length {done.length} of {full} (the same slices, scaled: docs/frontend.md)")
            note(f"{len(slicings(state.header, extra))} slicing(s) at {at}, unit by unit: units "
                 f"{', '.join(map(str, done.units))} (the distinct ones)")
        return state


@dataclass(frozen=True)
class Schedule(Pass):
    """Each rank's compute order, from the schedule the header names (compiler/schedules/)."""

    name = "schedule"
    summary = "each rank's compute order (compiler/schedules/)"

    def run(self, state, note):
        from tpc.compiler.schedules import build_schedule

        header = state.header
        compute = build_schedule(header.schedule.name, header)
        note(f"{header.schedule.name}: {slicing_summary(header)}")
        return state.but(compute=compute)


@dataclass(frozen=True)
class Recompute(Pass):
    """`--recompute full`: every stage's forwards checkpointed and recomputed before their
    backward; `auto`: the stage-aware planner's choice under `budget` (compiler/lowering/recompute.py),
    with `explain` each rank's peak before and after."""

    name = "recompute"
    summary = "activation recomputation (--recompute full|auto)"
    mode: str = "full"
    budget: float | None = None
    explain: bool = False
    quiet: bool = False
    shard_optimizer: bool = False  # the memory of a run with `--shard-optimizer`

    def run(self, state, note):
        from tpc.compiler.lowering import recompute

        from tpc.compiler.schedules import own_recompute

        header, compute = state.header, state.compute
        if own_recompute(header.schedule.name):
            # Merak's critical-path 1F1B places its own recomputation (compiler/schedules/critical_path.py)
            if self.mode == "auto":
                raise TpirError(Diagnostic(
                    f"schedule {header.schedule.name!r} places its own recomputation (every stage "
                    "recomputed but, in some variants, the last), so --recompute auto has nothing "
                    "to choose", where="--recompute",
                    hint=f"use --recompute full (or none: the same plan) with --schedule "
                         f"{header.schedule.name}, or --recompute auto with --schedule 1f1b"))
            note(f"{self.mode}: schedule {header.schedule.name} places its own recomputation")
            return state
        if self.mode == "auto":
            costs = state.source.for_stages([st.units for st in header.stages])
            shards = header.mesh.data if self.shard_optimizer else 1
            before = recompute.peaks(header, compute, costs, shards)
            choice = recompute.choose(header, compute, costs, self.budget, shards)
        else:
            choice = recompute.uniform(header, self.mode)
        out = recompute.apply(compute, choice)
        full = [s for s, c in sorted(choice.items()) if c == "full"]
        note(f"{self.mode}: " + (f"stage{'s' * (len(full) != 1)} {', '.join(map(str, full))} recomputed"
                                 if full else "nothing recomputed"))
        if self.mode == "auto" and self.explain:
            from tpc.compiler.predict.quantities import format_quantity

            after = recompute.peaks(header, out, costs)

            def fmt(n):
                return format_quantity(n, costs.memory_unit)

            lines = [f"recompute auto, budget {fmt(self.budget)} per rank (stage-aware: the stage "
                     "of a rank over budget whose recomputation lowers its peak most, until it fits):"]
            for r in sorted(before):
                stages = sorted(header.stages_of_rank(r))
                lines.append(f"  rank {r}: stages {', '.join(map(str, stages))}: peak {fmt(before[r])} -> "
                             f"{fmt(after[r])}; recomputed: "
                             f"{', '.join(str(s) for s in stages if choice[s] == 'full') or 'none'}")
            _say(self.quiet, "\n".join(lines))
        return state.but(compute=out)


@dataclass(frozen=True)
class Lower(Pass):
    """Compute order to complete plan: loads, sends and receives, free-kv, reductions, the
    exchanges NCCL's rules need (batched, or `exchanges=ordered`: single operations in order),
    step (compiler/lowering/lower.py); verified by the driver."""

    name = "lower"
    summary = "loads, sends/receives, free-kv, reductions, exchanges (NCCL), step"
    changes_plan = True
    comm: CommRules = DEFAULT_COMM
    exchanges: Exchanges = DEFAULT_EXCHANGES
    pairs: bool = False  # --tensor-overlap: the forwards of slice pairs brought together

    def run(self, state, note):
        from tpc.compiler.lowering.lower import lower

        pairs = self.pairs and state.header.mesh.tensor > 1
        plan = lower(state.header, state.compute, verify=False, comm=self.comm,
                     exchanges=self.exchanges, pairs=pairs)  # the driver verifies
        note(f"{sum(len(p.instrs) for p in plan.ranks)} instructions")
        return state.but(plan=plan)


@dataclass(frozen=True)
class Evaluation(Pass):
    """The plan's forward-only evaluation program (compiler/lowering/eval_program.py), on the evaluation's
    own micro-batches when `eval-dp` chose them, else the training program's."""

    name = "eval"
    summary = "the forward-only evaluation program"
    changes_plan = True
    comm: CommRules = DEFAULT_COMM
    exchanges: Exchanges = DEFAULT_EXCHANGES
    pairs: bool = False  # --tensor-overlap: the forwards of slice pairs brought together

    def run(self, state, note):
        from tpc.compiler.lowering.eval_program import eval_program

        plan = state.plan
        pairs = self.pairs and plan.header.mesh.tensor > 1
        ev = eval_program(plan.header, state.eval_microbatches, self.comm, self.exchanges, pairs)
        plan = dataclasses.replace(plan, eval=ev)
        note(f"forward only, {sum(len(p.instrs) for p in ev.ranks)} instructions")
        return state.but(plan=plan)


@dataclass(frozen=True)
class Write(Pass):
    """The plan written to `output` atomically, after the written text is read back, parsed and
    verified under `comm`'s rules (compiler/compile.py, `write_plan`)."""

    name = "write"
    summary = "print, re-read and verify, write atomically"
    output: str
    comm: CommRules = DEFAULT_COMM

    def run(self, state, note):
        write_plan(state.plan, self.output, quiet=True, comm=self.comm)  # the driver's caller says it
        note(self.output)
        return state


def write_plan(plan: Plan, output: str, *, quiet: bool = False, comm: CommRules = DEFAULT_COMM) -> Plan:
    """Write a verified plan to `output` atomically: the text is read back, parsed and verified
    (under the communication rules `comm`, those it was compiled for) before it replaces
    `output`. Says what was written unless `quiet`."""
    from tpc.ir.files import atomic_path
    from tpc.ir.parse import parse
    from tpc.ir.printer import print_plan
    from tpc.ir.verify import check

    text = print_plan(plan)
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise _error("--output", f"no such folder: {folder}", "create the folder first, or write the plan elsewhere")
    with atomic_path(output) as tmp:  # replaces `output` only if the block ends normally
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        with open(tmp, encoding="utf-8") as f:
            back = f.read()
        check(parse(back, file=output), comm)
    if not quiet:
        print(written(plan, output))
    return plan


def written(plan: Plan, output: str) -> str:
    """What `write_plan` says it wrote."""
    h = plan.header
    n = sum(len(p.instrs) for p in plan.ranks)
    return (f"wrote {output}: {h.num_stages} stage{'s' * (h.num_stages != 1)}"
            f"{f' ({h.replicas} weight replicas each)' if h.replicas > 1 else ''} x "
            f"{h.mesh.data} data replica{'s' * (h.mesh.data != 1)}"
            f"{f' x {h.mesh.tensor} tensor ranks' if h.mesh.tensor != 1 else ''}, "
            f"{slicing_summary(h)}, "
            f"schedule {h.schedule.name}, {n} instructions")


def back_passes(comm: CommRules, exchanges: Exchanges = DEFAULT_EXCHANGES, pairs: bool = False) -> list[Pass]:
    """After the header: self-check, schedule, lower, eval (recompute goes before lower)."""
    return [SelfCheck(), Schedule(), Lower(comm, exchanges, pairs), Evaluation(comm, exchanges, pairs)]


def compile_passes(options: CompileOptions, split=None) -> list[Pass]:
    """The passes a compile with `options` runs (the module docstring). `split`, a (pipe, data,
    stage unit ranges) triple, fixes the mesh and the stage partition (a bundle's plans share
    one)."""
    o = options
    if o.searching:
        # a cost model is named: the partition comes from its unit times, and whatever is 'auto'
        # is chosen by simulated step time
        passes = [Load(o.factory), Trace(o.seq_len, None if o.stages_auto else o.num_stages,
                                         "--virtual-stages" if o.virtual_stages > 1 else "--stages",
                                         documents=o.documents, random_ltd=o.random_ltd),
                  Costs(o.cost, o.device_model,
                        (o.document_length or o.seq_len) if o.documents is not None else None,
                        tuple(sorted(o.random_ltd.fractions(o.seq_len).items())) if o.random_ltd else ()),
                  Search(o, split)]
        passes += [TensorSplit()] if o.tensor != 1 else []
        passes += [EvalSlicing(o.microbatch_count)]
    else:
        passes = front_passes(o, split=split)
    back = back_passes(o.comm, o.exchanges, o.tensor_overlap)
    if o.recompute != "none":
        back.insert(2, Recompute(o.recompute, o.memory_per_rank, o.explain, o.quiet, o.shard_optimizer))
    return passes + back


# every pass of `tpc compile`, in pipeline order (`--schedule-file` runs the front half, then
# its own `csv-place` and `csv-import`: compiler/torch_schedule/compile.py)
PASSES = (Load, Trace, Partition, BuildHeader, Costs, Search, TensorSplit, EvalSlicing, SelfCheck, Schedule,
          Recompute, Lower, Evaluation, Write)
PASS_NAMES = tuple(p.name for p in PASSES)
