"""`tpc compile`: the command line's spelling of the compile options, read into
`CompileOptions` (tpc.compiler.compile), which checks them against each other.

    --stages N|auto          --microbatches N|auto
    --slices N|l1,l2,...|auto                         --memory-per-rank 16GiB|512MiB|80GB|...
"""

from __future__ import annotations

import re

from tpc.compiler.compile import CompileOptions, compile_to_file
from tpc.compiler.slicing import AUTO, slice_example
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.semantics import DEFAULT_COMM


def _error(option: str, message: str, hint: str) -> TpirError:
    return TpirError(Diagnostic(message, hint=hint, where=option))


def _count(option: str, spec, example: str) -> int | str:
    """A positive count, or AUTO; a non-number is refused naming the option."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        return spec
    text = str(spec).strip()
    if text.lower() == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise _error(option, f"{option} {spec!r} is not a number", example) from None


def parse_stages(spec) -> int | str:
    """`--stages`: a count, or 'auto' (the plan search picks the mesh)."""
    return _count("--stages", spec, "give the number of pipeline stages, e.g. --stages 2")


def parse_microbatches(spec) -> int | str:
    """`--microbatches`: a count, or 'auto' (the optimiser's batch knapsack chooses)."""
    return _count("--microbatches", spec,
                  "give the number of micro-batches per step, e.g. --microbatches 4, or auto")


def parse_slices(spec, seq_len: int) -> int | tuple[int, ...] | str:
    """`--slices`: 'N' (a count of equal slices), 'l1,l2,...' (lengths) or 'auto'. The values
    are checked against `seq_len` by CompileOptions; here only the spelling."""
    text = str(spec).strip()
    if text.lower() == AUTO:
        return AUTO
    form_hint = (f"give a slice count N (1..{seq_len}), comma-separated lengths summing to {seq_len} "
                 f"(e.g. {slice_example(seq_len)}), or 'auto'")
    parts = [p.strip() for p in text.split(",")]
    if not text or any(not p for p in parts):
        raise _error("--slices", f"empty slice length in {spec!r}", form_hint)
    values = []
    for p in parts:
        try:
            values.append(int(p))
        except ValueError:
            raise _error("--slices", f"{p!r} in {spec!r} is not a whole number", form_hint) from None
    return values[0] if len(values) == 1 else tuple(values)


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_memory(text: str) -> float:
    """`--memory-per-rank`: bytes from '16GiB', '512 MiB', '1.5GB', '1000000' (KiB/MiB/GiB/TiB
    are powers of 1024, kB/MB/GB/TB of 1000, a bare number is bytes)."""
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise _error("--memory-per-rank", f"--memory-per-rank {text!r} is not a memory size",
                     "give a positive size with a unit, e.g. 16GiB, 512MiB or 80GB")
    return float(m.group(1)) * _UNITS[unit]


def check_options(*, stages, microbatches, seq_len, batch, slices="1", schedule="seq1f1b", dp=1,
                  ranks=None, factory="model", cost=None, device_model=None,
                  memory_per_rank=None, explain=False, quiet=False, virtual_stages=1,
                  recompute="none", comm=DEFAULT_COMM) -> CompileOptions:
    """The compile options as the command line spells them, read and checked. Nothing here
    needs the model: every mistake is reported before tracing."""
    schedule = str(schedule).strip()
    return CompileOptions(
        seq_len=seq_len, batch=batch, stages=parse_stages(stages),
        microbatches=parse_microbatches(microbatches),
        slices=parse_slices(slices, seq_len) if isinstance(seq_len, int) and seq_len >= 1 else slices,
        schedule=AUTO if schedule.lower() == AUTO else schedule, dp=dp, ranks=ranks, factory=factory,
        cost=cost, device_model=device_model,
        memory_per_rank=None if memory_per_rank is None else parse_memory(memory_per_rank),
        explain=explain, quiet=quiet, virtual_stages=virtual_stages, recompute=str(recompute).strip().lower(),
        comm=comm)


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


def options_from_args(args, seq_len: int | None = None) -> CompileOptions:
    return check_options(
        stages=2 if args.stages is None else args.stages,
        microbatches=1 if args.microbatches is None else args.microbatches,
        seq_len=parse_lengths(args.seq_len)[-1] if seq_len is None else seq_len, batch=args.batch,
        slices=args.slices,
        schedule="seq1f1b" if args.schedule is None else args.schedule, dp=args.dp,
        ranks=args.ranks, factory=args.factory, cost=args.cost, device_model=args.device_model,
        memory_per_rank=args.memory_per_rank, explain=args.explain, quiet=args.quiet,
        virtual_stages=args.virtual_stages, recompute=args.recompute, comm=args.comm)


def compile_schedule_from_args(args):
    """`tpc compile MODEL --schedule-file SCHED.csv`: the CSV fixes the schedule, the stages and
    their placement (and, unless given, the micro-batches)."""
    from tpc.compiler.torch_schedule.compile import compile_schedule_file

    for option, value in (("--schedule", args.schedule), ("--ranks", args.ranks), ("--cost", args.cost),
                          ("--device-model", args.device_model),
                          ("--memory-per-rank", args.memory_per_rank),
                          ("--virtual-stages", None if args.virtual_stages == 1 else args.virtual_stages),
                          ("--recompute", None if args.recompute == "none" else args.recompute)):
        if value is not None:
            raise _error(option, f"{option} with --schedule-file: the schedule file fixes the schedule, "
                         "the stages and their placement", f"leave out {option}")
    stages = None if args.stages is None else parse_stages(args.stages)
    microbatches = None if args.microbatches is None else parse_microbatches(args.microbatches)
    for option, value in (("--stages", stages), ("--microbatches", microbatches)):
        if value == AUTO:
            raise _error(option, f"{option} auto with --schedule-file: the schedule file says it",
                         f"leave out {option}")
    seq_len = parse_lengths(args.seq_len)[0]
    return compile_schedule_file(args.model, args.schedule_file, seq_len=seq_len, batch=args.batch,
                                 microbatches=microbatches, slices=parse_slices(args.slices, seq_len),
                                 dp=args.dp, stages=stages, factory=args.factory, quiet=args.quiet)


def cmd_compile(args) -> int:
    lengths = parse_lengths(args.seq_len)
    if len(lengths) > 1 or args.constant_tokens:
        from tpc.compiler.bundle import compile_bundle

        if args.schedule_file:
            raise _error("--schedule-file", "--schedule-file with several --seq-len lengths",
                         "compile a plan bundle from the schedule builders (leave out --schedule-file)")
        compile_bundle(args.model, args.output, options_from_args(args, lengths[-1]), lengths,
                       constant_tokens=args.constant_tokens)
        return 0
    if args.schedule_file:
        from tpc.compiler.compile import write_plan

        write_plan(compile_schedule_from_args(args), args.output, quiet=args.quiet, comm=args.comm)
    else:
        compile_to_file(args.model, args.output, options_from_args(args))
    return 0
