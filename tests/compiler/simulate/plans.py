"""Small plans for the simulator tests: a header built from the IR dataclasses, compute
ordered by the project's schedule builders and lowered (and verified) by `lower`."""

from __future__ import annotations

from tpc.compiler.lowering.lower import lower
from tpc.compiler.schedules import build_schedule
from tpc.compiler.optimise.slicing import ranges_of
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


def make_header(stages: int, microbatches: int, slices: int, seq: int = 64,
                schedule: str = "gpipe", slice_lengths: tuple[int, ...] | None = None,
                data: int = 1, ties: tuple[Tie, ...] = ()) -> Header:
    """K stages, stage s on rank s; micro-batches of one row, each cut into `slices` equal
    slices (or `slice_lengths`)."""
    lengths = slice_lengths or (seq // slices,) * slices
    assert sum(lengths) == seq
    cuts = ranges_of(lengths)
    return Header(
        model=ModelLine("m.py", "0" * 64),
        shape=ShapeLine(batch=microbatches * data, seq=seq, vocab=16),
        mesh=MeshLine(pipe=stages, data=data),
        schedule=ScheduleLine(schedule),
        units=UnitsLine(stages),
        stages=tuple(Stage(s, s, (s, s + 1)) for s in range(stages)),
        microbatches=tuple(Microbatch(m, 1, cuts) for m in range(microbatches)),
        ties=ties,
    )


def make_plan(schedule: str, stages: int, microbatches: int, slices: int = 1, **kw) -> Plan:
    header = make_header(stages, microbatches, slices, schedule=schedule, **kw)
    return lower(header, build_schedule(schedule, header))


