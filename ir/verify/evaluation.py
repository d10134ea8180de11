"""Rules E1-E4 (see tpc.ir.verify): the evaluation program, checked as a plan of its own.

`Plan.evaluation()` is the evaluation program as a plan (the header with the evaluation's
micro-batches, its rank sections, `forward_only`); the instruction rules read `forward_only`
from its `Shape` and check E2-E4 where training has its own (program.py). Diagnostics of the
evaluation name "eval rank R" where a plan has no lines."""

from __future__ import annotations

from typing import Callable

from tpc.ir.nodes import EVAL_VERSION, Plan
from tpc.ir.verify.header import check_evaluation_header, require_version
from tpc.ir.verify.report import Report


def check_evaluation(plan: Plan, rep: Report, check_program: Callable[[Plan, Report], None]) -> None:
    """E1 here, then the instruction rules on the evaluation as a plan; its diagnostics join
    `rep`."""
    ev = plan.eval
    if not require_version(plan, rep, EVAL_VERSION, ev.loc, "eval", (2, 0, -2),
                           "the evaluation program (`eval`)"):
        return
    view = plan.evaluation()
    sub = Report(view, section="eval ")
    if check_evaluation_header(view, ev.loc, sub):
        check_program(view, sub)
    rep.merge(sub)
