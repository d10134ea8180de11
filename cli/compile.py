"""`tpc compile`: the flags read into `CompileOptions` by `check_options` (tpc.compiler.options:
the spellings, the defaults and every check are there), and the one library function called."""

from __future__ import annotations

from tpc.compiler.compile import compile_to_file
from tpc.compiler.options import (  # noqa: F401 (the spellings, read where the options are)
    DEFAULTS,
    CompileOptions,
    check_options,
    parse_memory,
    parse_microbatches,
    parse_slices,
    parse_stages,
)
from tpc.compiler.optimise.slicing import AUTO
from tpc.ir.diagnostics import Diagnostic, TpirError


def _error(option: str, message: str, hint: str) -> TpirError:
    return TpirError(Diagnostic(message, hint=hint, where=option))


def parse_lengths(spec) -> tuple[int, ...]:
    """`--seq-len`: one length, or comma-separated lengths (a plan bundle, one plan each)."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        return (spec,)
    parts = [p.strip() for p in str(spec).split(",")]
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        raise _error("--seq-len", f"--seq-len {spec!r} is not a length or a list of lengths",
                     "give the training sequence length, e.g. --seq-len 128, or several for a plan "
                     "bundle, e.g. --seq-len 64,128,256") from None


# the options `tpc compile` has a flag for, by field name (seq_len and batch are read apart)
FLAGS = ("stages", "microbatches", "slices", "schedule", "dp", "tensor", "sequence_parallel", "tensor_overlap", "ranks", "factory", "cost", "device_model",
         "memory_per_rank", "shard_optimizer", "explain", "quiet", "virtual_stages", "recompute", "comm", "exchanges",
         "print_after", "documents", "document_length", "random_ltd")


def print_after_names(values) -> tuple[str, ...]:
    """`--print-after`, given once or more, each a name or comma-separated names."""
    return tuple(n.strip() for v in values or () for n in str(v).split(",") if n.strip())


def document_length(spec, documents) -> int:
    """`--document-length N` or `--document-length FILE`: the mean document length, given or
    measured in a token file at the separator of `--documents`."""
    from tpc.compiler.options import parse_documents

    text = str(spec).strip()
    if text.isdigit():
        return int(text)
    eos = parse_documents(documents)
    if eos is None:
        raise _error("--document-length", "--document-length FILE measures documents at the separator of "
                     "--documents, which is not given", "add --documents eos:ID")
    from tpc.executors.training.token_file import document_profile

    return max(1, round(document_profile(text, eos).mean))


def options_from_args(args, seq_len: int | None = None) -> CompileOptions:
    """The flags as checked options; a flag left out (None) keeps the default of
    `CompileOptions` (the parser's defaults are read from it: cli/main.py)."""
    given = {name: getattr(args, name) for name in FLAGS if getattr(args, name) is not None}
    if "document_length" in given:  # a length, or a token file to measure it in
        given["document_length"] = document_length(given["document_length"], given.get("documents"))
    if "print_after" in given:
        given["print_after"] = print_after_names(given["print_after"])
    from tpc.compiler.random_ltd import from_pair

    # --random-ltd UNITS with --random-ltd-schedule S, read together (refused apart)
    ltd = from_pair(getattr(args, "random_ltd", None), getattr(args, "random_ltd_schedule", None))
    if ltd is not None:
        given["random_ltd"] = ltd
    return check_options(seq_len=parse_lengths(args.seq_len)[-1] if seq_len is None else seq_len,
                         batch=args.batch, **given)


def compile_schedule_from_args(args):
    """`tpc compile MODEL --schedule-file SCHED.csv`: the CSV fixes the schedule, the stages and
    their placement (and, unless given, the micro-batches)."""
    from tpc.compiler.torch_schedule.compile import compile_schedule_file

    if args.tensor is not None and str(args.tensor).strip() != "1":
        raise _error("--tensor", f"--tensor {args.tensor} with --schedule-file: a schedule file's plan "
                     "has no tensor axis (not built)", "leave out --tensor, or compile a built-in schedule "
                     "(--schedule NAME) with --tensor")
    for option, value in (("--schedule", args.schedule), ("--ranks", args.ranks), ("--cost", args.cost),
                          ("--device-model", args.device_model),
                          ("--memory-per-rank", args.memory_per_rank),
                          ("--virtual-stages", None if args.virtual_stages == DEFAULTS["virtual_stages"]
                           else args.virtual_stages),
                          ("--recompute", None if args.recompute == DEFAULTS["recompute"] else args.recompute)):
        if value is not None:
            raise _error(option, f"{option} with --schedule-file: the schedule file fixes the schedule, "
                         "the stages and their placement", f"leave out {option}")
    if getattr(args, "random_ltd", None) is not None:
        raise _error("--random-ltd", "--random-ltd with --schedule-file: a schedule file's plan does not record "
                     "random-LTD (not built)", "compile a built-in schedule (--schedule NAME) with --random-ltd, or "
                     "run the schedule file's plan with `tpc run --random-ltd ...`")
    if args.exchanges is not None and args.exchanges != DEFAULTS["exchanges"]:
        raise _error("--exchanges", f"--exchanges {args.exchanges} with --schedule-file: the plan of a "
                     "schedule file is lowered with batched exchanges only",
                     "leave out --exchanges, or compile a built-in schedule (--schedule NAME)")
    stages = None if args.stages is None else parse_stages(args.stages)
    microbatches = None if args.microbatches is None else parse_microbatches(args.microbatches)
    for option, value in (("--stages", stages), ("--microbatches", microbatches)):
        if value == AUTO:
            raise _error(option, f"{option} auto with --schedule-file: the schedule file says it",
                         f"leave out {option}")
    seq_len = parse_lengths(args.seq_len)[0]
    return compile_schedule_file(args.model, args.schedule_file, seq_len=seq_len, batch=args.batch,
                                 microbatches=microbatches, slices=parse_slices(args.slices, seq_len),
                                 dp=args.dp, stages=stages, factory=args.factory, quiet=args.quiet,
                                 print_after=print_after_names(args.print_after))


def cmd_compile(args) -> int:
    from tpc.ir.files import check_output

    lengths = parse_lengths(args.seq_len)
    bundle = len(lengths) > 1 or args.constant_tokens
    # before the compile (minutes for a large model): could -o be written at all?
    check_output(args.output, option="--output", folder=bundle)
    if bundle:
        from tpc.compiler.bundle import check_lengths, compile_bundle

        if args.schedule_file:
            raise _error("--schedule-file", "--schedule-file with several --seq-len lengths",
                         "compile a plan bundle from the schedule builders (leave out --schedule-file)")
        check_lengths(lengths, args.slices)  # before the options of the longest length are read
        compile_bundle(args.model, args.output, options_from_args(args, lengths[-1]), lengths,
                       constant_tokens=args.constant_tokens)
        return 0
    if args.schedule_file:
        from tpc.compiler.pipeline import write_plan

        write_plan(compile_schedule_from_args(args), args.output, quiet=args.quiet, comm=args.comm)
    else:
        compile_to_file(args.model, args.output, options_from_args(args))
    return 0
