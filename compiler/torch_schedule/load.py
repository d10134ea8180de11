"""A verified plan from a path: a `.tpir` file, or a torch schedule CSV read on its own.

A CSV alone has no model: its plan gets the header of `layout.csv_header` (one unit per stage,
one-row micro-batches, or the slices of the map beside the CSV), which is all `tpc verify` and
`tpc simulate --unit` need. Cost models that price a real model's stages (--cost,
--device-model) need the model: `tpc compile MODEL --schedule-file SCHED.csv` makes that plan.
"""

from __future__ import annotations

from tpc.compiler.torch_schedule.actions import is_schedule_csv, read_csv
from tpc.compiler.torch_schedule.importer import Imported, plan_from_schedule
from tpc.compiler.torch_schedule.layout import csv_header, layout_of
from tpc.compiler.torch_schedule.slice_map import find_map
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Plan
from tpc.ir.semantics import DEFAULT_COMM, CommRules


def import_csv(path: str) -> Imported:
    """The verified plan of the schedule CSV at `path` on its own (see the module docstring)."""
    sched = read_csv(path)
    layout = layout_of(sched)
    slice_map = find_map(path)
    if slice_map is not None and len(slice_map.units) != layout.microbatches:
        raise TpirError(Diagnostic(
            f"{path} names {layout.microbatches} micro-batches, its slice map {len(slice_map.units)}",
            where=path, hint="the map beside the CSV belongs to another schedule: rewrite or delete it"))
    header = csv_header(sched, layout, slice_map)
    return plan_from_schedule(sched, header, slice_map.units if slice_map else None)


def load_checked_plan(path: str, *, needs_model: bool = False, comm: CommRules = DEFAULT_COMM) -> Plan:
    """The verified plan at `path`: a `.tpir` file (parsed and verified under backend `comm`'s
    rules), or a torch schedule CSV (imported for NCCL, errors at its cells). `needs_model`:
    the caller will build the plan's model (a cost model of its stages), which a CSV alone does
    not name."""
    if not is_schedule_csv(path):
        from tpc.ir.verify import verify_file

        return verify_file(path, comm)
    if needs_model:
        raise TpirError(Diagnostic(
            f"{path} is a torch schedule with no model: only unit costs can price it", where=path,
            hint=f"use --unit, or compile it onto a model first: `tpc compile MODEL --schedule-file {path} "
                 "-o plan.tpir --seq-len L --batch B`, and simulate plan.tpir"))
    return import_csv(path).plan
