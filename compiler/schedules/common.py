"""Helpers every schedule builder shares: work units, instruction constructors, projection.

A schedule builder turns a `Header` into each pipeline rank's COMPUTE order: a list of
forward/backward instructions per rank, nothing else (loads, communication, gradient
reduction and the optimizer step are added by `tpc.compiler.lowering.lower`).

Two ways of building one appear in the builders:

* a single global order of every compute instruction that respects the dependencies of
  DESIGN.md section 4, projected onto each rank (`project`). Any projection of one valid
  sequential execution is deadlock-free with buffered sends, whatever ranks hold whatever
  stages. (With several stages per rank, two ranks may need a channel's messages in another
  order than they are produced; `insert_comm` then delays sends into the receiver's order,
  which keeps the global execution valid: every send still precedes its receive.)
* a per-stage order computed from the stage's position in the pipeline (1F1B-style warm-up),
  which needs exactly one stage per rank (`one_stage_per_rank`).
"""

from __future__ import annotations

from typing import Iterable

from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Header, Instr, Op

Unit = tuple[int, int]  # (micro-batch, slice)
Compute = dict[int, list[Instr]]


def forward(stage: int, mb: int, slice_: int) -> Instr:
    return Instr(Op.FORWARD, stage=stage, mb=mb, slice=slice_)


def backward(stage: int, mb: int, slice_: int) -> Instr:
    return Instr(Op.BACKWARD, stage=stage, mb=mb, slice=slice_)


def slice_counts(header: Header) -> list[int]:
    """Number of token slices of each micro-batch (they may differ between micro-batches)."""
    return [len(m.slices) for m in header.microbatches]


def forward_units(header: Header) -> list[Unit]:
    """Every (mb, slice) in forward order: micro-batch by micro-batch, slices in token order."""
    return [(m, i) for m, n in enumerate(slice_counts(header)) for i in range(n)]


def backward_units(header: Header, mbs: Iterable[int]) -> list[Unit]:
    """The (mb, slice) units of `mbs`, in that micro-batch order, each mb's slices reversed:
    slice i's backward needs the key/value gradients slices > i sent into it."""
    counts = slice_counts(header)
    return [(m, i) for m in mbs for i in reversed(range(counts[m]))]


def empty(header: Header) -> Compute:
    """One (empty) compute list per pipeline rank, so ranks without stages still appear."""
    return {r: [] for r in range(header.mesh.pipe)}


def project(header: Header, order: Iterable[Instr]) -> Compute:
    """Split one global compute order into per-rank lists, keeping the relative order."""
    out = empty(header)
    for instr in order:
        out.setdefault(header.stage_rank(instr.stage, instr.mb), []).append(instr)
    return out


def forwards_then_backwards(header: Header, backward_mbs: Iterable[int]) -> Compute:
    """Every forward of the step (micro-batch by micro-batch, slices in token order, each unit
    through every stage in turn), then every backward (the micro-batches in the order
    `backward_mbs`, each one's slices reversed, each unit back through the stages), as one global
    order projected onto the ranks. GPipe and TeraPipe differ only in `backward_mbs`."""
    stages = range(header.num_stages)
    order = [forward(s, m, i) for m, i in forward_units(header) for s in stages]
    order += [backward(s, m, i) for m, i in backward_units(header, backward_mbs) for s in reversed(stages)]
    return project(header, order)


def one_stage_per_rank(header: Header, schedule: str) -> list[int]:
    """The stage of each pipeline rank; a TpirError when a rank holds none or several."""
    stages = []
    for r in range(header.mesh.pipe):
        held = header.stages_of_rank(r)
        if len(held) != 1:
            raise TpirError(
                Diagnostic(
                    f"schedule {schedule!r} needs exactly one stage per pipeline rank, "
                    f"but rank {r} holds {len(held)} ({', '.join(map(str, held)) or 'none'})",
                    where=f"schedule {schedule!r}",
                    hint="give each pipeline rank one stage (stage S on rank S), or use the "
                    "'gpipe' or 'terapipe' schedule, which accept several stages per rank",
                )
            )
        stages.append(held[0])
    return stages


def one_f_one_b(forwards: list, backwards: list, warmup: int) -> list:
    """Interleave two work lists the 1F1B way: `warmup` forwards, then alternately one
    forward and one backward while forwards remain, then the remaining backwards."""
    warmup = max(0, min(warmup, len(forwards)))
    out = list(forwards[:warmup])
    b = 0
    for f in forwards[warmup:]:
        out.append(f)
        out.append(backwards[b])
        b += 1
    out.extend(backwards[b:])
    return out


def vshape_chunks(header: Header, schedule: str) -> dict[int, tuple[int, int]]:
    """(chunk 0, chunk 1) = (stage r, stage 2p-1-r) of each rank r of a V-shaped placement
    (`placement.vshape`); a TpirError naming the placement otherwise."""
    p, K = header.mesh.pipe, header.num_stages
    ok = K == 2 * p and all(st.rank == (st.index if st.index < p else K - 1 - st.index)
                            for st in header.stages)
    if not ok:
        where = ", ".join(f"stage {st.index} on rank {st.rank}" for st in header.stages)
        raise TpirError(Diagnostic(
            f"schedule {schedule!r} runs a V: 2p stages on p ranks, stage i and stage 2p-1-i on "
            f"rank i; but the plan has {K} stage{'s' if K != 1 else ''} ({where})",
            where=f"--schedule {schedule}",
            hint=f"give an even number of stages: --stages {2 * max(1, K // 2)} puts them on "
                 f"{max(1, K // 2)} ranks in a V"))
    return {r: (r, K - 1 - r) for r in range(p)}


def expand(header: Header, op: Op, stage: int, mb: int) -> list[Instr]:
    """One micro-batch's work on one stage as slice instructions: a forward in token order,
    any backward kind in reverse token order (the key/value gradients of later slices)."""
    n = len(header.microbatches[mb].slices)
    order = range(n) if op is Op.FORWARD else reversed(range(n))
    return [Instr(op, stage=stage, mb=mb, slice=i) for i in order]
