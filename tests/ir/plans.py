"""Valid plans built in code, for tests of anything that reads plans.

`simple_plan(pipe, mbs, slices, ...)` builds a correct GPipe-like plan: per rank, every forward
in (micro-batch, slice) order, then every backward in reverse slice order, lowered the simplest
correct way (a receive just before the compute that needs it, a send just after the compute that
makes it; consecutive stages on one rank pass activations locally). `random_plan()` is a
hypothesis strategy drawing such plans over the whole option space, with random comments.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from tpc.compiler.optimise.slicing import ranges_of
from tpc.ir.nodes import (
    Header,
    Instr,
    Line,
    MeshLine,
    Microbatch,
    ModelLine,
    Op,
    Payload,
    Plan,
    RankProgram,
    ScheduleLine,
    ShapeLine,
    Stage,
    Tie,
    UnitsLine,
)

SHA = "0" * 64
TIE_NAME = "transformer.wte.weight"


def _slice_lengths(slices, mbs: int, seq: int | None) -> list[tuple[int, ...]]:
    """Per micro-batch slice lengths from an int (equal), one list (all mbs) or one per mb."""
    if isinstance(slices, int):
        seq = seq if seq is not None else 4 * slices
        base, extra = divmod(seq, slices)
        lengths = tuple(base + (1 if i < extra else 0) for i in range(slices))
        return [lengths] * mbs
    slices = list(slices)
    if slices and isinstance(slices[0], int):
        return [tuple(slices)] * mbs
    if len(slices) != mbs:
        raise ValueError(f"{len(slices)} slice lists for {mbs} micro-batches")
    return [tuple(s) for s in slices]


def stage_ranks(stages: int, pipe: int) -> tuple[int, ...]:
    """Contiguous blocks: stage s on rank s * pipe // stages (consecutive stages share a rank)."""
    if stages < pipe:
        raise ValueError(f"{stages} stages cannot fill {pipe} ranks")
    return tuple(s * pipe // stages for s in range(stages))


def simple_header(pipe: int, mbs: int, slices, *, stages: int | None = None, data: int = 1,
                  seq: int | None = None, mb_size: int = 1, tie: bool = False,
                  schedule: str = "gpipe", vocab: int = 32) -> Header:
    stages = pipe if stages is None else stages
    lengths = _slice_lengths(slices, mbs, seq)
    seqs = {sum(ls) for ls in lengths}
    if len(seqs) != 1:
        raise ValueError(f"micro-batches cover different sequence lengths: {sorted(seqs)}")
    ranks = stage_ranks(stages, pipe)
    return Header(
        model=ModelLine("examples/gpt.py", SHA, "model"),
        shape=ShapeLine(batch=mbs * mb_size * data, seq=seqs.pop(), vocab=vocab),
        mesh=MeshLine(pipe=pipe, data=data),
        schedule=ScheduleLine(schedule),
        units=UnitsLine(stages),
        stages=tuple(Stage(s, ranks[s], (s, s + 1), f"unit {s}") for s in range(stages)),
        # a tie within one rank is summed locally and has no line (the verifier says so)
        ties=(Tie(TIE_NAME, (0, stages - 1)),) if tie and ranks[0] != ranks[-1] else (),
        microbatches=tuple(Microbatch(m, mb_size, ranges_of(lengths[m])) for m in range(mbs)),
    )


def _rank_stream(h: Header, rank: int, checkpoint: bool, split_backward: bool) -> list[Instr]:
    K = h.num_stages
    mine = h.stages_of_rank(rank)
    owner = [s.rank for s in h.stages]
    loads = 0 in mine or K - 1 in mine
    out: list[Instr] = []
    # forwards: micro-batch by micro-batch, slice by slice, through this rank's stages
    for m, mb in enumerate(h.microbatches):
        if loads:
            out.append(Instr(Op.LOAD, mb=m))
        for i in range(len(mb.slices)):
            for s in mine:
                if s > 0 and owner[s - 1] != rank:
                    out.append(Instr(Op.RECV, payload=Payload.ACT, stage=s, mb=m, slice=i,
                                     peer=owner[s - 1]))
                out.append(Instr(Op.FORWARD, stage=s, mb=m, slice=i, checkpoint=checkpoint))
                if s < K - 1 and owner[s + 1] != rank:
                    out.append(Instr(Op.SEND, payload=Payload.ACT, stage=s, mb=m, slice=i,
                                     peer=owner[s + 1]))
    # backwards: micro-batch by micro-batch, slices in reverse token order, stages in reverse
    back = Op.BACKWARD_INPUT if split_backward else Op.BACKWARD
    for m, mb in enumerate(h.microbatches):
        n = len(mb.slices)
        for i in reversed(range(n)):
            for s in reversed(mine):
                if s < K - 1 and owner[s + 1] != rank:
                    out.append(Instr(Op.RECV, payload=Payload.GRAD, stage=s, mb=m, slice=i,
                                     peer=owner[s + 1]))
                if checkpoint:
                    out.append(Instr(Op.RECOMPUTE, stage=s, mb=m, slice=i))
                out.append(Instr(back, stage=s, mb=m, slice=i))
                if s > 0 and owner[s - 1] != rank:
                    out.append(Instr(Op.SEND, payload=Payload.GRAD, stage=s, mb=m, slice=i,
                                     peer=owner[s - 1]))
        for s in reversed(mine):
            if split_backward:
                out += [Instr(Op.BACKWARD_WEIGHT, stage=s, mb=m, slice=i) for i in reversed(range(n))]
            out.append(Instr(Op.FREE_KV, stage=s, mb=m))
    if h.mesh.data > 1:
        out += [Instr(Op.ALLREDUCE, stage=s) for s in mine]
    for t in h.ties:
        if set(t.stages) & set(mine):
            out.append(Instr(Op.REDUCE_TIED, tie=t.name))
    out.append(Instr(Op.STEP))
    return out


def simple_plan(pipe: int, mbs: int, slices: int | Sequence[int] | Sequence[Sequence[int]], *,
                stages: int | None = None, data: int = 1, seq: int | None = None,
                mb_size: int = 1, tie: bool = False, checkpoint: bool = False,
                split_backward: bool = False, schedule: str = "gpipe") -> Plan:
    """A valid GPipe-like plan.

    pipe: pipeline ranks; mbs: micro-batches; slices: slices per micro-batch (equal lengths of
    `seq`, default 4 tokens each), or the lengths (one list for all micro-batches, or one per
    micro-batch); stages: defaults to one per rank, more put consecutive stages on one rank;
    data: data-parallel replicas (adds an allreduce per stage); tie: tie the first and the last
    stage (when they are on different ranks); checkpoint: checkpointed forwards, recomputed
    before each backward; split_backward: backward-input, then after each micro-batch
    backward-weight.
    """
    h = simple_header(pipe, mbs, slices, stages=stages, data=data, seq=seq, mb_size=mb_size,
                      tie=tie, schedule=schedule)
    ranks = tuple(RankProgram(r, tuple(_rank_stream(h, r, checkpoint, split_backward)))
                  for r in range(pipe))
    return Plan(header=h, ranks=ranks)


# ------------------------------------------------------------------------------ hypothesis

# Comment text as the parser returns it: one line, no trailing blanks (canonical form drops them).
comment_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"),
    max_size=20,
).map(str.rstrip)

