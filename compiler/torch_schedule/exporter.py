"""A plan's schedule as a torch CSV, for torch.distributed.pipelining's runtime.

    tpc export-schedule PLAN -o SCHED.csv [--format compute_only|compute_comms]

Each pipeline rank's row lists its computations in plan order: `forward` as F, `backward` as B,
`backward-input` as I, `backward-weight` as W, the (micro-batch, token slice) as torch's
micro-batch index k, the k-th in forward order (slice_map.py). The compute-only form is what
`_PipelineScheduleRuntime._load_csv(path)` reads (it validates the counts and adds its own
communication); the compute+comms form (`_load_csv(path, format="compute_comms")`) also has
the plan's sends and receives where the plan has them (SEND_F, RECV_F, SEND_B, RECV_B) and
REDUCE_GRAD after each stage's last weight gradient (where the plan all-reduces it, with
data-parallel replicas).

The map beside the CSV (`SCHED.csv.map.json`) says which rows and tokens each index stands for
and what was left out. What torch cannot say is refused, located: a checkpoint forward and its
recompute (torch recomputes inside a stage's module, not as a schedule action), and a stage
with weight replicas (chimera: torch places each stage on one rank). Left out and said so in
the map: loads, free-kv, reduce-tied (torch's runtime has no tied weights across
stages) and the step. torch runs index k as a whole micro-batch of the batch it is given:
with one token slice per micro-batch that is the plan's arithmetic; with several, the order,
dependencies and communication are the plan's, the tensors are not (the map says which).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from tpc.compiler.torch_schedule.actions import format_csv
from tpc.compiler.torch_schedule.slice_map import SliceMap, map_path
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.files import atomic_write_text
from tpc.ir.nodes import Op, Payload, Plan

FORMATS = ("compute_only", "compute_comms")
_COMPUTE = {Op.FORWARD: "F", Op.BACKWARD: "B", Op.BACKWARD_INPUT: "I", Op.BACKWARD_WEIGHT: "W"}
_COMM = {(Op.SEND, Payload.ACT): "SEND_F", (Op.RECV, Payload.ACT): "RECV_F",
         (Op.SEND, Payload.GRAD): "SEND_B", (Op.RECV, Payload.GRAD): "RECV_B"}
_LEFT_OUT = {Op.LOAD: "load", Op.FREE_KV: "free-kv", Op.REDUCE_TIED: "reduce-tied", Op.STEP: "step",
             Op.EXCHANGE: "exchange"}  # torch batches its own sends and receives


@dataclass(frozen=True)
class Exported:
    rows: tuple[tuple[str, ...], ...]
    csv_path: str
    map_path: str
    left_out: dict[str, int]
    exact: bool  # every micro-batch is one token slice: torch runs the plan's arithmetic

    def summary(self) -> str:
        n = sum(len(r) for r in self.rows)
        text = f"wrote {self.csv_path}: {len(self.rows)} ranks, {n} actions; slice map {self.map_path}"
        if not self.exact:
            text += " (token slices written as torch micro-batches: see the map)"
        return text


def schedule_rows(plan: Plan, fmt: str = "compute_only") -> tuple[tuple[tuple[str, ...], ...], dict[str, int]]:
    """Each rank's actions as torch writes them, and what was left out (by instruction kind)."""
    if fmt not in FORMATS:
        raise TpirError(Diagnostic(f"unknown format {fmt!r}", where="--format",
                                   hint=f"choose {' or '.join(FORMATS)}"))
    _refuse_replicas(plan)
    _refuse_recompute(plan)
    index = {unit: k for k, unit in enumerate(SliceMap.of_header(plan.header).units)}
    comms = fmt == "compute_comms"
    left_out: dict[str, int] = {}
    rows = []
    for rp in plan.ranks:
        row: list[str] = []
        last_wgrad = _last_weight_gradients(rp.instrs) if comms and plan.header.mesh.data == 1 else {}
        for p, ins in enumerate(rp.instrs):
            if ins.op in _COMPUTE:
                row.append(f"{ins.stage}{_COMPUTE[ins.op]}{index[(ins.mb, ins.slice)]}")
            elif ins.op in (Op.SEND, Op.RECV):
                if comms:  # compute only: torch's _load_csv places its own
                    row.append(f"{ins.stage}{_COMM[(ins.op, ins.payload)]}{index[(ins.mb, ins.slice)]}")
            elif ins.op is Op.ALLREDUCE:
                if comms:  # compute only: torch's _load_csv adds its own REDUCE_GRAD
                    row.append(f"{ins.stage}REDUCE_GRAD")
            else:
                left_out[_LEFT_OUT[ins.op]] = left_out.get(_LEFT_OUT[ins.op], 0) + 1
            # one replica: no allreduce in the plan, but torch's runtime scales and reduces a
            # stage's gradients at REDUCE_GRAD: after its last weight gradient
            row += [f"{s}REDUCE_GRAD" for s, at in last_wgrad.items() if at == p]
        rows.append(tuple(row))
    return tuple(rows), left_out


