"""Schedule builders: from a Header, each pipeline rank's compute order.

Each schedule is its own module with `NAME`, `PLACEMENT` (the name of the stage placement it is
made for, a key of `placement.PLACEMENTS`: where the compiler puts the stages when a rank holds
several) and `build(header, **params) -> dict[rank, list[Instr]]` (compute instructions only:
forward, backward, backward-input, backward-weight; a schedule with `OWN_RECOMPUTE = True` also
writes `checkpoint` forwards and `recompute`s, and `--recompute` adds none). Parameters are
keyword-only arguments of `build` with defaults; `build_schedule` refuses unknown ones with a located error. Adding a
schedule is one new module and one line in `SCHEDULES`; no other schedule changes.
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Callable

from tpc.compiler.schedules import (
    chimera,
    chimera_doubling,
    gpipe,
    interleaved,
    looped_bfs,
    one_f_one_b,
    seq1f1b,
    seq_interleaved,
    seq_zb,
    terapipe,
    zb_h1,
    zb_h2,
    zbv,
    dualpipev,
    full_critical_path,
    last_no_recompute,
    pre_recompute,
)
from tpc.compiler.schedules.common import Compute
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Header

MODULES: dict[str, ModuleType] = {
    mod.NAME: mod
    for mod in (gpipe, one_f_one_b, terapipe, seq1f1b, interleaved, looped_bfs, zb_h1, zb_h2,
                seq_zb, seq_interleaved, zbv, dualpipev, chimera, chimera_doubling, pre_recompute, last_no_recompute,
                full_critical_path)
}
SCHEDULES: dict[str, Callable[..., Compute]] = {name: mod.build for name, mod in MODULES.items()}


def _unknown(name: str) -> TpirError:
    known = ", ".join(sorted(SCHEDULES))
    return TpirError(Diagnostic(f"unknown schedule {name!r}", where="--schedule",
                                hint=f"choose one of: {known}"))


def parameters(name: str) -> dict[str, object]:
    """The parameters schedule `name` takes, with their defaults."""
    if name not in MODULES:
        raise _unknown(name)
    sig = inspect.signature(MODULES[name].build)
    return {p.name: p.default for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY}


def placement_of(name: str) -> str:
    """The stage placement schedule `name` is made for ('linear', 'looped' or 'vshape')."""
    if name not in MODULES:
        raise _unknown(name)
    return getattr(MODULES[name], "PLACEMENT", "linear")


def replicas(name: str) -> int:
    """How many weight replicas of each stage schedule `name` runs (2 for the bidirectional
    `chimera`, else 1); an unknown name counts 1."""
    return getattr(MODULES[name], "REPLICAS", 1) if name in MODULES else 1


def with_replicas(header: Header) -> Header:
    """`header` as its schedule needs it: for a bidirectional schedule each stage gets its
    second weight replica and each micro-batch its pipeline (`placement.bidirectional`);
    any other header is returned as it is."""
    if replicas(header.schedule.name) == 1:
        return header
    from tpc.compiler.schedules.placement import bidirectional

    return bidirectional(header)


def own_recompute(name: str) -> bool:
    """Whether schedule `name` places its own recomputation (`checkpoint` forwards and
    `recompute` instructions: Merak's critical-path 1F1B, compiler/schedules/critical_path.py),
    so that `--recompute` adds none; an unknown name: False."""
    return bool(getattr(MODULES[name], "OWN_RECOMPUTE", False)) if name in MODULES else False


# the schedules that split each backward into `backward-input` and `backward-weight` (run through
# a stage's traced programs, which packed documents do not take: `splits_backward`)
SPLIT_BACKWARD = ("zb-h1", "zb-h2", "seq-zb", "zbv", "dualpipev")


def splits_backward(name: str) -> bool:
    """Whether schedule `name` splits each backward in two (`SPLIT_BACKWARD`)."""
    return name in SPLIT_BACKWARD


def stages_per_rank(name: str) -> int:
    """2 for a schedule made for the V-shaped placement (stage i and 2p-1-i on rank i), else 1:
    how many stages `tpc compile` and the plan search put on each pipeline rank for it (an
    unknown name counts 1; `build_schedule` refuses it)."""
    return 2 if name in MODULES and placement_of(name) == "vshape" else 1


def build_schedule(name: str, header: Header, **params) -> Compute:
    """The compute order of schedule `name` for `header`; TpirError for an unknown name or
    parameter."""
    builder = SCHEDULES.get(name)
    if builder is None:
        raise _unknown(name)
    known = parameters(name)
    bad = sorted(set(params) - set(known))
    if bad:
        takes = ", ".join(known) or "none"
        raise TpirError(Diagnostic(f"schedule {name!r} has no parameter {bad[0]!r}",
                                   where=f"--schedule {name}",
                                   hint=f"its parameters: {takes}"))
    if header.replicas > 1 and replicas(name) == 1:
        raise TpirError(Diagnostic(
            f"schedule {name!r} runs one weight replica of each stage, and this header gives the "
            f"stages {header.replicas} (`stage S ranks ...`)", where=f"--schedule {name}",
            hint="give each stage one rank (`stage S rank R`), or use --schedule chimera"))
    return builder(header, **params)