# Strings a plan may hold in quotes (quote() escapes '"' and '\\'; a line break cannot be quoted).
plan_string = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"),
    max_size=12,
)


@st.composite
def slice_lengths(draw, seq: int, max_slices: int = 3) -> tuple[int, ...]:
    """A random composition of `seq` into at most `max_slices` positive lengths."""
    k = draw(st.integers(1, min(max_slices, seq)))
    cuts = sorted(draw(st.sets(st.integers(1, seq - 1), min_size=k - 1, max_size=k - 1))) if k > 1 else []
    bounds = [0, *cuts, seq]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


@st.composite
def _with_comments(draw, line: Line) -> Line:
    comments = tuple(draw(st.lists(comment_text, max_size=2)))
    note = draw(st.one_of(st.none(), comment_text))
    return line.with_trivia(comments=comments, note=note)


@st.composite
def random_plan(draw, max_pipe: int = 3, max_mbs: int = 3, max_slices: int = 3,
                comments: bool = True) -> Plan:
    """A valid plan (see `simple_plan`) with random sizes, options, strings and comments."""
    pipe = draw(st.integers(1, max_pipe))
    stages = draw(st.integers(pipe, pipe + 1))
    mbs = draw(st.integers(1, max_mbs))
    seq = draw(st.integers(1, 12))
    lengths = [draw(slice_lengths(seq, max_slices)) for _ in range(mbs)]
    plan = simple_plan(
        pipe, mbs, lengths, stages=stages,
        data=draw(st.integers(1, 2)),
        mb_size=draw(st.integers(1, 2)),
        tie=draw(st.booleans()),
        checkpoint=draw(st.booleans()),
        split_backward=draw(st.booleans()),
        schedule=draw(plan_string),
    )
    h = plan.header
    h = Header(
        model=ModelLine(draw(plan_string), SHA, draw(plan_string)),
        shape=h.shape, mesh=h.mesh, schedule=h.schedule, units=h.units,
        stages=tuple(Stage(s.index, s.rank, s.units, draw(plan_string)) for s in h.stages),
        ties=h.ties, microbatches=h.microbatches,
    )
    plan = Plan(header=h, ranks=plan.ranks)
    if not comments:
        return plan
    return with_random_comments(draw, plan)


def with_random_comments(draw, plan: Plan) -> Plan:
    """`plan` with comments drawn for every line (above it and at its end) and at the end."""
    h = plan.header
    c = lambda line: draw(_with_comments(line))  # noqa: E731
    header = Header(
        model=c(h.model), shape=c(h.shape), mesh=c(h.mesh), schedule=c(h.schedule),
        units=c(h.units), stages=tuple(map(c, h.stages)), ties=tuple(map(c, h.ties)),
        microbatches=tuple(map(c, h.microbatches)), version=h.version,
        version_comments=tuple(draw(st.lists(comment_text, max_size=2))),
        version_note=draw(st.one_of(st.none(), comment_text)),
    )
    ranks = tuple(
        c(RankProgram(r.rank, tuple(c(i) for i in r.instrs))) for r in plan.ranks
    )
    return Plan(header=header, ranks=ranks,
                trailing_comments=tuple(draw(st.lists(comment_text, max_size=2))))


def trivia(plan: Plan) -> list[tuple]:
    """Every comment of a plan with the line it belongs to, in file order (equality ignores them)."""
    h = plan.header
    out: list[tuple] = [("tpir", h.version_comments, h.version_note)]
    for line in [h.model, h.shape, h.mesh, h.schedule, h.units, *h.stages, *h.ties,
                 *h.microbatches]:
        out.append((type(line).__name__, line.comments, line.note))
    for r in plan.ranks:
        out.append((f"rank {r.rank}", r.comments, r.note))
        out += [(str(i), i.comments, i.note) for i in r.instrs]
    out.append(("end", plan.trailing_comments))
    return out