def _last_weight_gradients(instrs) -> dict[int, int]:
    """stage -> the position after which its gradients are complete: its last backward or
    backward-weight and the sends that directly follow it."""
    out: dict[int, int] = {}
    for p, ins in enumerate(instrs):
        if ins.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT):
            q = p
            while q + 1 < len(instrs) and instrs[q + 1].op is Op.SEND and instrs[q + 1].stage == ins.stage:
                q += 1
            out[ins.stage] = q
    return out


def _refuse_replicas(plan: Plan) -> None:
    """torch's runtime places each stage on one rank: a plan whose stages have weight replicas
    (format version 3, chimera) has no torch schedule."""
    st = next((st for st in plan.header.stages if st.replicas), None)
    if st is not None:
        raise TpirError(Diagnostic(
            f"stage {st.index} has weight replicas on ranks {', '.join(map(str, st.ranks))}: torch's "
            "pipelining runtime places each stage on one rank, so this plan has no torch schedule",
            loc=st.loc, where="" if st.loc else f"stage {st.index}",
            hint="export a plan of one replica per stage (any schedule but chimera)"))


def _refuse_recompute(plan: Plan) -> None:
    problems = []
    for rp in plan.ranks:
        for p, ins in enumerate(rp.instrs):
            if ins.op is Op.RECOMPUTE or (ins.op is Op.FORWARD and ins.checkpoint):
                problems.append(Diagnostic(
                    f"torch's schedule has no action for `{ins}`: it recomputes inside a stage's "
                    "module (activation checkpointing), not as a step of the schedule",
                    loc=ins.loc, where="" if ins.loc else f"rank {rp.rank}, instruction {p} ({ins})",
                    hint="export a plan without `checkpoint` forwards and `recompute` (compile without "
                         "recomputation), and wrap the torch stage's modules in checkpoint instead"))
    if problems:
        raise TpirError(problems)


def _json_lines(info: dict) -> str:
    """JSON a person can read: one key per line, each entry of a list of objects on a line."""
    parts = []
    for key, value in info.items():
        if isinstance(value, list) and value and isinstance(value[0], (dict, str)):
            items = ",\n".join("  " + json.dumps(v) for v in value)
            parts.append(f" {json.dumps(key)}: [\n{items}\n ]")
        else:
            parts.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def export_schedule(plan: Plan, output: str, *, fmt: str = "compute_only", plan_name: str = "") -> Exported:
    """Write `plan`'s schedule to `output` as a torch CSV and its slice map beside it."""
    rows, left_out = schedule_rows(plan, fmt)
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise TpirError(Diagnostic(f"no such folder: {folder}", where="--output",
                                   hint="create the folder first, or write the schedule elsewhere"))
    slice_map = SliceMap.of_header(plan.header)
    exact = all(len(mb.slices) == 1 for mb in plan.header.microbatches)
    notes = ["left out (torch's schedule has no action for them): "
             + ", ".join(f"{n} {k}" for k, n in sorted(left_out.items()))] if left_out else []
    if not exact:
        notes.append("torch runs each index as a whole micro-batch (a chunk of the batch's rows); "
                     "here an index is a token slice of a micro-batch: the schedule's order, "
                     "dependencies and communication are the plan's, the tensors are not")
    if fmt == "compute_only":
        notes.append("compute only: torch's _load_csv adds its own sends, receives and REDUCE_GRAD")
    if plan.header.mesh.data > 1:
        notes.append(f"every one of the {plan.header.mesh.data} data-parallel replicas runs these rows")
    info = slice_map.to_json(plan=plan_name, format_of_csv=fmt, exact_in_torch=exact, notes=notes,
                             stages=[{"stage": st.index, "rank": st.rank, "label": st.label}
                                     for st in plan.header.stages])
    atomic_write_text(output, format_csv([list(r) for r in rows]), newline="")
    mp = map_path(output)
    atomic_write_text(mp, _json_lines(info))
    return Exported(rows, output, mp, left_out, exact)

