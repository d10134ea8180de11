"""`tpc show`: a plan drawn as a steps x ranks grid for a terminal.

One column per pipeline rank, one row per step, where step n of a rank is the n-th compute
instruction of its stream (an order, not a time: the simulator draws times). Communication,
loads and KV-cache frees are left out so that the compute order, which is what a schedule
chooses, can be read at a glance; the legend under the grid says so.

A rank that holds several stages (the chunks of an interleaved or V-shaped schedule) is titled
with them, `rank 0 [0,4]`, and its cells carry the chunk: `F4.0.1:c1` is stage 4, the rank's
chunk 1 (its stages in pipeline order are chunks 0, 1, ...). A plan whose stages go down the
ranks and come back up (the V of zbv and dualpipev, `directions`) is bidirectional: its cells
carry the direction instead, `F0.0.1:dn` on the way down, `F3.0.1:up` on the way back.
"""

from __future__ import annotations

from tpc.ir.nodes import Header, Instr, Op, Plan

# The short name of each instruction the grid shows; the rest are left out.
SHORT: dict[Op, str] = {
    Op.FORWARD: "F",
    Op.RECOMPUTE: "R",
    Op.BACKWARD: "B",
    Op.BACKWARD_INPUT: "Bi",
    Op.BACKWARD_WEIGHT: "Bw",
    Op.STEP: "step",
}

IDLE = "."  # a rank that has no more compute at this step
CLIPPED = "~"  # the last character of a cell cut to a narrower --width
GAP = "  "

LEGEND = (
    "F forward, R recompute, B backward, Bi backward-input, Bw backward-weight, as "
    "<op><stage>.<mb>.<slice>; * checkpointed; step optimizer step; . idle.\n"
    "Row n is each rank's n-th compute instruction (an order, not a time); send, recv, load, "
    "free-kv, allreduce and reduce-tied are not shown."
)
CHUNK_LEGEND = (
    "\nA rank holding several stages is titled with them, [0,4]; :c<k> marks its chunk k (its "
    "k-th stage in pipeline order)."
)


DIRECTION_LEGEND = (
    "\nThe stages go down the ranks and come back up (a V): :dn marks a stage of the way down, "
    ":up one of the way back; a rank titled [0,3] holds stage 0 (dn) and stage 3 (up)."
)


def directions(header: Header) -> dict[int, str] | None:
    """stage -> "dn" or "up" when the pipeline runs down the ranks and back up: the stages'
    ranks rise (never fall) to the first stage on the highest rank, then fall (never rise), and
    the last stage is back on the first's rank. None for any other placement (one direction)."""
    ranks = [st.rank for st in header.stages]
    if len(ranks) < 2 or ranks[0] != ranks[-1] or len(set(ranks)) < 2:
        return None
    turn = ranks.index(max(ranks))
    rising = all(a <= b for a, b in zip(ranks[:turn + 1], ranks[1:turn + 1]))
    falling = all(a >= b for a, b in zip(ranks[turn:], ranks[turn + 1:]))
    if not (rising and falling):
        return None
    return {s: "dn" if s <= turn else "up" for s in range(len(ranks))}


BIDIRECTIONAL_LEGEND = (
    "\nTwo pipelines run in opposite directions over weight replicas (Chimera): :dn marks the "
    "work of a micro-batch of the down pipeline (replica 0), :up of the up pipeline (replica 1); a "
    "rank titled [0,3] holds a replica of stage 0 and of stage 3."
)


def direction_of(header: Header):
    """`instr -> "dn" | "up" | None`, the direction of an instruction's work in a bidirectional
    plan: by its stage in a V (`directions`), by its micro-batch's weight replica when the stages
    have replicas (Chimera: replica 0 runs down the ranks, replica 1 up); None for a plan of one
    direction."""
    if header.replicas > 1:
        return lambda i: None if i.mb is None else ("up" if header.microbatches[i.mb].replica else "dn")
    ways = directions(header)
    return None if ways is None else (lambda i: ways.get(i.stage))


def cell(instr: Instr, chunk: int | str | None = None) -> str:
    """`F0.1.2` is the forward of stage 0, micro-batch 1, slice 2; `F0.1.2*` checkpointed;
    `F4.1.2:c1` on a rank whose chunk 1 is stage 4."""
    short = SHORT[instr.op]
    if instr.op is Op.STEP:
        return short
    text = f"{short}{instr.stage}.{instr.mb}.{instr.slice}"
    text = text + "*" if instr.checkpoint else text
    if chunk is None:
        return text
    return f"{text}:{chunk}" if isinstance(chunk, str) else f"{text}:c{chunk}"


def _chunks(plan: Plan, rank: int) -> dict[int, int] | None:
    """stage -> chunk index on a rank holding several stages; None for one stage."""
    held = sorted(plan.header.stages_of_rank(rank))
    return {s: k for k, s in enumerate(held)} if len(held) > 1 else None


def columns(plan: Plan) -> list[list[str]]:
    """Per pipeline rank, the cells of its shown instructions in stream order."""
    out = []
    way = direction_of(plan.header)
    for program in plan.ranks:
        chunk = _chunks(plan, program.rank)
        out.append([cell(i, way(i) if way is not None else None if chunk is None or i.stage is None
                         else chunk.get(i.stage))
                    for i in program.instrs if i.op in SHORT])
    return out


def _title(plan: Plan, rank: int) -> str:
    chunk = _chunks(plan, rank)
    return f"rank {rank}" if chunk is None else f"rank {rank} [{','.join(map(str, chunk))}]"


def render_grid(plan: Plan, width: int = 0) -> str:
    """The grid, then the legend. Column width is the widest cell, or `width` when > 0."""
    cols = columns(plan)
    titles = [_title(plan, program.rank) for program in plan.ranks]
    rows = max((len(c) for c in cols), default=0)
    if width > 0:
        col_width = width
    else:
        col_width = max([len(t) for t in titles] + [len(c) for col in cols for c in col] + [1])
    step_width = max(len("step"), len(str(max(rows - 1, 0))))

    if width > 0 and any(len(t) > width for t in titles):
        titles = [f"r{program.rank}" for program in plan.ranks]  # narrow columns: short titles
    lines = [_row("step".rjust(step_width), titles, col_width)]
    for n in range(rows):
        cells = [col[n] if n < len(col) else IDLE for col in cols]
        lines.append(_row(str(n).rjust(step_width), cells, col_width))
    several = any(_chunks(plan, program.rank) for program in plan.ranks)
    marks = (BIDIRECTIONAL_LEGEND if plan.header.replicas > 1 else DIRECTION_LEGEND
             if directions(plan.header) else CHUNK_LEGEND if several else "")
    return "\n".join(lines) + "\n\n" + LEGEND + marks


def _fit(text: str, width: int) -> str:
    if len(text) <= width:
        return text.ljust(width)
    return text[: width - 1] + CLIPPED if width > 1 else text[:width]


def _row(step: str, cells: list[str], width: int) -> str:
    return GAP.join([step] + [_fit(c, width) for c in cells]).rstrip()
