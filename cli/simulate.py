"""`tpc simulate PLAN [--cost F | --device-model N | --unit] [--trace J] [--png P]
[--compare M]`: verify, simulate, print the table, write what was asked."""

from __future__ import annotations

from dataclasses import replace

from tpc.compiler.costmodel.resolve import plan_cost_model
from tpc.compiler.predict import timeline
from tpc.compiler.predict.chrome_trace import read_trace
from tpc.compiler.predict.sim_report import format_eval_report, format_report
from tpc.compiler.predict.simulate import simulate
from tpc.compiler.torch_schedule.load import load_checked_plan
from tpc.ir.diagnostics import Diagnostic, TpirError


def _writing(option: str, path: str, write) -> None:
    """Run `write` (which writes through tpc.ir.files, so a failure says why in words); the
    error is located at `option`, the flag that named the file."""
    try:
        write()
    except TpirError as e:
        raise TpirError([replace(d, where=option) for d in e.diagnostics]) from None
    except OSError as e:  # e.g. matplotlib's own checks before it writes
        raise TpirError(Diagnostic(
            f"cannot write {path}: {e.strerror or e}",
            where=option,
            hint="give a path in a folder that exists and that you may write to",
        )) from None


def cmd_simulate(args) -> int:
    from tpc.ir.files import check_output
    from tpc.ir.verify.bundle import is_bundle

    for option, path in (("--trace", args.trace), ("--png", args.png)):
        if path:
            check_output(path, option=option)  # before the simulation
    if is_bundle(args.plan):
        return simulate_bundle(args)
    plan = load_checked_plan(args.plan, needs_model=bool(args.cost or args.device_model), comm=args.comm)
    costs = plan_cost_model(plan.header, cost=args.cost, device_model=args.device_model,
                            source=args.plan)
    result = simulate(plan, costs, args.comm, shard_optimizer=args.shard_optimizer)
    print(format_report(result, args.plan, costs.describe()))
    if plan.eval is not None:
        evaluation = plan.evaluation()
        if plan.header.random_ltd is not None and args.device_model:  # the evaluation drops no token
            costs = plan_cost_model(evaluation.header, cost=args.cost, device_model=args.device_model,
                                    source=args.plan)
        print()
        print(format_eval_report(simulate(evaluation, costs, args.comm)))
    if args.trace:
        _writing("--trace", args.trace, lambda: timeline.write_trace(result, args.trace, args.plan))
        print(f"trace: {args.trace} (open it in https://ui.perfetto.dev)")
    if args.png:
        _writing("--png", args.png, lambda: timeline.write_gantt(result, args.png))
        print(f"timeline: {args.png}")
    if args.compare:
        comparison = timeline.compare(result, read_trace(args.compare))
        print(f"\npredicted vs measured ({args.compare}):")
        print(timeline.format_comparison(comparison))
    return 0


def simulate_bundle(args) -> int:
    """A plan bundle: each plan's table, then one line per length side by side (the predicted
    step time, and the time per token, which a curriculum trades against the loss)."""
    from tpc.compiler.predict.timeline import slices_summary
    from tpc.compiler.predict.quantities import format_quantity
    from tpc.ir.verify.bundle import load_bundle

    for option in ("trace", "png", "compare"):
        if getattr(args, option):
            raise TpirError(Diagnostic(
                f"--{option} draws one plan, and {args.plan} is a plan bundle", where=f"--{option}",
                hint=f"simulate one plan of it: `tpc simulate {args.plan}/seqL.tpir --{option} ...`"))
    bundle = load_bundle(args.plan, args.comm)
    rows = []
    for member, plan in zip(bundle.index.members, bundle.plans):
        costs = plan_cost_model(plan.header, cost=args.cost, device_model=args.device_model,
                                source=plan.source)
        result = simulate(plan, costs, args.comm, shard_optimizer=args.shard_optimizer)
        print(format_report(result, plan.source, costs.describe()))
        print()
        t = result.time_unit
        h = plan.header
        rows.append((str(member.seq), str(h.shape.batch), h.schedule.name, slices_summary(h),
                     format_quantity(result.iteration_time, t),
                     format_quantity(result.iteration_time / h.tokens_per_step, t), f"{result.bubble:.1%}"))
    head = ("seq", "batch", "schedule", "slices", "step", "per token", "bubble")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    print(f"{args.plan}: {len(rows)} plans, one stage split")
    for r in [head, *rows]:
        print("  " + "  ".join(v.rjust(w) if i in (0, 1, 4, 5, 6) else v.ljust(w)
                               for i, (v, w) in enumerate(zip(r, widths))).rstrip())
    return 0
