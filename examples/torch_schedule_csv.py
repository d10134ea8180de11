"""Write one of torch.distributed.pipelining's own schedules as the CSV torch's `_dump_csv` writes,
on any machine: no GPUs, no process group, no model.

    python examples/torch_schedule_csv.py ZBVZeroBubble --ranks 2 --stages-per-rank 2 --microbatches 4 -o zbv.csv
    python examples/torch_schedule_csv.py Interleaved1F1B --ranks 4 --stages-per-rank 2 --microbatches 8 \\
        --comms -o i1f1b_comms.csv

A schedule class computes its per-rank action lists (`pipeline_order`) in its constructor from
the number of micro-batches and four attributes of its stages; nothing there communicates. So a
stand-in with those attributes (`num_stages`, `group_size`, `group_rank`, `stage_index`, and
`submod=None`, which the zero-bubble schedules inspect for torch.compile) is enough. The names
are those of torch's `get_schedule_class` (what torchtitan's --parallelism.pipeline_parallel_schedule
takes). `--comms` writes the compute+comms form that `_PipelineScheduleRuntime` runs.
"""

from __future__ import annotations

import argparse
import logging
import types

from torch.distributed.pipelining import schedules as S


def stage(num_stages: int, ranks: int, index: int):
    return types.SimpleNamespace(num_stages=num_stages, group_size=ranks, group_rank=0,
                                 stage_index=index, submod=None)


def build(name: str, ranks: int, per_rank: int, microbatches: int):
    cls = S.get_schedule_class(name)
    k = ranks * per_rank
    if issubclass(cls, S.PipelineScheduleMulti):
        return cls([stage(k, ranks, j * ranks) for j in range(per_rank)], microbatches)
    if per_rank != 1:
        raise SystemExit(f"{name} runs one stage per rank: use --stages-per-rank 1")
    return cls(stage(k, ranks, 0), microbatches)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("schedule", help="a torch schedule name: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, "
                   "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV")
    p.add_argument("--ranks", type=int, default=2, help="pipeline ranks (default: 2)")
    p.add_argument("--stages-per-rank", type=int, default=1, help="stages on each rank (default: 1)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches (default: 4)")
    p.add_argument("--comms", action="store_true", help="the compute+comms form (runtime schedules)")
    p.add_argument("-o", "--output", required=True, help="where to write the CSV")
    a = p.parse_args()
    logging.getLogger("torch.distributed.pipelining.schedules").setLevel(logging.WARNING)
    schedule = build(a.schedule, a.ranks, a.stages_per_rank, a.microbatches)
    if isinstance(schedule, S._PipelineScheduleRuntime):
        schedule._dump_csv(a.output, format="compute_comms" if a.comms else "compute_only")
    elif a.comms:
        raise SystemExit(f"{a.schedule} has no compute+comms form: torch lowers it at run time")
    else:
        S.PipelineScheduleMulti._dump_csv(schedule, a.output)  # single-stage schedules have no _dump_csv
    print(f"wrote {a.output}: torch {type(schedule).__name__}, {a.ranks} ranks x {a.stages_per_rank} "
          f"stage(s), {a.microbatches} micro-batches")


if __name__ == "__main__":
    main()
