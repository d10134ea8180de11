"""`tpc compile`: from a model file to a verified plan.

    load_model -> SlicedModel.from_model -> partition -> header -> the evaluation's slicing ->
    self-check of the header's and the evaluation's slices -> build_schedule -> lower ->
    the evaluation program (compiler/evaluation.py) -> check

`compile_plan` returns the Plan; `compile_to_file` also writes it, atomically, after re-reading
the written text and verifying that, so the file on disk is exactly what was verified.

Every argument is checked before the model is traced (tracing is the slow part), and every
mistake is a TpirError that names the option and says what would be right.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass

from tpc.compiler.recompute import OPTION as RECOMPUTE
from tpc.compiler.schedules import SCHEDULES, build_schedule, replicas, stages_per_rank, with_replicas
from tpc.compiler.schedules.placement import vshape
from tpc.compiler.slicing import AUTO, check_slices, equal_slices, ranges_of
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.semantics import COMMS, DEFAULT_COMM, CommRules
from tpc.ir.nodes import (
    Header,
    MeshLine,
    Microbatch,
    ModelLine,
    Plan,
    ScheduleLine,
    ShapeLine,
    Stage,
    Tie,
    UnitsLine,
)

# Without a cost model (which the optimiser needs), `--slices auto` cuts the sequence into
# this many equal slices (about L/8 tokens each): enough to fill a short pipeline, few enough
# that per-slice overheads stay small.
AUTO_SLICE_COUNT = 8


def _error(option: str, message: str, hint: str) -> TpirError:
    return TpirError(Diagnostic(message, hint=hint, where=option))


# ------------------------------------------------------------------------------ options


@dataclass(frozen=True)
class CompileOptions:
    """What `tpc compile` is asked for, typed (the command line parses its strings into this,
    `tpc.cli.compile`). Checked on construction against itself, before any model is traced;
    every mistake is a TpirError naming the option.

    `stages`, `microbatches`, `slices` and `schedule` may be AUTO: the plan search chooses them,
    which needs a cost model (`cost`: a profile from `tpc profile`, or `device_model`).
    `slices` is a count of equal slices, the lengths of each slice, or AUTO. With
    `stages=AUTO` the search splits `ranks` into pipeline x data (`dp` stays 1)."""

    seq_len: int
    batch: int
    stages: int | str = 2
    microbatches: int | str = 1
    slices: int | tuple[int, ...] | str = 1
    schedule: str = "seq1f1b"
    dp: int = 1
    ranks: int | None = None
    factory: str = "model"
    cost: str | None = None
    device_model: str | None = None
    memory_per_rank: float | None = None  # bytes, for the plan search
    explain: bool = False
    quiet: bool = False
    virtual_stages: int = 1  # stages per pipeline rank: `stages` ranks hold stages x V stages
    recompute: str = "none"  # none | full | auto (compiler/recompute.py)
    # the communication rules the plan is lowered, searched and verified for (tpc.ir.semantics):
    # NCCL's (CUDA; sends paired into exchanges; a plan for them also runs on gloo) or GLOO's (CPU)
    comm: CommRules = DEFAULT_COMM

    def __post_init__(self):
        _check_options(self)

    # -- what the options say, derived

    @property
    def searching(self) -> bool:
        """A cost model is named: the plan search prices the candidates."""
        return bool(self.cost or self.device_model)

    @property
    def stages_auto(self) -> bool:
        return self.stages == AUTO

    @property
    def schedule_auto(self) -> bool:
        return self.schedule == AUTO

    @property
    def slices_auto(self) -> bool:
        return self.slices == AUTO

    @property
    def microbatch_count(self) -> int | None:
        """The number of micro-batches; None when the optimiser chooses (AUTO)."""
        return None if self.microbatches == AUTO else self.microbatches

    @property
    def pipe(self) -> int:
        """Pipeline ranks: the stages (half of them for a V-shaped schedule, two stages per
        rank; with --virtual-stages V, each holds V of them; with --ranks R fewer than stages x
        dp, R / dp ranks hold the stages in a loop), or with `stages=AUTO` a placeholder until
        the search picks the mesh (all ranks)."""
        if self.stages_auto:
            return self.ranks
        if stages_per_rank(self.schedule) == 2:
            return self.stages // 2
        if self.virtual_stages == 1 and self.ranks is not None:
            return self.ranks // self.dp
        return self.stages

    @property
    def num_stages(self) -> int:
        """The model's pipeline stages (a multiple of the pipeline ranks)."""
        return self.stages * self.virtual_stages

    @property
    def chunks(self) -> int:
        """Stages per pipeline rank (1 but with --virtual-stages or --ranks below stages x dp)."""
        return 1 if self.stages_auto else self.num_stages // self.pipe

    @property
    def data(self) -> int:
        return 1 if self.stages_auto else self.dp

    @property
    def cuts(self) -> tuple[tuple[int, int], ...]:
        """The token slices as [start, end) ranges. With AUTO and no cost model, AUTO_SLICE_COUNT
        equal slices (with one, the optimiser replaces them)."""
        if self.slices_auto:
            return equal_slices(min(AUTO_SLICE_COUNT, self.seq_len), self.seq_len)
        if isinstance(self.slices, int):
            return equal_slices(self.slices, self.seq_len)
        return ranges_of(self.slices)


