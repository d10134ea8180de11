"""`tpc show`: a plan drawn as a steps x ranks grid for a terminal.

One column per pipeline rank, one row per step, where step n of a rank is the n-th compute
instruction of its stream (an order, not a time: the simulator draws times). Communication,
loads and KV-cache frees are left out so that the compute order, which is what a schedule
chooses, can be read at a glance; the legend under the grid says so.
"""

from __future__ import annotations

from tpc.ir.nodes import Instr, Op, Plan

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


def cell(instr: Instr) -> str:
    """`F0.1.2` is the forward of stage 0, micro-batch 1, slice 2; `F0.1.2*` checkpointed."""
    short = SHORT[instr.op]
    if instr.op is Op.STEP:
        return short
    text = f"{short}{instr.stage}.{instr.mb}.{instr.slice}"
    return text + "*" if instr.checkpoint else text


def columns(plan: Plan) -> list[list[str]]:
    """Per pipeline rank, the cells of its shown instructions in stream order."""
    return [[cell(i) for i in program.instrs if i.op in SHORT] for program in plan.ranks]


def render_grid(plan: Plan, width: int = 0) -> str:
    """The grid, then the legend. Column width is the widest cell, or `width` when > 0."""
    cols = columns(plan)
    titles = [f"rank {program.rank}" for program in plan.ranks]
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
    return "\n".join(lines) + "\n\n" + LEGEND


def _fit(text: str, width: int) -> str:
    if len(text) <= width:
        return text.ljust(width)
    return text[: width - 1] + CLIPPED if width > 1 else text[:width]


def _row(step: str, cells: list[str], width: int) -> str:
    return GAP.join([step] + [_fit(c, width) for c in cells]).rstrip()
