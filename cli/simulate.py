"""`tpc simulate PLAN [--cost F | --device-model N | --unit] [--trace J] [--png P]
[--compare M]`: verify, simulate, print the table, write what was asked."""

from __future__ import annotations

from tpc.compiler import timeline
from tpc.compiler.costmodel.resolve import plan_cost_model
from tpc.compiler.sim_report import format_eval_report, format_report
from tpc.compiler.simulate import simulate
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.compiler.torch_schedule.load import load_checked_plan


def _writing(option: str, path: str, write) -> None:
    """Run `write`; a file that cannot be written is the user's error, not a traceback."""
    try:
        write()
    except OSError as e:
        raise TpirError(Diagnostic(
            f"cannot write {path}: {e.strerror or e}",
            where=option,
            hint="give a path in a folder that exists and that you may write to",
        )) from None


def cmd_simulate(args) -> int:
    plan = load_checked_plan(args.plan, needs_model=bool(args.cost or args.device_model))
    costs = plan_cost_model(plan.header, cost=args.cost, device_model=args.device_model,
                            source=args.plan)
    result = simulate(plan, costs)
    print(format_report(result, args.plan, costs.describe()))
    if plan.eval is not None:
        print()
        print(format_eval_report(simulate(plan.evaluation(), costs)))
    if args.trace:
        _writing("--trace", args.trace, lambda: timeline.write_trace(result, args.trace, args.plan))
        print(f"trace: {args.trace} (open it in https://ui.perfetto.dev)")
    if args.png:
        _writing("--png", args.png, lambda: timeline.write_gantt(result, args.png))
        print(f"timeline: {args.png}")
    if args.compare:
        comparison = timeline.compare(result, timeline.read_trace(args.compare))
        print(f"\npredicted vs measured ({args.compare}):")
        print(timeline.format_comparison(comparison))
    return 0
