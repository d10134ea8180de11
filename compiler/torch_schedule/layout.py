"""What a schedule CSV says about the pipeline: ranks, stages, where each stage runs, micro-batches.

A torch schedule names no placement: torch infers it from which rank's row runs each stage
(`_validate_schedule`), and so does this module. The usual ones come out by themselves:
interleaved schedules put stage s on rank s mod p, V-shaped ones (ZBV, DualPipeV) stages i and
2p-1-i on rank i; any other placement where each stage has one rank is accepted as well.

`csv_header` builds the header of a plan for a CSV alone (`tpc verify SCHED.csv`, `tpc simulate
SCHED.csv --unit`): no model, one partition unit per stage, one row and one token per
micro-batch unless a slice map (tpc's export writes one beside the CSV) says otherwise.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tpc.compiler.torch_schedule.actions import FORWARD, TorchCsv
from tpc.compiler.torch_schedule.slice_map import SliceMap
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Header, MeshLine, Microbatch, ModelLine, ScheduleLine, ShapeLine, Stage, UnitsLine

# the factory named on the placeholder model line of a header made from a CSV alone
CSV_FACTORY = "torch-schedule-csv"


@dataclass(frozen=True)
class Layout:
    ranks: int
    stage_rank: tuple[int, ...]  # stage -> pipeline rank
    microbatches: int  # torch micro-batch indices 0 .. microbatches-1

    @property
    def stages(self) -> int:
        return len(self.stage_rank)


def layout_of(sched: TorchCsv) -> Layout:
    """The placement and counts the CSV implies; a stage on two ranks, a stage no cell names,
    or a rank without a stage is a located error."""
    problems: list[Diagnostic] = []
    first: dict[int, object] = {}  # stage -> first action naming it
    for a in sched.actions:
        seen = first.setdefault(a.stage, a)
        if seen.rank != a.rank:
            problems.append(Diagnostic(
                f"`{a}` puts stage {a.stage} on rank {a.rank}, but `{seen}` at {seen.loc} runs it on rank {seen.rank}",
                loc=a.loc, hint=f"a stage runs on one rank: move this action to rank {seen.rank}'s row "
                                f"(line {seen.rank + 1}), or renumber the stage"))
    stages = max(first) + 1 if first else 0
    missing = [s for s in range(stages) if s not in first]
    if missing:
        problems.append(Diagnostic(
            f"stage {missing[0]} appears in no cell, but the CSV names stages up to {stages - 1}",
            where=sched.path, hint="stages are numbered 0, 1, ..., K-1, each run by one rank"))
    held = {a.rank for a in first.values()}
    for r in range(len(sched.rows)):
        if r not in held:
            problems.append(Diagnostic(
                f"rank {r} runs no stage (row {r + 1} has no computation)", where=sched.path,
                hint="every row is a pipeline rank and must run at least one stage"))
    if problems:
        raise TpirError(problems, source=sched.text)
    return Layout(ranks=len(sched.rows), stage_rank=tuple(first[s].rank for s in range(stages)),
                  microbatches=microbatch_count(sched))


def microbatch_count(sched: TorchCsv) -> int:
    """How many micro-batches the schedule runs: 1 + the largest index a stage's forwards
    name, as most stages have it (the first such stage breaking a tie). A stage whose forwards
    name another index is then reported at its cells, instead of every other stage being told
    it lacks a micro-batch."""
    top: dict[int, int] = {}
    for a in sched.actions:
        if a.kind == FORWARD:
            top[a.stage] = max(top.get(a.stage, -1), a.mb)
    if not top:
        raise TpirError(Diagnostic(f"{sched.path} runs no forward", where=sched.path,
                                   hint="a schedule runs F and B (or I and W) of each micro-batch on every stage"))
    votes = Counter(top.values())
    best = max(votes.values())
    return 1 + next(top[s] for s in sorted(top) if votes[top[s]] == best)


def place(header: Header, layout: Layout, where: str) -> Header:
    """`header` with the CSV's pipeline ranks and stage placement (its stages, micro-batches
    and everything else kept). `where` names the option or file a mismatch is reported at."""
    import dataclasses

    if header.num_stages != layout.stages:
        raise TpirError(Diagnostic(
            f"the schedule has {layout.stages} stages, the plan {header.num_stages}", where=where,
            hint=f"compile with {layout.stages} stages (leave out --stages with --schedule-file)"))
    stages = tuple(dataclasses.replace(st, rank=layout.stage_rank[st.index]) for st in header.stages)
    return dataclasses.replace(header, stages=stages,
                               mesh=dataclasses.replace(header.mesh, pipe=layout.ranks))


def csv_header(sched: TorchCsv, layout: Layout, slice_map: SliceMap | None = None) -> Header:
    """The header of a plan made from the CSV alone (see the module docstring)."""
    name = Path(sched.path).name
    sha = hashlib.sha256(sched.text.encode("utf-8")).hexdigest()
    model = ModelLine(path=sched.path, sha256=sha, factory=CSV_FACTORY,
                      comments=(f"no model: the schedule {name} alone (one unit per stage); "
                                "compile onto a model with `tpc compile MODEL --schedule-file`",))
    if slice_map is not None:
        microbatches = slice_map.header_microbatches()
        seq = slice_map.seq
    else:
        microbatches = tuple(Microbatch(index=m, size=1, slices=((0, 1),)) for m in range(layout.microbatches))
        seq = 1
    batch = sum(m.size for m in microbatches)
    return Header(
        model=model,
        shape=ShapeLine(batch=batch, seq=seq, vocab=1, dtype="float32"),
        mesh=MeshLine(pipe=layout.ranks, data=1),
        schedule=ScheduleLine(name=f"torch csv {name}"),
        units=UnitsLine(count=layout.stages),
        stages=tuple(Stage(index=s, rank=r, units=(s, s + 1)) for s, r in enumerate(layout.stage_rank)),
        microbatches=microbatches,
    )
