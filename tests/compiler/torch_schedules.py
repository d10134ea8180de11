"""torch.distributed.pipelining's own schedules, built without a process group, for the tests.

Every schedule class computes its `pipeline_order` (rank -> actions) in its constructor from
`n_microbatches` and a few attributes of its stages; nothing there communicates. So a stand-in
for a stage that has just those attributes (`num_stages`, `group_size`, `group_rank`,
`stage_index`, and `submod=None` for the torch.compile check of the zero-bubble schedules) is
enough: `PipelineScheduleSingle` subclasses take one, `PipelineScheduleMulti` subclasses a list
of one per local stage (their count is the stages per rank). The CSVs are written with torch's
own `_dump_csv`: the runtime schedules' method (`format="compute_only"` / `"compute_comms"`),
and for single-stage schedules, which have none, `PipelineScheduleMulti._dump_csv`, which only
reads `pipeline_order`.
"""

from __future__ import annotations

import inspect
import logging
import types
from pathlib import Path

from torch.distributed.pipelining import schedules as S

logging.getLogger("torch.distributed.pipelining.schedules").setLevel(logging.WARNING)


def stage(num_stages: int, ranks: int, rank: int = 0, index: int = 0):
    """What a schedule's constructor reads of a pipeline stage."""
    return types.SimpleNamespace(num_stages=num_stages, group_size=ranks, group_rank=rank,
                                 stage_index=index, submod=None)


def build(cls, ranks: int, per_rank: int, microbatches: int):
    """`cls`'s schedule for `ranks` ranks x `per_rank` stages each and `microbatches`."""
    k = ranks * per_rank
    if issubclass(cls, S.PipelineScheduleMulti):
        return cls([stage(k, ranks, 0, j * ranks) for j in range(per_rank)], microbatches)
    assert per_rank == 1
    return cls(stage(k, ranks), microbatches)


def dump(schedule, path: Path, fmt: str = "compute_only") -> Path:
    """The schedule as torch's `_dump_csv` writes it."""
    if isinstance(schedule, S._PipelineScheduleRuntime):
        schedule._dump_csv(str(path), format=fmt)
    else:
        assert fmt == "compute_only"
        S.PipelineScheduleMulti._dump_csv(schedule, str(path))
    return path


def concrete_classes() -> set[type]:
    """Every schedule class the installed torch defines that can be constructed."""
    return {c for _, c in inspect.getmembers(S, inspect.isclass)
            if issubclass(c, S._PipelineSchedule) and not inspect.isabstract(c)
            and c.__module__ == S.__name__}


# (ranks, stages per rank, micro-batches) per class: the configurations each class accepts
# (1F1B needs micro-batches >= stages, ZBV and DualPipeV two stages per rank, DualPipeV
# micro-batches >= stages, the interleaved ones micro-batches a multiple of their rounds)
CASES: dict[type, list[tuple[int, int, int]]] = {
    S.ScheduleGPipe: [(2, 1, 3), (4, 1, 4)],
    S.Schedule1F1B: [(2, 1, 4), (4, 1, 6)],
    S.ScheduleInterleaved1F1B: [(2, 2, 4), (2, 2, 2), (4, 2, 8), (2, 4, 4)],
    S.ScheduleLoopedBFS: [(2, 2, 4), (4, 2, 3)],
    S.ScheduleInterleavedZeroBubble: [(2, 1, 4), (2, 2, 4), (4, 2, 8)],
    S.ScheduleZBVZeroBubble: [(2, 2, 4), (4, 2, 8), (2, 2, 2)],
    S.ScheduleDualPipeV: [(2, 2, 4), (4, 2, 8)],
}
# classes with no schedule of their own: the runtime loads one (`_load_csv`), and the multi-stage
# base class holds one; they are what the export is loaded with
LOADERS = {S._PipelineScheduleRuntime, S.PipelineScheduleMulti}
# forward only (evaluation): no pipeline_order, and nothing a training plan can be compared to
FORWARD_ONLY = {S._ScheduleForwardOnly}


def leaf_actions(order: dict, *, compute_only: bool = False) -> dict[int, list[str]]:
    """rank -> its actions as text, idle steps dropped, an OVERLAP_F_B cell as its sub-actions
    (torch's runtime runs them one after the other); without FSDP's UNSHARD / RESHARD and
    without REDUCE_GRAD; with `compute_only`, the computations alone."""
    keep_out = {S.UNSHARD, S.RESHARD, S.REDUCE_GRAD}
    out = {}
    for rank, actions in order.items():
        row = []
        for a in actions:
            if a is None:
                continue
            for leaf in (a.sub_actions or (a,)):
                if leaf.computation_type in keep_out:
                    continue
                if compute_only and not leaf.is_compute_op:
                    continue
                row.append(str(leaf))
        out[rank] = row
    return out
