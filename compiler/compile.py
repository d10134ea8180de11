"""`tpc compile`: from a model file to a verified plan, as a pipeline of named passes.

    load -> trace -> partition -> header | costs -> search -> eval-dp
         -> self-check -> schedule [-> recompute] -> lower -> eval [-> write]

The passes are in compiler/pipeline.py, the driver that runs them (verifying the plan after
every pass that makes or changes one, printing the IR after the passes `--print-after` names)
in compiler/passes.py, and the options, checked before the model is traced, in
compiler/options.py. `compile_plan` returns the Plan; `compile_to_file` also writes it,
atomically, after re-reading the written text and verifying that, so the file on disk is exactly
what was verified.
"""

from __future__ import annotations

from tpc.compiler.options import CompileOptions
from tpc.compiler.passes import CompileState, PassManager, Progress
from tpc.compiler.pipeline import PASS_NAMES, Write, compile_passes, written
from tpc.ir.nodes import Plan


def compile_plan(model_path: str, options: CompileOptions, split=None, *, output: str | None = None,
                 model=None) -> Plan:
    """Compile `model_path` into a verified plan: the passes `compile_passes(options, split)`
    (compiler/pipeline.py) run by one driver. `split`, a (pipe, data, stage unit ranges) triple,
    fixes the mesh and the stage partition (the plans of a bundle share one); the rest is chosen
    as the options say. With `output`, the `write` pass writes the plan there. `model`: a model
    object to compile as it is (the library's), `model_path` then the file of its class."""
    opts = options
    passes = compile_passes(opts, split)
    if output is not None:
        passes.append(Write(output, opts.comm))
    manager = PassManager(tuple(passes), comm=opts.comm, print_after=opts.print_after, quiet=opts.quiet,
                          known=PASS_NAMES)
    unused = [o for o, v in (("--memory-per-rank", opts.memory_per_rank), ("--explain", opts.explain)) if v]
    if unused and not opts.searching:
        Progress(opts.quiet).say(f"note: {', '.join(unused)} serve(s) the plan search, which needs "
                                 "--cost or --device-model; without one, --memory-per-rank only refuses a "
                                 "rank whose parameters and optimizer state alone do not fit")
    plan = manager.run(CompileState(model_path=model_path, factory=opts.factory, model=model)).plan
    if output is not None and not opts.quiet:
        print(written(plan, output))
    return plan


def compile_to_file(model_path: str, output: str, options: CompileOptions) -> Plan:
    """Compile, write the plan to `output` atomically, and return it. The written text is read
    back, parsed and verified (under the options' communication rules) before it replaces
    `output`."""
    return compile_plan(model_path, options, output=output)
