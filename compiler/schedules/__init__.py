"""Schedule builders: from a Header, each pipeline rank's compute order.

Each schedule is its own module with `NAME` and `build(header) -> dict[rank, list[Instr]]`
(forward/backward instructions only). Adding a schedule is one new module and one line in
`SCHEDULES`; no other schedule changes.
"""

from __future__ import annotations

from typing import Callable

from tpc.compiler.schedules import gpipe, one_f_one_b, seq1f1b, terapipe
from tpc.compiler.schedules.common import Compute
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Header

SCHEDULES: dict[str, Callable[[Header], Compute]] = {
    mod.NAME: mod.build for mod in (gpipe, one_f_one_b, terapipe, seq1f1b)
}


def build_schedule(name: str, header: Header) -> Compute:
    """The compute order of schedule `name` for `header`; TpirError for an unknown name."""
    builder = SCHEDULES.get(name)
    if builder is None:
        known = ", ".join(sorted(SCHEDULES))
        raise TpirError(
            Diagnostic(
                f"unknown schedule {name!r}",
                where="--schedule",
                hint=f"choose one of: {known}",
            )
        )
    return builder(header)
