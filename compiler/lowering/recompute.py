"""Activation recomputation as plan instructions: `--recompute none|full|auto`.

A stage recomputed in full keeps no autograd graph from a forward to its backward: its forwards
are written `forward ... checkpoint` (they keep only their input and the KV cache, which later
slices need anyway) and a `recompute` of the same slice rebuilds the graph just before the
backward needs it. Because it is an instruction of the plan, the verifier checks it (R4: after
its forward, before its backward), the simulator prices it (a forward's time) and the memory
model counts it (the graph is held from the recompute to the backward, or to the
backward-weight of a split backward).

`apply(compute, choice)` is a pure transform of a schedule's compute order: for every stage whose
choice is "full", each forward is marked `checkpoint` and a `recompute` is put right before the
slice's backward (or backward-input). Lowering puts the receive of the output gradient right
before the backward, so after the recompute: the recompute runs while the gradient is still on
its way, inside the bubble a rank would otherwise spend waiting for it.

`choose(header, compute, costs, budget)` is the planner for `auto`, stage-aware as in Merak
(Lai et al., 2023): a pipeline's early stages hold more micro-batches in flight than its late
ones (1F1B: stage s holds K - s), so a uniform choice either wastes memory on late stages or time
on early ones. Per rank, as long as its peak memory (tpc.compiler.predict.memory over the lowered plan)
exceeds the budget, the stage of that rank whose recomputation lowers the peak most is switched
to "full" (ties: the earlier stage). The rest stay "none": no recompute where memory suffices.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from tpc.compiler.costmodel.base import CostModel
from tpc.compiler.predict.memory import rank_memory
from tpc.compiler.predict.quantities import format_quantity
from tpc.compiler.schedules.common import Compute
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Header, Instr, Op

CHOICES = ("none", "full")
OPTION = ("none", "full", "auto")  # what --recompute accepts


def uniform(header: Header, choice: str) -> dict[int, str]:
    """The same choice for every stage ('none' or 'full'); TpirError for anything else."""
    if choice not in CHOICES:
        raise TpirError(Diagnostic(f"--recompute {choice!r} is not a choice", where="--recompute",
                                   hint="use none, full or auto (auto needs --memory-per-rank)"))
    return {s: choice for s in range(header.num_stages)}


def apply(compute: Mapping[int, Sequence[Instr]], choice: Mapping[int, str]) -> Compute:
    """`compute` with the stages whose choice is 'full' recomputed (see the module docstring)."""
    for s, c in choice.items():
        if c not in CHOICES:
            raise ValueError(f"stage {s}: recompute choice {c!r} is not one of {CHOICES}")
    full = {s for s, c in choice.items() if c == "full"}
    out: Compute = {}
    for rank, instrs in compute.items():
        stream: list[Instr] = []
        for ins in instrs:
            if ins.stage in full:
                if ins.op is Op.FORWARD:
                    ins = dataclasses.replace(ins, checkpoint=True)
                elif ins.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
                    stream.append(Instr(Op.RECOMPUTE, stage=ins.stage, mb=ins.mb, slice=ins.slice))
            stream.append(ins)
        out[rank] = stream
    return out


def peaks(header: Header, compute: Mapping[int, Sequence[Instr]], costs: CostModel,
          optimizer_shards: int = 1) -> dict[int, float]:
    """Peak memory of every pipeline rank for this compute order, lowered (`optimizer_shards`:
    the ranks a sharded optimizer state is divided over, compiler/predict/memory.py)."""
    from tpc.compiler.lowering.lower import lower

    plan = lower(header, compute, verify=False)
    return {p.rank: rank_memory(header, p.rank, p.instrs, costs, optimizer_shards=optimizer_shards).peak.total
            for p in plan.ranks}


def choose(header: Header, compute: Mapping[int, Sequence[Instr]], costs: CostModel,
           budget: float | Sequence[float], optimizer_shards: int = 1) -> dict[int, str]:
    """Per stage 'none' or 'full' so that every rank's peak memory is within `budget` (one
    number for every rank, or one per pipeline rank), recomputing as few stages as the
    stage-aware rule of the module docstring needs; a TpirError located at --memory-per-rank
    when even recomputing every stage of a rank does not fit."""
    per_rank = ([float(budget)] * header.mesh.pipe if isinstance(budget, (int, float))
                else [float(b) for b in budget])
    choice = {s: "none" for s in range(header.num_stages)}
    current = peaks(header, compute, costs, optimizer_shards)
    for r in range(header.mesh.pipe):
        while current[r] > per_rank[r]:
            options = [s for s in sorted(header.stages_of_rank(r)) if choice[s] == "none"]
            if not options:
                raise _over_budget(header, r, current[r], per_rank[r], costs.memory_unit, optimizer_shards > 1)
            trials = []
            for s in options:
                trial = {**choice, s: "full"}
                trials.append((peaks(header, apply(compute, trial), costs, optimizer_shards)[r], s))
            best, s = min(trials)
            choice[s] = "full"
            current[r] = best
    return choice


def _over_budget(header: Header, rank: int, peak: float, budget: float, unit: str,
                 sharded: bool = False) -> TpirError:

    def format_bytes(n: float) -> str:
        return format_quantity(n, unit)

    return TpirError(Diagnostic(
        f"pipeline rank {rank} needs {format_bytes(peak)} even with every stage it holds "
        f"({', '.join(map(str, header.stages_of_rank(rank)))}) recomputed, over the budget of "
        f"{format_bytes(budget)}",
        where="--memory-per-rank",
        hint="raise --memory-per-rank, use more pipeline stages or token slices (each slice "
             "holds less), or a schedule that holds fewer micro-batches (1f1b, seq1f1b, zb-h1)"
             + ("" if sharded else "; with data-parallel replicas, shard the optimizer state "
                "(--shard-optimizer)")))
