"""Timelines: the predicted trace of a simulation (`tpc simulate --trace`), its comparison with
a measured one (`tpc run --trace`, `tpc simulate --compare`), and the Gantt-chart picture.

Both traces are written and read by chrome_trace.py, in its one format. Under unit costs one
unit of time is written as 1 ms (`us_per_unit` 1000), so a unit-cost trace is readable in
Perfetto; `compare` fits the unit to the measurement instead.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from tpc.compiler.predict.chrome_trace import Flow, TimedInstr, trace_document, write_trace_file
from tpc.ir.files import atomic_path
from tpc.ir.nodes import COMPUTE_OPS, Op
from tpc.ir.semantics import message_key
from tpc.ir.show import direction_of

# --------------------------------------------------------------------------- Chrome trace


def us_per_unit(time_unit: str) -> float:
    """Microseconds per unit of simulated time: seconds, or 1 ms per abstract unit."""
    return 1e6 if time_unit == "s" else 1e3


def predicted_trace(result, plan_name: str = "") -> dict:
    """The trace of a simulation (chrome_trace.py), with an arrow per message."""
    scale = us_per_unit(result.time_unit)
    instrs = [TimedInstr(rank=e.rank, instr=str(e.instr), ts=e.start * scale,
                         dur=(e.end - e.start) * scale, step=0, line=e.line, index=e.index)
              for e in result.events]
    flows = [Flow(send.instr.payload.value, send.rank, send.start * scale, recv.rank,
                  (recv.end if recv.arrival is None else max(recv.end, recv.arrival)) * scale)
             for send, recv in message_pairs(result.events)]
    return trace_document(instrs, ranks=[p.rank for p in result.plan.ranks], flows=flows,
                          source="simulate", time_unit=result.time_unit, us_per_unit=scale,
                          plan=plan_name, schedule=result.plan.header.schedule.name)


def message_pairs(events) -> list[tuple]:
    """(send event, receive event) of every message, matched as the simulator matches them:
    by sender, receiver, payload, stage boundary, micro-batch and slice, first sent first
    received. In the order of the receives."""
    sends: dict[tuple, list] = {}
    for e in events:
        if e.instr.op is Op.SEND:
            sends.setdefault(message_key(e.rank, e.instr), []).append(e)
    pairs = []
    for e in events:
        if e.instr.op is Op.RECV:
            queue = sends.get(message_key(e.rank, e.instr))
            if queue:
                pairs.append((queue.pop(0), e))
    return pairs


def write_trace(result, path: str, plan_name: str = "") -> None:
    write_trace_file(path, predicted_trace(result, plan_name))


# ------------------------------------------------------------------------ predicted vs measured


@dataclass(frozen=True)
class Row:
    """One line of a comparison: a predicted and a measured time, in milliseconds."""

    what: str
    predicted: float
    measured: float

    @property
    def error(self) -> float:
        """Relative error of the prediction: (predicted - measured) / measured."""
        if self.measured == 0:
            return 0.0 if self.predicted == 0 else math.inf
        return (self.predicted - self.measured) / self.measured


@dataclass(frozen=True)
class Comparison:
    rows: tuple[Row, ...]
    # under unit costs, the milliseconds one unit was fitted to; None for a model in seconds
    ms_per_unit: float | None = None


def compare(result, measured: list[TimedInstr]) -> Comparison:
    """Predicted vs measured iteration time and per-rank compute time (forward, recompute,
    backward: what both sides time the same way; a measured receive includes its waiting).

    A measured trace may hold several steps; the first is warm-up, so with two or more steps
    the measured numbers are the means over the steps after the first.

    A prediction in seconds is compared as it is. Unit costs know no seconds, so one unit is
    fitted to the measurement: total measured compute / total predicted compute. The errors
    then say where the shape differs (a stage slower than its share, waiting the plan does not
    predict), not how fast the machine is."""
    steps = sorted({t.step for t in measured})
    if len(steps) > 1:
        steps = steps[1:]
    compute_ops = {op.value for op in COMPUTE_OPS}

    def per_step_ms(fn) -> float:
        return statistics.fmean(fn([t for t in measured if t.step == s]) for s in steps) / 1e3

    def span(ts):
        return max(t.ts + t.dur for t in ts) - min(t.ts for t in ts)

    measured_compute = [
        per_step_ms(lambda ts, r=r.rank: math.fsum(
            t.dur for t in ts if t.rank == r and t.op in compute_ops))
        for r in result.ranks
    ]
    fitted = None
    if result.time_unit == "s":
        ms = 1e3
    else:
        predicted_total = math.fsum(r.compute for r in result.ranks)
        fitted = math.fsum(measured_compute) / predicted_total if predicted_total > 0 else 1.0
        ms = fitted
    rows = [Row("iteration time", result.iteration_time * ms, per_step_ms(span))]
    rows += [Row(f"rank {r.rank} compute", r.compute * ms, m)
             for r, m in zip(result.ranks, measured_compute)]
    return Comparison(tuple(rows), fitted)


def format_comparison(comparison: Comparison) -> str:
    """The rows as a table in milliseconds, the relative error as a percentage."""
    out = [f"{'':<18}{'predicted':>14}{'measured':>14}{'error':>9}"]
    for row in comparison.rows:
        err = "n/a" if math.isinf(row.error) else f"{row.error:+.1%}"
        out.append(f"{row.what:<18}{f'{row.predicted:.3f} ms':>14}"
                   f"{f'{row.measured:.3f} ms':>14}{err:>9}")
    if comparison.ms_per_unit is not None:
        out.append(f"unit costs: 1 unit fitted to {comparison.ms_per_unit:.4g} ms (total measured "
                   "compute / total predicted compute); the errors compare shapes, not speed")
    return "\n".join(out)


# ------------------------------------------------------------------------------ the picture

COLOURS = {
    Op.FORWARD: "#4C72B0",
    Op.RECOMPUTE: "#8FAADC",
    Op.BACKWARD: "#DD8452",
    Op.BACKWARD_INPUT: "#E9B949",
    Op.BACKWARD_WEIGHT: "#C44E52",
    Op.ALLREDUCE: "#8C8C8C",
    Op.REDUCE_TIED: "#8C8C8C",
    Op.STEP: "#55A868",
}
# the way back up of a bidirectional (V-shaped) plan: the same ops in a second palette
UP_COLOURS = {
    Op.FORWARD: "#2A9D8F",
    Op.RECOMPUTE: "#A6D4B2",
    Op.BACKWARD: "#8172B3",
    Op.BACKWARD_INPUT: "#B39DDB",
    Op.BACKWARD_WEIGHT: "#64347A",
}
IDLE = "#EEEEEE"
LEGEND = {
    Op.FORWARD: "forward", Op.RECOMPUTE: "recompute", Op.BACKWARD: "backward",
    Op.BACKWARD_INPUT: "backward-input", Op.BACKWARD_WEIGHT: "backward-weight",
    Op.ALLREDUCE: "gradient reduction", Op.REDUCE_TIED: "gradient reduction",
    Op.STEP: "optimizer step",
}


def slices_summary(header) -> str:
    """'8 slices' when every micro-batch has the same number of slices, else '8,4 slices'."""
    counts = [len(m.slices) for m in header.microbatches]
    if len(set(counts)) == 1:
        return f"{counts[0]} slice{'s' if counts[0] != 1 else ''}"
    return ",".join(map(str, counts)) + " slices"


def _title(result) -> str:
    h = result.plan.header
    T, unit = result.iteration_time, result.time_unit
    when = f"{T * 1e3:.3g} ms" if unit == "s" else f"{T:g} {unit}s"
    M = len(h.microbatches)
    return (f"{h.schedule.name}: K={h.num_stages} stages, M={M} micro-batch{'es' if M != 1 else ''}, "
            f"{slices_summary(h)}\niteration {when}, bubble {result.bubble:.1%}")


def box_label(instr) -> str:
    """'mb.slice' inside a box; a checkpointed forward is marked '*' as `tpc show` marks it."""
    return f"{instr.mb}.{instr.slice}" + ("*" if instr.checkpoint else "")


def _label_size(result, px_per_unit: float) -> float:
    """One font size for every 'mb.slice' label, 0 for none: labels on some boxes only would
    read as a pattern that is not there."""
    boxes = [e for e in result.events if e.instr.slice is not None and e.work > 0]
    if not boxes:
        return 0
    narrowest = min(e.work for e in boxes) * px_per_unit
    longest = max(len(box_label(e.instr)) for e in boxes)
    for size, px_per_char in ((8, 7.5), (6, 5.5)):
        if narrowest >= px_per_char * longest:
            return size
    return 0


def shade(colour: str, chunk: int, chunks: int) -> str:
    """`colour` for chunk `chunk` of a rank holding `chunks` stages: chunk 0 as it is, later
    chunks mixed with up to 55% white, so the chunks of an interleaved rank tell apart."""
    if chunks <= 1 or chunk <= 0:
        return colour
    mix = 0.55 * chunk / (chunks - 1)
    rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * mix):02X}" for c in rgb)


def _chunk_of(header) -> dict[int, tuple[int, int]]:
    """stage -> (its chunk index on its rank, how many stages that rank holds)."""
    out = {}
    for r in range(header.mesh.pipe):
        held = sorted(header.stages_of_rank(r))
        for k, s in enumerate(held):
            out[s] = (k, len(held))
    return out


def box_colour(instr, chunk_of: dict, ways) -> str:
    """The colour of an instruction's box: its op's; on the way back up of a bidirectional plan
    (`ir.show.direction_of`: a V's way up, or Chimera's up pipeline) the op's colour of the
    second palette; on a later chunk of a rank holding several stages otherwise, lighter."""
    if ways is not None and ways(instr) == "up" and instr.op in UP_COLOURS:
        return UP_COLOURS[instr.op]
    colour = COLOURS[instr.op]
    if ways is None and instr.stage is not None and instr.stage in chunk_of:
        colour = shade(colour, *chunk_of[instr.stage])
    return colour


def write_gantt(result, path: str, width_in: float = 12.0) -> None:
    """A Gantt chart: one row per rank (rank 0 on top), one box per instruction that takes
    time: forward, recompute (hatched), backward, backward-input and backward-weight in their
    colours, 'mb.slice' inside a box wide enough to hold it; the idle time of a rank shows as the
    grey background between boxes. On a rank holding several stages (interleaved chunks) each
    later chunk's boxes are lighter, and the rank's label lists its stages. A bidirectional plan
    (stages down the ranks and back up, a V; or Chimera's two pipelines over weight replicas)
    draws the way up, or the up pipeline, in a second palette."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    P = len(result.plan.ranks)
    scale, xlabel = (1e3, "time (ms)") if result.time_unit == "s" else (1.0, f"time ({result.time_unit}s)")
    T = result.iteration_time * scale or 1.0
    fig, ax = plt.subplots(figsize=(width_in, 1.6 + 0.55 * P), dpi=150)
    axes_px = width_in * fig.dpi * 0.86  # the axes' share of the figure width
    row_h = 0.8
    used, used_up = set(), set()
    fontsize = _label_size(result, axes_px / T * scale)
    for p in result.plan.ranks:
        y = P - 1 - p.rank
        ax.broken_barh([(0, T)], (y - row_h / 2, row_h), facecolors=IDLE, edgecolor="none")
    chunk_of = _chunk_of(result.plan.header)
    ways = direction_of(result.plan.header)
    several = ways is None and any(n > 1 for _, n in chunk_of.values())
    for e in result.events:
        dur = e.work * scale
        if dur <= 0 or e.instr.op not in COLOURS:
            continue
        used.add(e.instr.op)
        y = P - 1 - e.rank
        x = (e.start + e.wait) * scale
        colour = box_colour(e.instr, chunk_of, ways)
        if ways is not None and ways(e.instr) == "up":
            used_up.add(e.instr.op)
        ax.broken_barh([(x, dur)], (y - row_h / 2, row_h), facecolors=colour,
                       edgecolor="white", linewidth=0.6,
                       hatch="//" if e.instr.op is Op.RECOMPUTE else None)
        if e.instr.slice is not None and fontsize:
            dark = colour in (COLOURS[e.instr.op], UP_COLOURS.get(e.instr.op))
            ax.text(x + dur / 2, y, box_label(e.instr), ha="center", va="center",
                    fontsize=fontsize, color="white" if dark
                    and e.instr.op is not Op.RECOMPUTE else "black")
    ax.set_yticks(range(P))
    def rank_label(r: int) -> str:
        held = sorted(result.plan.header.stages_of_rank(r))
        return f"rank {r}" if len(held) <= 1 else f"rank {r}\nstages {','.join(map(str, held))}"

    ax.set_yticklabels([rank_label(P - 1 - y) for y in range(P)])
    ax.set_ylim(-0.6, P - 0.4)
    ax.set_xlim(0, T)
    ax.set_xlabel(xlabel + ("   (labels: micro-batch.slice, * checkpointed)" if fontsize else ""))
    ax.set_title(_title(result), fontsize=10)
    ax.spines[["top", "right", "left"]].set_visible(False)
    ax.tick_params(axis="y", length=0)
    handles, seen = [], set()
    for op in COLOURS:
        if op in used and LEGEND[op] not in seen:
            seen.add(LEGEND[op])
            handles.append(Patch(facecolor=COLOURS[op], label=LEGEND[op],
                                 hatch="//" if op is Op.RECOMPUTE else None))
    for op in UP_COLOURS:
        if op in used_up:
            up = "up pipeline" if result.plan.header.replicas > 1 else "way up"
            handles.append(Patch(facecolor=UP_COLOURS[op], label=f"{LEGEND[op]}, {up}"))
    if several:
        handles.append(Patch(facecolor=shade(COLOURS[Op.FORWARD], 1, 2), label="later chunk (lighter)"))
    handles.append(Patch(facecolor=IDLE, label="idle (bubble)"))
    ncol = min(len(handles), 6)
    rows = -(-len(handles) // ncol)
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.0),
               ncol=ncol, frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0.3 * rows / fig.get_figheight(), 1, 1))  # room for the legend
    # matplotlib picks the format by the name; the temporary file's name ends in .tmp
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=Path(path).suffix[1:].lower() or matplotlib.rcParams["savefig.format"])
    plt.close(fig)
