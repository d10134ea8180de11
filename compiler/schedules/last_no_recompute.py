"""Merak's LastNoRecomputeTrainSchedule: as `1f1b-pre-recompute`, but the last stage keeps its
activations.

The rules and how they follow Merak: compiler/schedules/critical_path.py.
"""

from __future__ import annotations

from tpc.compiler.schedules.common import Compute
from tpc.compiler.schedules.critical_path import build_variant
from tpc.ir.nodes import Header

NAME = "1f1b-last-no-recompute"
# the schedule writes its own `checkpoint` forwards and `recompute` instructions
OWN_RECOMPUTE = True


def build(header: Header) -> Compute:
    return build_variant(header, NAME, last_recomputes=False, swap=False)