_NEEDS_COSTS = ("give --cost FILE (from `tpc profile`) or --device-model v100|a100|h100|h200|SPEC.json")


def _positive(option: str, value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _error(option, f"{option} must be a positive whole number, got {value!r}", f"give {what}")
    return value


def _check_options(o: CompileOptions) -> None:
    """Every option checked against the others; nothing here needs the model."""
    try:
        object.__setattr__(o, "comm", CommRules.of(o.comm))  # a spelling read once, here
    except ValueError:
        raise _error("--comm", f"unknown communication rules {o.comm!r}",
                     "choose " + " or ".join(f"{k} ({v})" for k, v in COMMS.items())) from None
    if not o.stages_auto:
        _positive("--stages", o.stages, "the number of pipeline stages, e.g. --stages 2")
    if o.microbatches != AUTO:
        _positive("--microbatches", o.microbatches, "the number of micro-batches per step, e.g. --microbatches 4")
    L = _positive("--seq-len", o.seq_len, "the training sequence length, e.g. --seq-len 128")
    B = _positive("--batch", o.batch, "the global batch size in sequences, e.g. --batch 8")
    D = _positive("--dp", o.dp, "the number of data-parallel replicas, e.g. --dp 1")
    R = _positive("--ranks", o.ranks, "the total number of ranks") if o.ranks is not None else None
    V = _positive("--virtual-stages", o.virtual_stages, "the stages each pipeline rank holds, e.g. --virtual-stages 2")
    if o.recompute not in RECOMPUTE:
        raise _error("--recompute", f"--recompute {o.recompute!r} is not a choice",
                     "use none, full or auto (auto needs --memory-per-rank and a cost model)")
    if o.memory_per_rank is not None and not o.memory_per_rank > 0:
        raise _error("--memory-per-rank", f"--memory-per-rank must be positive, got {o.memory_per_rank}",
                     "give a memory size, e.g. 16GiB")
    costs = o.searching
    if o.stages_auto:
        if not costs:
            raise _error("--stages", "--stages auto compares pipeline depths by their predicted "
                         "step time, which needs a cost model", f"{_NEEDS_COSTS}, or give the number of stages")
        if R is None:
            raise _error("--stages", "--stages auto needs the number of ranks to split into "
                         "pipeline x data", "give --ranks N, e.g. --stages auto --ranks 4")
        if D != 1:
            raise _error("--dp", f"--dp {D} with --stages auto: the search chooses the "
                         "data-parallel degree", "leave out --dp (the search splits --ranks)")
        if V != 1:
            raise _error("--virtual-stages", f"--virtual-stages {V} with --stages auto: the search "
                         "places one stage per rank", "give --stages, or leave out --virtual-stages")
    if not o.stages_auto and stages_per_rank(o.schedule) == 2 and o.stages % 2:
        raise _error("--stages", f"schedule {o.schedule!r} runs a V: stage i and stage 2p-1-i on "
                     f"rank i, two stages on each of p ranks, so it needs an even number of "
                     f"stages, not {o.stages}",
                     f"use --stages {o.stages + 1} (on {(o.stages + 1) // 2} ranks) or "
                     f"--stages {max(2, o.stages - 1)}")
    if not o.stages_auto and stages_per_rank(o.schedule) == 2 and V != 1:
        raise _error("--virtual-stages", f"schedule {o.schedule!r} puts two stages on each rank "
                     "in a V by itself", "leave out --virtual-stages")
    if R is not None and not o.stages_auto and stages_per_rank(o.schedule) == 2 and R != (o.stages // 2) * D:
        raise _error("--ranks", f"--ranks {R} does not match --stages {o.stages} / 2 (two stages per "
                     f"rank) x --dp {D} = {(o.stages // 2) * D}",
                     "leave out --ranks, or make it pipeline ranks x dp")
    if replicas(o.schedule) > 1 and V != 1:
        raise _error("--virtual-stages", f"schedule {o.schedule!r} puts one stage of each of its two "
                     "pipelines on every rank by itself", "leave out --virtual-stages")
    if replicas(o.schedule) > 1 and R is not None and not o.stages_auto and R != o.stages * D:
        raise _error("--ranks", f"--ranks {R} does not match --stages {o.stages} x --dp {D} = "
                     f"{o.stages * D}: schedule {o.schedule!r} runs each stage on two ranks, one per "
                     "pipeline direction, and every rank holds one stage of each",
                     "leave out --ranks, or make it stages x dp")
    if R is not None and not o.stages_auto:
        K = o.stages
        if V != 1 and R != K * D:
            raise _error("--ranks", f"--ranks {R} does not match --stages {K} x --dp {D} = {K * D} "
                         f"(--virtual-stages {V} puts {V} stages on each of the {K} pipeline ranks)",
                         "leave out --ranks, or make it stages x dp")
        if V == 1 and (R % D or K % (R // D)):
            raise _error("--ranks", f"--ranks {R} does not match --stages {K} x --dp {D} = {K * D}, nor "
                         f"puts several stages on each pipeline rank (--ranks / --dp dividing the stages)",
                         f"leave out --ranks, or give {K * D}, or p x {D} with p dividing {K} "
                         f"(--stages {K} --ranks {(K // 2 or 1) * D} puts 2 stages on each rank)")
    if o.chunks > 1 and costs and stages_per_rank(o.schedule) == 1:
        raise _error("--virtual-stages" if V != 1 else "--ranks",
                     f"{o.chunks} stages per pipeline rank with a cost model: the plan search "
                     "places one stage per rank",
                     "leave out --cost / --device-model and give the slices and micro-batches, "
                     "or one stage per rank")
    if o.recompute == "auto" and (not costs or o.memory_per_rank is None):
        raise _error("--recompute", "--recompute auto chooses per stage what to recompute to fit "
                     "--memory-per-rank, priced by a cost model",
                     f"give --memory-per-rank SIZE and {_NEEDS_COSTS}; or --recompute none|full")
    K, D = o.pipe, o.data
    if B % D:
        raise _error(
            "--batch",
            f"a batch of {B} sequences does not split evenly over {D} data-parallel replicas",
            f"make --batch a multiple of --dp {D} (e.g. {B - B % D or D} or {B - B % D + D})",
        )
    rows = B // D
    M = o.microbatch_count
    if M is not None and M > rows:
        raise _error(
            "--microbatches",
            f"{M} micro-batches but each replica has only {rows} sequence(s) (--batch {B} / --dp {D})",
            f"use at most {rows} micro-batches, or a larger --batch",
        )
    if o.schedule_auto:
        if not costs:
            raise _error("--schedule", "--schedule auto compares schedules by their simulated "
                         "step time, which needs a cost model",
                         f"{_NEEDS_COSTS}, or name a schedule: {', '.join(sorted(SCHEDULES))}")
    elif o.schedule not in SCHEDULES:
        raise _error("--schedule", f"unknown schedule {o.schedule!r}", f"choose one of: {', '.join(sorted(SCHEDULES))}")
    check_slices(o.slices, L)
    if M is None and not (o.slices_auto and costs):
        raise _error("--microbatches", "--microbatches auto lets the optimiser's batch knapsack "
                     "choose micro-batch sizes together with their token slices",
                     f"add --slices auto and {_NEEDS_COSTS}, or give the number of micro-batches")


def microbatch_sizes(rows: int, count: int) -> list[int]:
    """`rows` split into `count` sizes that differ by at most one (larger first)."""
    base, extra = divmod(rows, count)
    return [base + 1 if m < extra else base for m in range(count)]


# --------------------------------------------------------------------------- the header


def stage_label(labels, lo: int, hi: int) -> str:
    """"first .. last" unit labels of units [lo, hi) (just the one when it is a single unit)."""
    first, last = labels[lo], labels[hi - 1]
    return first if hi - lo == 1 else f"{first} .. {last}"


def build_header(
    *,
    model_path: str,
    sha256: str,
    factory: str,
    opts: CompileOptions,
    vocab: int,
    unit_labels,
    ranges,
    ties,
    pipe: int | None = None,
    data: int | None = None,
    schedule: str | None = None,
) -> Header:
    """The plan header; stage s runs on pipeline rank s, or for a V-shaped schedule stages s and
    2p-1-s on rank s (`placement.vshape`). Ties within one stage are dropped: a parameter used
    by one stage only needs no reduction between stages. `pipe`, `data` and `schedule` override
    the options' (the plan search's candidates)."""
    pipe = opts.pipe if pipe is None else pipe
    data = opts.data if data is None else data
    schedule = opts.schedule if schedule is None else schedule
    ranks = vshape(len(ranges), pipe) if stages_per_rank(schedule) == 2 else range(len(ranges))
    stages = tuple(
        Stage(index=s, rank=r, units=(lo, hi), label=stage_label(unit_labels, lo, hi))
        for s, ((lo, hi), r) in enumerate(zip(ranges, ranks))
    )
    tie_lines = tuple(
        Tie(name=name, stages=tuple(sorted(set(st)))) for name, st in ties if len(set(st)) > 1
    )
    # with --microbatches auto the search replaces this placeholder of one micro-batch
    sizes = microbatch_sizes(opts.batch // data, opts.microbatch_count or 1)
    return with_replicas(Header(
        model=ModelLine(path=model_path, sha256=sha256, factory=factory),
        shape=ShapeLine(batch=opts.batch, seq=opts.seq_len, vocab=vocab, dtype="float32"),
        mesh=MeshLine(pipe=pipe, data=data),
        schedule=ScheduleLine(name=schedule),
        units=UnitsLine(count=len(unit_labels)),
        stages=stages,
        ties=tie_lines,
        microbatches=tuple(Microbatch(index=m, size=n, slices=opts.cuts) for m, n in enumerate(sizes)),
    ))


def header_maker(*, model_path: str, sha256: str, factory: str, opts: CompileOptions, vocab: int, sliced):
    """`make(pipe, data, ranges, schedule, microbatches=None) -> Header` for this model: the
    header of any candidate the plan search builds (ties follow the partition; without
    `microbatches`, the equal ones of `opts`)."""
    import dataclasses

    def make(pipe: int, data: int, ranges, schedule: str, microbatches=None) -> Header:
        h = build_header(
            model_path=model_path, sha256=sha256, factory=factory, opts=opts, vocab=vocab,
            unit_labels=sliced.unit_labels, ranges=ranges, ties=sliced.ties(ranges),
            pipe=pipe, data=data, schedule=schedule,
        )  # fmt: skip
        return h if microbatches is None else with_replicas(dataclasses.replace(h, microbatches=tuple(microbatches)))

    return make


def slicing_summary(header: Header) -> str:
    """"2 micro-batches x 4 slices", or the total when micro-batches are cut differently."""
    counts = [len(m.slices) for m in header.microbatches]
    if len(set(counts)) == 1:
        return f"{len(counts)} micro-batches x {counts[0]} slices"
    return f"{len(counts)} micro-batches, {sum(counts)} slices"


# ------------------------------------------------------------------------------ --slices auto


def auto_slices_without_costs(opts: CompileOptions, progress) -> None:
    """`--slices auto` with no cost model: the equal slices of `opts.cuts`, said in one line
    (with a cost model the plan search chooses them)."""
    progress.say(
        f"--slices auto: {len(opts.cuts)} equal slices of ~{opts.seq_len // len(opts.cuts)} "
        "tokens (give --cost or --device-model for the optimiser's choice)"
    )


def cost_source_for(model, sliced, vocab: int, sha256: str, *, cost, device_model):
    """The CostSource --cost / --device-model name: cost models for any stage partition of
    this model. A device model prices the traced graph's own FLOPs, bytes and kernels
    (costmodel/graph.py), so any model the front end captures can be priced."""
    from tpc.compiler.costmodel.resolve import load_cost_source

    return load_cost_source(cost=cost, device_model=device_model, sliced=sliced if device_model else None,
                            num_units=sliced.num_units, model_sha256=sha256 if cost else None)


def search_space(opts: CompileOptions, num_units: int, split=None):
    """What the plan search may choose (compiler/search.py): the meshes of --stages auto
    --ranks N or the given one, every schedule or the given one, the optimiser's slicing or
    the given slices. `split` (pipe, data, ranges) fixes the mesh and the stage partition."""
    from tpc.compiler.search import AUTO_SCHEDULES, Space, meshes_for_ranks

    if opts.stages_auto:
        meshes, skipped = meshes_for_ranks(opts.ranks, num_units, opts.batch, opts.microbatch_count or 1)
        if not meshes:
            raise _error(
                "--stages",
                f"no pipeline x data split of --ranks {opts.ranks} fits: " + "; ".join(skipped),
                "change --ranks, --batch or --microbatches",
            )
    else:
        meshes, skipped = [(opts.pipe, opts.dp)], []
    return Space(
        seq_len=opts.seq_len, batch=opts.batch, microbatches=opts.microbatch_count,
        meshes=tuple(meshes), schedules=AUTO_SCHEDULES if opts.schedule_auto else (opts.schedule,),
        # with --recompute auto the budget is met by recomputation after the search
        slices=None if opts.slices_auto else opts.cuts,
        budget=None if opts.recompute == "auto" else opts.memory_per_rank,
        skipped=tuple(skipped),
        ranges=None if split is None else tuple(split[2]),
        comm=opts.comm,
    )  # fmt: skip


def search_header(opts: CompileOptions, source, make_header, progress, split=None) -> Header:
    """The header of the plan the search chooses among what the 'auto' options leave open;
    with nothing open, the given plan on the cost-balanced partition (on `split`'s, when given)."""
    from tpc.compiler.search import explain as explain_search
    from tpc.compiler.search import search_plan

    space = search_space(opts, source.num_units, split)
    with progress.step("search") as d:
        result = search_plan(source, space, make_header)
        best = result.best
        d.append(f"{len(result.candidates)} candidates; {best.pipe}x{best.data} {best.schedule}, "
                 f"predicted step {best.time:.4g} s")
    if opts.explain:
        progress.say(explain_search(result))
    return best.header


# ------------------------------------------------------------------------------ progress


class _Progress:
    """Short progress lines with timings on stderr (stdout keeps the summary)."""

    def __init__(self, quiet: bool):
        self.quiet = quiet

    def say(self, text: str) -> None:
        if not self.quiet:
            print(text, file=sys.stderr, flush=True)

    @contextmanager
    def step(self, name: str):
        start = time.perf_counter()
        detail: list[str] = []
        yield detail
        took = time.perf_counter() - start
        self.say(f"  {name:<10} {took:6.2f}s  {' '.join(detail)}".rstrip())


# ------------------------------------------------------------------------------ compile


def compile_plan(model_path: str, options: CompileOptions, split=None) -> Plan:
    """Compile `model_path` into a verified plan (see the module docstring). `split`, a
    (pipe, data, stage unit ranges) triple, fixes the mesh and the stage partition (the plans
    of a bundle share one); the rest is chosen as the options say."""
    from tpc.compiler.lower import lower
    from tpc.ir.verify import check

    opts = options
    progress = _Progress(opts.quiet)
    unused = [o for o, v in (("--memory-per-rank", opts.memory_per_rank), ("--explain", opts.explain)) if v]
    if unused and not opts.searching:
        progress.say(f"note: {', '.join(unused)} serve(s) only the plan search, which needs "
                     "--cost or --device-model; ignored")

    with progress.step("trace") as d:
        from tpc.compiler.frontend import SlicedModel, file_sha256, load_model, read_vocab

        model = load_model(model_path, opts.factory)
        sha = file_sha256(model_path)
        vocab = read_vocab(model, model_path)
        # the numeric self-check runs below, with the plan's own slices
        sliced = SlicedModel.from_model(model, seq_len=opts.seq_len, vocab=vocab, check_slices=None)
        d.append(f"{sliced.num_units} units, vocab {vocab}")
    if not opts.stages_auto and opts.num_stages > sliced.num_units:
        raise _error(
            "--virtual-stages" if opts.virtual_stages > 1 else "--stages",
            f"{opts.num_stages} stages but the model has only {sliced.num_units} partition units",
            f"use at most {sliced.num_units} stages",
        )

    make_header = header_maker(model_path=model_path, sha256=sha, factory=opts.factory, opts=opts,
                               vocab=vocab, sliced=sliced)  # fmt: skip
    if opts.searching:
        # a cost model is named: the partition comes from its unit times, and whatever is
        # 'auto' is chosen by simulated step time
        source = cost_source_for(model, sliced, vocab, sha, cost=opts.cost, device_model=opts.device_model)
        header = search_header(opts, source, make_header, progress, split)
    else:
        source = None
        with progress.step("partition") as d:
            ranges = ([tuple(r) for r in split[2]] if split is not None
                      else [tuple(r) for r in sliced.partition_by_params(opts.num_stages)])
            d.append(" | ".join(f"{lo}:{hi}" for lo, hi in ranges))
        if opts.chunks > 1 and stages_per_rank(opts.schedule) == 1:
            header = place_chunks(make_header(opts.num_stages, opts.dp, ranges, opts.schedule), opts.pipe)
        else:
            header = make_header(opts.pipe, opts.dp, ranges, opts.schedule)
        if opts.slices_auto:
            auto_slices_without_costs(opts, progress)
    eval_mbs = header.microbatches
    if opts.searching:  # the evaluation's own micro-batches and slices: the DP without backward
        from tpc.compiler.evaluation import eval_slicing

        with progress.step("eval DP") as d:
            eval_mbs = eval_slicing(source.for_stages([st.units for st in header.stages]), header,
                                    microbatches=opts.microbatch_count)
            d.append(slicing_summary(dataclasses.replace(header, microbatches=eval_mbs)))
    with progress.step("self-check") as d:
        check_plan_slices(sliced, header, eval_mbs)
        d.append(f"{len(_slicings(header, eval_mbs))} slicing(s) at length {opts.seq_len}")
    with progress.step("schedule") as d:
        compute = build_schedule(header.schedule.name, header)
        d.append(f"{header.schedule.name}: {slicing_summary(header)}")
    if opts.recompute != "none":
        compute = recompute_stages(header, compute, opts, source, progress)
    with progress.step("lower") as d:
        plan = lower(header, compute, verify=False, comm=opts.comm)  # verified next, on its own
        d.append(f"{sum(len(p.instrs) for p in plan.ranks)} instructions")
    with progress.step("eval") as d:
        from tpc.compiler.evaluation import eval_program

        plan = dataclasses.replace(plan, eval=eval_program(header, eval_mbs, opts.comm))
        d.append(f"forward only, {sum(len(p.instrs) for p in plan.eval.ranks)} instructions")
    with progress.step("verify") as d:
        check(plan, opts.comm)
        d.append(f"under {opts.comm}'s rules")
    return plan


def place_chunks(header: Header, pipe: int) -> Header:
    """`header`'s stages on `pipe` pipeline ranks, several per rank, in the placement its
    schedule is made for (stage s on rank s mod pipe for the looped ones); a schedule made for
    one stage per rank is refused at --virtual-stages."""
    from tpc.compiler.schedules import placement_of
    from tpc.compiler.schedules.placement import PLACEMENTS, place

    name = header.schedule.name
    return place(header, PLACEMENTS[placement_of(name)](header.num_stages, pipe))


def recompute_stages(header: Header, compute, opts: CompileOptions, source, progress):
    """`--recompute full`: every stage's forwards checkpointed and recomputed before their
    backward; `auto`: the stage-aware planner's choice under --memory-per-rank
    (compiler/recompute.py), said in one line (and with --explain, each rank's peak)."""
    from tpc.compiler import recompute

    with progress.step("recompute") as d:
        if opts.recompute == "auto":
            costs = source.for_stages([st.units for st in header.stages])
            before = recompute.peaks(header, compute, costs)
            choice = recompute.choose(header, compute, costs, opts.memory_per_rank)
        else:
            choice = recompute.uniform(header, opts.recompute)
        out = recompute.apply(compute, choice)
        full = [s for s, c in sorted(choice.items()) if c == "full"]
        d.append(f"{opts.recompute}: " + (f"stage{'s' * (len(full) != 1)} {', '.join(map(str, full))} recomputed"
                                          if full else "nothing recomputed"))
    if opts.recompute == "auto" and opts.explain:
        after = recompute.peaks(header, out, costs)
        from tpc.compiler.quantities import format_quantity

        def fmt(n):
            return format_quantity(n, costs.memory_unit)

        lines = [f"recompute auto, budget {fmt(opts.memory_per_rank)} per rank (stage-aware: the stage "
                 "of a rank over budget whose recomputation lowers its peak most, until it fits):"]
        for r in sorted(before):
            stages = sorted(header.stages_of_rank(r))
            lines.append(f"  rank {r}: stages {', '.join(map(str, stages))}: peak {fmt(before[r])} -> {fmt(after[r])}"
                         f"; recomputed: {', '.join(str(s) for s in stages if choice[s] == 'full') or 'none'}")
        progress.say("\n".join(lines))
    return out


def _slicings(header: Header, extra=()) -> list[tuple[int, ...]]:
    """The distinct slice lengths of the plan's micro-batches (and of `extra` ones)."""
    out: list[tuple[int, ...]] = []
    for mb in (*header.microbatches, *extra):
        lens = tuple(hi - lo for lo, hi in mb.slices)
        if lens not in out:
            out.append(lens)
    return out


def check_plan_slices(sliced, header: Header, extra=()) -> None:
    """The front end's numeric self-check (sliced vs unsliced model at the full length) with
    each slicing the plan uses (`extra`: the evaluation's micro-batches): what the plan will
    run is what is checked."""
    for lens in _slicings(header, extra):
        sliced.check_slicing(list(lens))


def compile_to_file(model_path: str, output: str, options: CompileOptions) -> Plan:
    """Compile, write the plan to `output` atomically, and return it. The written text is read
    back, parsed and verified before it replaces `output`."""
    return write_plan(compile_plan(model_path, options), output, quiet=options.quiet,
                      comm=options.comm)


def write_plan(plan: Plan, output: str, *, quiet: bool = False, comm: CommRules = DEFAULT_COMM) -> Plan:
    """Write a verified plan to `output` atomically: the text is read back, parsed and verified
    (under the communication rules `comm`, those it was compiled for) before it replaces `output`. Says what was written unless
    `quiet`."""
    from tpc.ir.parse import parse
    from tpc.ir.printer import print_plan
    from tpc.ir.verify import check

    text = print_plan(plan)
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise _error("--output", f"no such folder: {folder}", "create the folder first, or write the plan elsewhere")
    fd, tmp = tempfile.mkstemp(prefix=".tpir-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        with open(tmp, encoding="utf-8") as f:
            written = f.read()
        check(parse(written, file=output), comm)
        os.replace(tmp, output)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if not quiet:
        h = plan.header
        n = sum(len(p.instrs) for p in plan.ranks)
        print(
            f"wrote {output}: {h.num_stages} stage{'s' * (h.num_stages != 1)}"
            f"{f' ({h.replicas} weight replicas each)' if h.replicas > 1 else ''} x "
            f"{h.mesh.data} data replica{'s' * (h.mesh.data != 1)}, "
            f"{slicing_summary(h)}, "
            f"schedule {h.schedule.name}, {n} instructions"
        )
    return plan
