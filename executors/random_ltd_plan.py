"""Random layerwise token dropping as the plan records it: a plan compiled with `--random-ltd`
carries a `random-ltd` line (its units and kept-token schedule), and the run drops as it says.

`run_options(plans, options)` is the RunOptions a run of `plans` trains with: the plan's
dropping (drawn from the run's seed, as `tpc run --random-ltd` draws), or `--random-ltd`'s for a
plan that records none (the plan was priced without it, and runs exactly either way). A run
flag that disagrees with the plan is refused, saying which to change; so are plans of one
curriculum bundle that disagree among themselves."""

from __future__ import annotations

import dataclasses

from tpc.compiler.random_ltd import describe, from_line, same_dropping
from tpc.executors.options import RunOptions
from tpc.ir.diagnostics import Diagnostic, TpirError


def run_options(plans, options: RunOptions) -> RunOptions:
    """`options` with the random-LTD the plans record (`plans`: a PlanSet; see the module
    docstring); `options` itself when no plan records one."""
    lines = {seq: p.header.random_ltd for seq, p in plans.plans.items()}
    recorded = [(seq, line) for seq, line in sorted(lines.items()) if line is not None]
    if not recorded:
        return options
    seq, line = recorded[-1]
    plan = plans.plans[seq]
    for other, o in sorted(lines.items()):
        if o != line:
            raise TpirError(Diagnostic(
                f"the bundle's plan of length {other} {'drops no tokens' if o is None else 'drops otherwise'} "
                f"and the plan of length {seq} records random-LTD", loc=line.loc, where=plan.source,
                hint="compile every plan of the bundle with the same --random-ltd and --random-ltd-schedule"))
    ltd = from_line(line, seed=1234 + options.seed)
    given = options.random_ltd
    if given is not None and not same_dropping(given, ltd):
        raise TpirError(Diagnostic(
            f"`{describe(given)}` disagrees with the plan, compiled with `{describe(ltd)}` (its partition "
            "and stage costs are priced for that dropping)", loc=line.loc, where=plan.source,
            hint="leave out --random-ltd and --random-ltd-schedule (the plan says them), or compile the plan "
                 "with the dropping you want"))
    return dataclasses.replace(options, random_ltd=ltd)
