"""`tpc compile MODEL --schedule-file SCHED.csv`: a torch schedule's compute order on a real model.

The model is traced and cut into as many stages as the CSV names (the same partition `tpc
compile` makes); each stage is placed on the rank whose row runs it; the CSV's micro-batch
indices are the header's (micro-batch, token slice) units in forward order. Without --slices
each torch micro-batch is one micro-batch of the plan. With --slices N each plan micro-batch is
cut into N token slices and torch index k is the k-th slice in forward order (the CSV then has
micro-batches x N indices; `tpc export-schedule` writes such CSVs). A slice map beside the CSV
(from `tpc export-schedule`) gives the micro-batches and slices itself.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpc.compiler.passes import Pass
from tpc.compiler.pipeline import PASS_NAMES as _PIPELINE_NAMES
from tpc.compiler.optimise.slicing import AUTO
from tpc.compiler.torch_schedule.actions import read_csv
from tpc.compiler.torch_schedule.importer import plan_from_schedule
from tpc.compiler.torch_schedule.layout import layout_of, place
from tpc.compiler.torch_schedule.slice_map import SliceMap, find_map, map_path
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Plan, ScheduleLine
from tpc.ir.semantics import NCCL


def _error(option: str, message: str, hint: str) -> TpirError:
    return TpirError(Diagnostic(message, where=option, hint=hint))


def compile_schedule_file(model_path: str, schedule_file: str, *, seq_len: int, batch: int,
                          microbatches: int | None = None, slices: int | tuple[int, ...] = 1,
                          dp: int = 1, stages: int | None = None, factory: str = "model",
                          quiet: bool = False, print_after: tuple[str, ...] = (), model=None) -> Plan:
    """The verified plan of `schedule_file` on the model of `model_path` (module docstring).
    `microbatches` and `stages` may be left None: the CSV says them. `slices` is a count of
    equal token slices per micro-batch or their lengths (the CSV fixes the units of work, so
    not AUTO). The passes: `tpc compile`'s front half (load, trace, partition, header), then
    csv-place, self-check, csv-import and eval, run by the same driver (compiler/passes.py;
    `print_after` as `tpc compile --print-after`). `model`: a model object to compile as it is
    (the library's; `model_path` its class's file)."""
    from tpc.compiler.options import CompileOptions
    from tpc.compiler.passes import CompileState, PassManager
    from tpc.compiler.pipeline import Evaluation, SelfCheck, front_passes

    sched = read_csv(schedule_file)
    layout = layout_of(sched)
    say = (lambda text: None) if quiet else (lambda text: print(text, file=sys.stderr, flush=True))
    if stages is not None and stages != layout.stages:
        raise _error("--stages", f"--stages {stages}, but {schedule_file} runs {layout.stages} stages",
                     "leave out --stages: the schedule file says how many stages there are")
    slice_map = find_map(schedule_file)
    if slice_map is not None:
        _check_map(slice_map, schedule_file, layout.microbatches, seq_len=seq_len, batch=batch, dp=dp,
                   microbatches=microbatches, slices=slices)
        count, cuts = len(slice_map.microbatches), 1
        say(f"  slices     from {map_path(schedule_file)}")
    else:
        n = _slice_count(slices)
        if layout.microbatches % n:
            raise _error("--slices", f"{schedule_file} names {layout.microbatches} micro-batches, which "
                         f"do not split into micro-batches of {n} token slices",
                         f"use a --slices count that divides {layout.microbatches}")
        count = layout.microbatches // n
        if microbatches is not None and microbatches != count:
            raise _error("--microbatches", f"--microbatches {microbatches} x {n} slice(s) is not the "
                         f"{layout.microbatches} micro-batches {schedule_file} names",
                         f"leave out --microbatches (it is {count} here)")
        cuts = slices
    # the header's stages and micro-batches as `tpc compile` makes them; csv-place then puts
    # them where the CSV runs them
    opts = CompileOptions(stages=layout.stages, microbatches=count, seq_len=seq_len, batch=batch,
                          slices=cuts, schedule="gpipe", dp=dp, factory=factory, quiet=quiet)
    passes = (*front_passes(opts, schedule_file=schedule_file), PlaceCsv(schedule_file, layout, slice_map),
              SelfCheck(), ImportCsv(schedule_file, sched, layout, slice_map),
              # the evaluation program: the forward of the header's micro-batches and slices, as
              # `tpc compile` writes it without a cost model
              Evaluation(NCCL))
    manager = PassManager(passes, comm=NCCL, print_after=tuple(print_after), quiet=quiet, known=PASS_NAMES)
    return manager.run(CompileState(model_path=model_path, factory=factory, model=model)).plan


@dataclass(frozen=True)
class PlaceCsv(Pass):
    """The header's stages on the ranks whose rows run them, the slice map's micro-batches and
    slices when there is one, and the schedule named after the file."""

    name = "csv-place"
    summary = "stages on the CSV's ranks, its micro-batches, the schedule named after the file"
    schedule_file: str
    layout: Any
    slice_map: SliceMap | None = None

    def run(self, state, note):
        header = state.header
        if self.slice_map is not None:
            header = dataclasses.replace(header, microbatches=self.slice_map.header_microbatches())
        header = dataclasses.replace(place(header, self.layout, "--schedule-file"),
                                     schedule=ScheduleLine(name=f"torch csv {Path(self.schedule_file).name}"))
        note(f"{self.layout.ranks} ranks, {self.layout.stages} stages")
        return state.but(header=header)


@dataclass(frozen=True)
class ImportCsv(Pass):
    """The CSV's compute order (and its own sends and receives, when it has them) lowered for
    NCCL's rules onto the header (importer.py); verified by the driver."""

    name = "csv-import"
    summary = "the CSV's actions as the plan, lowered for NCCL"
    changes_plan = True
    schedule_file: str
    sched: Any
    layout: Any
    slice_map: SliceMap | None = None

    def run(self, state, note):
        imported = plan_from_schedule(self.sched, state.header, self.slice_map.units if self.slice_map else None)
        note(f"{self.schedule_file}: {self.layout.ranks} ranks, {self.layout.stages} stages, "
             f"{self.layout.microbatches} torch micro-batches; {imported.summary()}")
        return state.but(plan=imported.plan)


