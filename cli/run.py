"""`tpc run`: the flags read into `RunOptions`, then the executor the command line names:
`--interpret` runs every rank in this process (the reference interpreter); without it this
process is one rank under torchrun (the distributed executor), which torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK) places."""

from __future__ import annotations

from tpc.executors.options import RunOptions
from tpc.executors.training.optimizer import OptimSpec


def options_from_args(args) -> RunOptions:
    """RunOptions from parsed `tpc run` arguments; a meaningless combination is refused before
    any work (RunOptions checks itself). A flag not given (None) takes RunOptions' own default:
    the command line and the library have one set of defaults."""
    optim = _given(kind=args.optimizer, lr=args.lr, weight_decay=args.weight_decay)
    return RunOptions(
        optim=OptimSpec(**optim),
        **_given(steps=args.steps, seed=args.seed, lr_schedule=args.lr_schedule, warmup=args.warmup,
                 grad_clip=args.grad_clip, device=args.device, timeout=args.timeout,
                 save_every=args.save_every, tolerance=args.tolerance, eval_every=args.eval_every,
                 eval_batches=args.eval_batches),
        bf16=args.bf16, data=args.data, trace_path=args.trace, metrics=args.metrics,
        checkpoint_dir=args.checkpoint_dir, resume=args.resume, init_from=args.init_from,
        verify_grads=args.verify_grads, quiet=args.quiet, compile=args.compile, comm=args.comm,
        slice_pairs=getattr(args, "slice_pairs", True),
        eval_data=args.eval_data, save_best=args.save_best, allow_nonfinite_loss=args.allow_nonfinite_loss,
        shard_optimizer=args.shard_optimizer, random_ltd=_random_ltd(args), documents=_documents(args))


def _random_ltd(args):
    """`--random-ltd UNITS` with its `--random-ltd-schedule`, or None (a plan that records
    random-LTD needs neither: `tpc run` takes the plan's, executors/run.py)."""
    from tpc.compiler.random_ltd import from_pair

    return from_pair(getattr(args, "random_ltd", None), getattr(args, "random_ltd_schedule", None),
                     seed=1234 + (args.seed or 0))


def _documents(args):
    from tpc.compiler.options import parse_documents

    return parse_documents(getattr(args, "documents", None))


def _given(**flags) -> dict:
    return {k: v for k, v in flags.items() if v is not None}


def cmd_run(args) -> int:
    """The exit status: 0 ok; 1 on a refused plan or a failed gradient check."""
    from tpc.executors.run import CurriculumFlags
    from tpc.ir.diagnostics import Diagnostic, TpirError
    from tpc.ir.verify.bundle import is_bundle

    options = options_from_args(args)
    options.check_outputs()  # an unusable output path is refused now, not after the training
    bundle = is_bundle(args.plan)
    if args.curriculum and not bundle:
        raise TpirError(Diagnostic(f"--curriculum switches between the plans of a bundle, and {args.plan} "
                                   "is one plan", where="--curriculum",
                                   hint="compile a bundle: `tpc compile MODEL -o PLANS --seq-len 64,128,256 ...`, "
                                        "and run `tpc run PLANS --curriculum ...`"))
    if bundle and not args.curriculum:
        raise TpirError(Diagnostic(f"{args.plan} is a plan bundle: which plan runs at which step is the "
                                   "curriculum's to say", where="--curriculum",
                                   hint="add --curriculum fixed_linear:START:END:STEPS (see `tpc run --help`), "
                                        f"or run one plan: {args.plan}/seqL.tpir"))
    curriculum = CurriculumFlags(args.curriculum, args.curriculum_type) if args.curriculum else None
    if args.interpret:
        from tpc.executors.run import interpret_main

        return interpret_main(args.plan, options, curriculum)
    from tpc.executors.distributed import World, main

    return main(args.plan, options, World.from_env(), curriculum)
