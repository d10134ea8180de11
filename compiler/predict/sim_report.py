"""What `tpc simulate` prints: the per-rank table, the iteration time and where it goes."""

from __future__ import annotations

import math

from tpc.compiler.predict.quantities import format_quantity
from tpc.compiler.predict.simulate import SimResult
from tpc.compiler.predict.timeline import slices_summary
from tpc.ir.nodes import COMPUTE_OPS


def critical_path_summary(result: SimResult) -> str:
    """Where the iteration time goes: the ranks the critical path crosses, and how much of it
    is compute, other work and waiting for messages."""
    path = result.critical_path
    if not path:
        return "critical path: empty plan"
    hops = [path[0].rank]
    for e in path[1:]:
        if e.rank != hops[-1]:
            hops.append(e.rank)
    compute = math.fsum(e.work for e in path if e.instr.op in COMPUTE_OPS)
    other = math.fsum(e.work for e in path if e.instr.op not in COMPUTE_OPS)
    gaps = result.iteration_time - compute - other
    n_compute = sum(1 for e in path if e.instr.op in COMPUTE_OPS)
    u = result.time_unit
    return (
        f"critical path: {n_compute} compute instructions over ranks "
        f"{' > '.join(map(str, hops))}\n"
        f"  compute {format_quantity(compute, u)}, communication and other work "
        f"{format_quantity(other, u)}, transfers {format_quantity(gaps, u)}\n"
        f"  from `{path[0].instr}` (rank {path[0].rank}) to `{path[-1].instr}` (rank {path[-1].rank})"
    )


def format_report(result: SimResult, name: str, costs_text: str) -> str:
    """The table `tpc simulate` prints."""
    h = result.plan.header
    M = len(h.microbatches)
    t, m = result.time_unit, result.memory_unit
    lines = [
        f"{name}: schedule {h.schedule.name!r}, {h.num_stages} stages on {h.mesh.pipe} ranks, "
        f"{M} micro-batch{'es' if M != 1 else ''}, {slices_summary(h)}; {costs_text}",
        "",
        f"{'rank':>4}  {'busy':>14}  {'idle':>14}  {'bubble':>7}  {'peak memory':>14}",
    ]
    for r in result.ranks:
        lines.append(
            f"{r.rank:>4}  {format_quantity(r.busy, t):>14}  {format_quantity(r.idle, t):>14}  "
            f"{r.bubble:>7.1%}  {format_quantity(r.peak_memory.total, m):>14}"
        )
    lines += [
        "",
        f"iteration time: {format_quantity(result.iteration_time, t)}   "
        f"mean bubble: {result.bubble:.1%}",
        critical_path_summary(result),
    ]
    if m == "act":
        lines.append("memory in slice activations (graphs kept from a forward to its backward)")
    else:
        lines += ["", *memory_parts(result)]
    return "\n".join(lines)


# the parts of a rank's peak memory, as `tpc simulate` names them (compiler/predict/memory.py)
PARTS = (("params", "params"), ("grads", "grads"), ("optimizer", "optimizer"),
         ("activations", "activations"), ("kv", "kv cache"), ("kv_grads", "kv grads"),
         ("held_grads", "held grads"), ("messages", "messages"))


def memory_parts(result: SimResult) -> list[str]:
    """The peak of each rank by part: parameters, gradients, optimizer state (divided over the
    data-parallel group with --shard-optimizer), activations, KV caches and their gradients, a
    split backward's held gradients, received messages."""
    m = result.memory_unit
    shown = [(f, name) for f, name in PARTS
             if any(getattr(r.peak_memory, f) for r in result.ranks) or f in ("params", "grads", "optimizer")]
    head = f"{'rank':>4}  " + "  ".join(f"{name:>11}" for _, name in shown)
    rows = [f"{r.rank:>4}  " + "  ".join(f"{format_quantity(getattr(r.peak_memory, f), m):>11}" for f, _ in shown)
            for r in result.ranks]
    return ["peak memory by part" + (" (optimizer state sharded over the data-parallel group)"
                                     if result.shard_optimizer else ""), head, *rows]


def format_eval_report(result: SimResult) -> str:
    """One line for the plan's evaluation program (forward only): its predicted time per
    validation batch, its slicing, its mean bubble and the largest peak memory."""
    h = result.plan.header
    M = len(h.microbatches)
    t, m = result.time_unit, result.memory_unit
    peak = max(r.peak_memory.total for r in result.ranks)
    return (f"evaluation program (forward only): {M} micro-batch{'es' if M != 1 else ''}, "
            f"{slices_summary(h)}; {format_quantity(result.iteration_time, t)} per batch, "
            f"mean bubble {result.bubble:.1%}, peak memory {format_quantity(peak, m)}")
