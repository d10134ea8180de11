"""`tpc compile --seq-len 64,128,256 -o FOLDER`: a plan bundle, one verified plan per length.

The longest length is compiled first, exactly as `tpc compile` compiles one plan (with a cost
model the search chooses the mesh, the stage partition, micro-batches, slices and schedule).
Its mesh and stage partition are then fixed for every shorter length, so that a run switching
plans between steps (a sequence-length curriculum, executors/curriculum.py) never moves a
weight; for each shorter length the slices, the micro-batches and, with a cost model and
`--schedule auto`, the schedule are chosen again for that length (TeraPipe: the best slicing
depends on the length).

The batch of each plan is `--batch` (DeepSpeed's `seqlen_truncate`: shorter sequences, as many),
or with `constant_tokens` `--batch x longest / length` (`seqlen_reshape`: the tokens of a step
stay the same; each length must divide the longest).

Written: FOLDER/seqL.tpir for each length, then FOLDER/index.tpir (ir/verify/bundle.py), each
file atomically; the folder is read back and verified (every plan under the options' `comm`
rules, and rules B1-B4) before the function returns.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tpc.compiler.compile import compile_plan

from tpc.compiler.options import CompileOptions

from tpc.compiler.pipeline import write_plan
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Bundle, BundleLine, BundleMember, Plan
from tpc.ir.verify.bundle import INDEX, LoadedBundle, load_bundle


def _error(option: str, message: str, hint: str) -> TpirError:
    return TpirError(Diagnostic(message, hint=hint, where=option))


def member_file(seq: int) -> str:
    return f"seq{seq}.tpir"


def check_lengths(lengths: tuple[int, ...], slices=None) -> None:
    """The `--seq-len` list of a bundle, and `--slices` (as given: a count, lengths or 'auto')
    against it, each mistake said at the flag that makes it: a length that is not positive,
    out of order or shorter than the slice count is the list's; lengths given to --slices for
    several sequence lengths are --slices'."""
    said = ",".join(map(str, lengths))
    if len(lengths) < 2:
        raise _error("--seq-len", "a plan bundle needs at least two lengths",
                     "give comma-separated lengths, e.g. --seq-len 64,128,256")
    bad = next((n for n in lengths if n < 1), None)
    if bad is not None:
        raise _error("--seq-len", f"--seq-len {said}: the length {bad} is not a positive number of tokens",
                     "give lengths of at least one token, distinct and increasing, e.g. --seq-len 64,128,256")
    if list(lengths) != sorted(set(lengths)):
        raise _error("--seq-len", f"--seq-len {said}: lengths must be distinct and increasing",
                     "e.g. --seq-len 64,128,256,512")
    spec = str(slices).strip() if slices is not None else ""
    if isinstance(slices, tuple) or "," in spec:
        raise _error("--slices", "--slices with lengths fits one sequence length, not several",
                     "give a count of equal slices (each length is cut into that many), or 'auto'")
    count = slices if isinstance(slices, int) else int(spec) if spec.isdigit() else None
    if count is not None and count > lengths[0]:
        raise _error("--seq-len", f"--seq-len {said}: the length {lengths[0]} is shorter than --slices "
                     f"{count} (each slice holds at least one token)",
                     f"give lengths of at least {count} tokens, or at most --slices {lengths[0]}, or --slices auto")


def bundle_options(options: CompileOptions, lengths: tuple[int, ...], constant_tokens: bool
                   ) -> dict[int, CompileOptions]:
    """The options of each length's plan, checked before anything is traced. `options` are
    those of the longest length."""
    check_lengths(lengths, options.slices)
    longest = lengths[-1]
    out: dict[int, CompileOptions] = {}
    for seq in lengths:
        batch = options.batch
        if constant_tokens:
            if (options.batch * longest) % seq:
                raise _error("--constant-tokens", f"a step of {options.batch} x {longest} tokens does "
                             f"not reshape into whole sequences of {seq}",
                             "choose lengths that divide the longest one, e.g. 64,128,256,512")
            batch = options.batch * longest // seq
        try:
            out[seq] = dataclasses.replace(options, seq_len=seq, batch=batch)
        except TpirError as e:
            raise TpirError([dataclasses.replace(d, message=f"at length {seq}: {d.message}")
                             for d in e.diagnostics]) from None
    return out


def compile_bundle(model_path: str, output: str, options: CompileOptions, lengths: tuple[int, ...],
                   *, constant_tokens: bool = False, model=None) -> LoadedBundle:
    """Compile one plan per length into the folder `output` (see the module docstring).
    `model`: a model object to compile as it is (the library's; `model_path` its class's file)."""
    per_length = bundle_options(options, tuple(lengths), constant_tokens)
    folder = Path(output)
    if folder.exists() and not folder.is_dir():
        raise _error("--output", f"{output} is a file; a plan bundle is written into a folder",
                     "give a folder name (it is created), e.g. -o plans")
    if not folder.parent.resolve().is_dir():
        raise _error("--output", f"no such folder: {folder.parent}", "create it first, or write elsewhere")
    longest = lengths[-1]
    say = (lambda text: None) if options.quiet else (lambda text: print(text, flush=True))
    say(f"length {longest}:")
    first = compile_plan(model_path, per_length[longest], model=model)
    h = first.header
    split = (h.mesh.pipe, h.mesh.data, tuple(s.units for s in h.stages))
    plans: dict[int, Plan] = {longest: first}
    for seq in lengths[:-1]:
        say(f"length {seq} (stage split of length {longest}: "
            + " | ".join(f"{lo}:{hi}" for lo, hi in split[2]) + "):")
        o = dataclasses.replace(per_length[seq], stages=split[0], dp=split[1], ranks=None,
                                tensor=h.mesh.tensor)
        plans[seq] = compile_plan(model_path, o, split, model=model)
    folder.mkdir(exist_ok=True)
    for seq in lengths:
        write_plan(plans[seq], str(folder / member_file(seq)), quiet=options.quiet, comm=options.comm)
    index = bundle_index(plans)
    from tpc.ir.files import atomic_write_text
    from tpc.ir.printer import print_bundle

    atomic_write_text(folder / INDEX, print_bundle(index))
    loaded = load_bundle(str(folder), options.comm)
    say(f"wrote {folder / INDEX}: {len(lengths)} plans (lengths {', '.join(map(str, lengths))}), "
        f"one stage split")
    return loaded


def bundle_index(plans: dict[int, Plan]) -> Bundle:
    """The index of plans that share one split (the longest one's lines are recorded)."""
    longest = plans[max(plans)].header
    members = tuple(BundleMember(path=member_file(seq), seq=seq, batch=plans[seq].header.shape.batch)
                    for seq in sorted(plans))
    return Bundle(bundle=BundleLine(), model=longest.model, mesh=longest.mesh, units=longest.units,
                  stages=longest.stages, ties=longest.ties, members=members)
