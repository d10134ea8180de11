"""`tpc run`: the flags read into `RunOptions`, then the executor the command line names:
`--interpret` runs every rank in this process (the reference interpreter); without it this
process is one rank under torchrun (the distributed executor), which torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK) places."""

from __future__ import annotations

from tpc.executors.options import RunOptions
from tpc.executors.training.optimizer import OptimSpec


def options_from_args(args) -> RunOptions:
    """RunOptions from parsed `tpc run` arguments; a meaningless combination is refused before
    any work (RunOptions checks itself)."""
    return RunOptions(
        steps=args.steps, seed=args.seed,
        optim=OptimSpec(kind=args.optimizer, lr=args.lr, weight_decay=args.weight_decay),
        lr_schedule=args.lr_schedule, warmup=args.warmup, grad_clip=args.grad_clip,
        device=args.device, bf16=args.bf16, timeout=args.timeout, data=args.data,
        trace_path=args.trace, metrics=args.metrics, checkpoint_dir=args.checkpoint_dir,
        save_every=args.save_every, resume=args.resume, init_from=args.init_from, verify_grads=args.verify_grads,
        tolerance=args.tolerance, quiet=args.quiet, comm=args.comm, eval_data=args.eval_data,
        eval_every=args.eval_every, eval_batches=args.eval_batches, save_best=args.save_best)


def cmd_run(args) -> int:
    """The exit status: 0 ok; 1 on a refused plan or a failed gradient check."""
    options = options_from_args(args)
    if args.interpret:
        from tpc.executors.run import interpret_plan
        from tpc.ir.verify import verify_file

        rules = options.comm_rules(options.torch_device(), interpreted=True)
        return interpret_plan(verify_file(args.plan, rules), options)
    from tpc.executors.distributed import World, main

    return main(args.plan, options, World.from_env())
