"""Where the stages of a pipeline go: several model chunks per rank, in any placement.

A placement is the pipeline rank of each stage, `ranks[s]`. The header carries it (`stage S rank
R`); a schedule reads it from there, so the same builder serves any placement it accepts.

* `linear(K, p)`  stage s on rank s (K == p): one chunk per rank;
* `looped(K, p)`  stage s on rank s mod p (K a multiple of p): Megatron's interleaved placement,
                  rank r holds chunks r, r + p, r + 2p, ... (the "virtual stages");
* `vshape(K, p)`  K == 2p, stage i and stage 2p-1-i on rank i: the V of ZB-V and DualPipeV, where
                  the first and the last stage share rank 0 and the turn of the V is on rank p-1.

* `bidirectional(header)` K == p, stage s on ranks s and p-1-s, two weight replicas (Chimera):
                  micro-batch m runs on replica m mod 2 (format version 3).

`place(header, ranks)` gives a header with that placement (the mesh's pipeline size follows);
`chunks(header, rank)` the stages of a rank in pipeline order, its chunk 0, 1, ...
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Header


def linear(stages: int, ranks: int) -> tuple[int, ...]:
    _need(stages == ranks, f"{stages} stages on {ranks} ranks: one stage per rank needs as many "
          "stages as ranks", f"use --stages {ranks}")
    return tuple(range(stages))


def looped(stages: int, ranks: int) -> tuple[int, ...]:
    _need(ranks >= 1 and stages % ranks == 0,
          f"{stages} stages do not loop evenly over {ranks} ranks",
          f"give a number of stages that is a multiple of {ranks} (--stages {ranks} "
          "--virtual-stages V makes V x ranks stages)")
    return tuple(s % ranks for s in range(stages))


def vshape(stages: int, ranks: int) -> tuple[int, ...]:
    _need(stages == 2 * ranks, f"a V-shaped placement puts two stages on each rank: {stages} "
          f"stages on {ranks} ranks is not that", f"use {2 * ranks} stages on {ranks} ranks")
    return tuple(s if s < ranks else 2 * ranks - 1 - s for s in range(stages))


PLACEMENTS = {"linear": linear, "looped": looped, "vshape": vshape}


def _need(ok: bool, message: str, hint: str) -> None:
    if not ok:
        raise TpirError(Diagnostic(message, where="--virtual-stages", hint=hint))


def place(header: Header, ranks: Sequence[int]) -> Header:
    """`header` with stage s on pipeline rank `ranks[s]`; the mesh has max(ranks)+1 pipeline ranks."""
    if len(ranks) != header.num_stages:
        raise ValueError(f"{len(ranks)} ranks for {header.num_stages} stages")
    stages = tuple(dataclasses.replace(st, rank=int(r)) for st, r in zip(header.stages, ranks))
    mesh = dataclasses.replace(header.mesh, pipe=max(ranks) + 1)
    return dataclasses.replace(header, stages=stages, mesh=mesh)


def bidirectional(header: Header) -> Header:
    """`header` with two weight replicas of every stage, stage s on ranks s (the down pipeline,
    replica 0) and K-1-s (the up pipeline, replica 1), and micro-batch m on replica m mod 2;
    the mesh keeps K pipeline ranks. The schedule (`chimera.check_header`) refuses what this
    cannot make a valid pipeline of (an odd K, ties)."""
    from tpc.compiler.schedules import chimera

    K = header.num_stages
    ranks = chimera.stage_ranks(K)
    stages = tuple(dataclasses.replace(st, rank=ranks[st.index][0], replicas=ranks[st.index][1:])
                   for st in header.stages)
    mbs = tuple(dataclasses.replace(m, replica=chimera.microbatch_replica(m.index))
                for m in header.microbatches)
    mesh = dataclasses.replace(header.mesh, pipe=K)
    return dataclasses.replace(header, stages=stages, microbatches=mbs, mesh=mesh)


def chunks(header: Header, rank: int) -> tuple[int, ...]:
    """The stages of `rank` in pipeline order: its chunk 0, chunk 1, ..."""
    return tuple(sorted(header.stages_of_rank(rank)))


def is_looped(header: Header) -> bool:
    p = header.mesh.pipe
    return header.num_stages % p == 0 and all(st.rank == st.index % p for st in header.stages)


def virtual_stages(header: Header, schedule: str) -> int:
    """v, the chunks per rank of a looped placement; a TpirError for any other placement."""
    p, K = header.mesh.pipe, header.num_stages
    if not is_looped(header):
        where = ", ".join(f"stage {st.index} on rank {st.rank}" for st in header.stages)
        raise TpirError(Diagnostic(
            f"schedule {schedule!r} needs stage s on rank s mod {p} (the looped placement of "
            f"Megatron's virtual stages), but the plan has {where}",
            where=f"--schedule {schedule}",
            hint=f"give --stages a multiple of the ranks ({p}), or --virtual-stages V: "
                 "the compiler then places the stages in a loop"))
    return K // p
