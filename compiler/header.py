"""The plan header of a compile: stages, ties, mesh and micro-batches from the options and the
front end's units (the `header` pass, the plan search's candidates and the schedule-CSV path all
build theirs here), and the numeric self-check of the slicings a header uses."""

from __future__ import annotations

import dataclasses

from tpc.compiler.optimise.slicing import even_split
from tpc.compiler.options import CompileOptions
from tpc.compiler.schedules import stages_per_rank, with_replicas
from tpc.compiler.schedules.placement import vshape
from tpc.ir.nodes import (
    DocumentsLine,
    Header,
    MeshLine,
    Microbatch,
    ModelLine,
    ScheduleLine,
    ShapeLine,
    Stage,
    Tie,
    UnitsLine,
)


def microbatch_sizes(rows: int, count: int) -> list[int]:
    """`rows` split into `count` sizes that differ by at most one (larger first)."""
    return list(even_split(rows, count))


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
    tensor: int | None = None,
) -> Header:
    """The plan header; stage s runs on pipeline rank s, or for a V-shaped schedule stages s and
    2p-1-s on rank s (`placement.vshape`). Ties within one stage are dropped: a parameter used
    by one stage only needs no reduction between stages. `pipe`, `data`, `schedule` and `tensor`
    override the options' (the plan search's candidates)."""
    pipe = opts.pipe if pipe is None else pipe
    data = opts.data if data is None else data
    tensor = opts.tensor_size if tensor is None else tensor
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
        mesh=MeshLine(pipe=pipe, data=data, tensor=tensor, sequence=opts.sequence_parallel and tensor > 1),
        schedule=ScheduleLine(name=schedule),
        units=UnitsLine(count=len(unit_labels)),
        stages=stages,
        ties=tie_lines,
        microbatches=tuple(Microbatch(index=m, size=n, slices=opts.cuts) for m, n in enumerate(sizes)),
        documents=documents_line(opts),
        random_ltd=random_ltd_line(opts),
    ))


def random_ltd_line(opts: CompileOptions):
    """The `random-ltd` line of `--random-ltd` (None without it)."""
    from tpc.compiler.random_ltd import to_line

    return None if opts.random_ltd is None else to_line(opts.random_ltd)


def documents_line(opts: CompileOptions) -> DocumentsLine | None:
    """The `documents` line of `--documents eos:ID` (mean: `--document-length`, else the row)."""
    if opts.documents is None:
        return None
    return DocumentsLine(eos=opts.documents, mean=opts.document_length or opts.seq_len)


def header_maker(*, model_path: str, sha256: str, factory: str, opts: CompileOptions, vocab: int, sliced):
    """`make(pipe, data, ranges, schedule, microbatches=None, tensor=None) -> Header` for this
    model: the header of any candidate the plan search builds (ties follow the partition; without
    `microbatches`, the equal ones of `opts`; without `tensor`, the options' tensor degree)."""

    def make(pipe: int, data: int, ranges, schedule: str, microbatches=None, tensor=None) -> Header:
        h = build_header(
            model_path=model_path, sha256=sha256, factory=factory, opts=opts, vocab=vocab,
            unit_labels=sliced.unit_labels, ranges=ranges, ties=sliced.ties(ranges),
            pipe=pipe, data=data, schedule=schedule, tensor=tensor,
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


def place_chunks(header: Header, pipe: int) -> Header:
    """`header`'s stages on `pipe` pipeline ranks, several per rank, in the placement its
    schedule is made for (stage s on rank s mod pipe for the looped ones); a schedule made for
    one stage per rank is refused at --virtual-stages."""
    from tpc.compiler.schedules import placement_of
    from tpc.compiler.schedules.placement import PLACEMENTS, place

    name = header.schedule.name
    return place(header, PLACEMENTS[placement_of(name)](header.num_stages, pipe))


def slicings(header: Header, extra=()) -> list[tuple[int, ...]]:
    """The distinct slice lengths of the plan's micro-batches (and of `extra` ones)."""
    out: list[tuple[int, ...]] = []
    for mb in (*header.microbatches, *extra):
        lens = tuple(hi - lo for lo, hi in mb.slices)
        if lens not in out:
            out.append(lens)
    return out


def check_plan_slices(sliced, header: Header, extra=()):
    """The front end's numeric self-check (sliced vs unsliced model at the full length) with
    each slicing the plan uses (`extra`: the evaluation's micro-batches): what the plan will
    run is what is checked. Returns `check_slicings`' `UnitCheck` for a model built without
    weights, else None."""
    return sliced.check_slicings([list(lens) for lens in slicings(header, extra)])