# every pass `tpc compile --print-after` knows, the schedule file's among them
PASS_NAMES = (*_PIPELINE_NAMES, PlaceCsv.name, ImportCsv.name)


def _slice_count(slices) -> int:
    if slices == AUTO:
        raise _error("--slices", "--slices auto with --schedule-file: the schedule fixes its units of work",
                     "give the number of token slices per micro-batch, or leave out --slices")
    return slices if isinstance(slices, int) else len(slices)


def _check_map(slice_map: SliceMap, schedule_file: str, count: int, *, seq_len, batch, dp, microbatches,
               slices) -> None:
    where = map_path(schedule_file)
    if len(slice_map.units) != count:
        raise _error("--schedule-file", f"{schedule_file} names {count} micro-batches, its slice map "
                     f"{len(slice_map.units)}", f"{where} belongs to another schedule: rewrite or delete it")
    if seq_len != slice_map.seq:
        raise _error("--seq-len", f"--seq-len {seq_len}, but the slice map {where} cuts sequences of "
                     f"{slice_map.seq} tokens", f"use --seq-len {slice_map.seq}, or delete the map")
    rows = sum(size for size, _ in slice_map.microbatches)
    if batch % dp or batch // dp != rows:
        raise _error("--batch", f"--batch {batch} / --dp {dp}, but the slice map {where} gives each "
                     f"replica {rows} rows", f"use --batch {rows * dp}, or delete the map")
    if microbatches is not None or slices != 1:
        raise _error("--microbatches" if microbatches is not None else "--slices",
                     f"the slice map {where} fixes the micro-batches and their token slices",
                     "leave out --microbatches and --slices, or delete the map")
