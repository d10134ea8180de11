"""Tests of the schedule builders, the lowering passes and `tpc compile`.

`make_header` builds a plan header directly, so schedules and lowering are tested without
tracing a model.
"""

from __future__ import annotations

from tpc.compiler.optimise.slicing import equal_slices, ranges_of
from tpc.ir.nodes import Header, MeshLine, Microbatch, ModelLine, ScheduleLine, ShapeLine, Stage, Tie, UnitsLine

SEQ = 24  # divisible by 1, 3 and 8: equal slices of a whole length


def make_header(
    stages: int,
    *,
    slices=1,
    mbs: int = 1,
    dp: int = 1,
    schedule: str = "gpipe",
    stage_ranks: tuple[int, ...] | None = None,
    ties: tuple[tuple[str, tuple[int, ...]], ...] = (),
    seq: int = SEQ,
    rows_per_mb: int = 2,
) -> Header:
    """A header of `stages` stages (stage s on rank s unless `stage_ranks` says otherwise),
    `mbs` micro-batches of `rows_per_mb` rows per replica, each cut into `slices` (a count or
    a tuple of lengths)."""
    ranks = stage_ranks if stage_ranks is not None else tuple(range(stages))
    cuts = equal_slices(slices, seq) if isinstance(slices, int) else ranges_of(slices)
    return Header(
        model=ModelLine(path="model.py", sha256="0" * 64, factory="model"),
        shape=ShapeLine(batch=rows_per_mb * mbs * dp, seq=seq, vocab=16),
        mesh=MeshLine(pipe=max(ranks) + 1, data=dp),
        schedule=ScheduleLine(name=schedule),
        units=UnitsLine(count=stages),
        stages=tuple(Stage(index=s, rank=ranks[s], units=(s, s + 1), label=f"unit{s}") for s in range(stages)),
        ties=tuple(Tie(name=n, stages=st) for n, st in ties),
        microbatches=tuple(Microbatch(index=m, size=rows_per_mb, slices=cuts) for m in range(mbs)),
    )
