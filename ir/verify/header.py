"""Header rules H1-H8 (see tpc.ir.verify): the format version, the model and dtype, stages,
units, ties, micro-batches and their slices, and the rank sections."""

from __future__ import annotations

import re

from tpc.ir.nodes import (DOCUMENTS_VERSION, FORMAT_VERSION, FORMAT_VERSIONS, RANDOM_LTD_VERSION, REPLICA_VERSION, SEQUENCE_VERSION, TENSOR_VERSION, Loc,
                          Op, Plan)
from tpc.ir.verify.report import Report

# parameter dtypes a plan may name (`shape ... dtype D`); the executors map them to torch dtypes
DTYPES = ("float32", "float16", "bfloat16", "float64")
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


def check_header(plan: Plan, rep: Report) -> bool:
    """Rules H1-H8. False when the numbering is too broken to check the instructions."""
    h = plan.header
    ok = True
    if h.version not in FORMAT_VERSIONS:
        rep.add(h.version_loc, "header (tpir)", (0, 0), f"unknown format version {h.version}",
                f"this tpc reads `tpir {FORMAT_VERSION}` and the older versions "
                + ", ".join(str(v) for v in sorted(FORMAT_VERSIONS) if v != FORMAT_VERSION))
    _check_model_and_dtype(plan, rep)
    _check_documents(plan, rep)
    _check_random_ltd(plan, rep)
    check_tensor_axis(plan, rep)
    ok &= _check_stages(plan, rep)
    _check_units(plan, rep)
    _check_ties(plan, rep)
    ok &= _check_microbatches(plan, rep)
    ok &= _check_sections(plan, rep)
    return ok


def require_version(plan: Plan, rep: Report, needed: int, loc: Loc | None, where: str,
                    order: tuple, what: str) -> bool:
    """Rule H1 for a line or instruction added in format version `needed`: a plan whose version
    line is older may not use it. Every addition to the format calls this where it is checked.
    `plan` may also be a plan bundle's index (which has its own version line)."""
    have = plan.header.version if hasattr(plan, "header") else plan.version
    if have >= needed:
        return True
    rep.add(loc, where, order, f"{what} needs format version {needed}, and this plan says `tpir {have}`",
            f"write `tpir {needed}` on the plan's first line (a version-{have} plan that does not "
            f"use it stays readable as it is)")
    return False


def check_evaluation_header(view: Plan, loc: Loc | None, rep: Report) -> bool:
    """E1: the evaluation's micro-batches (H5) and rank sections (H6), on the evaluation as a
    plan (`Plan.evaluation()`). False when the numbering is too broken to go on."""
    if not view.header.microbatches:
        rep.add(loc, "eval", (2, 0, -1), "the evaluation program has no micro-batches",
                "add `microbatch 0 size N slices 0:L` lines below `eval`")
        return False
    ok = _check_microbatches(view, rep)
    for k, mb in enumerate(view.header.microbatches):
        if mb.replica:
            rep.add(mb.loc, f"eval, microbatch line {k}", (2, 0, -1),
                    f"evaluation microbatch {mb.index} runs on replica {mb.replica}: an evaluation "
                    "runs on replica 0's pipeline, where its loss is summed",
                    "drop `replica` from the evaluation's micro-batches")
    if len(view.ranks) != view.header.mesh.pipe:
        rep.add(loc, "eval", (2, 0, -1),
                f"the evaluation program has {len(view.ranks)} rank sections, the mesh "
                f"{view.header.mesh.pipe} pipeline ranks",
                f"give the evaluation one `rank R` section per pipeline rank 0.."
                f"{view.header.mesh.pipe - 1}")
        return False
    return ok and _check_sections(view, rep)


def _check_model_and_dtype(plan: Plan, rep: Report) -> None:
    h = plan.header
    if not _SHA256.fullmatch(h.model.sha256):
        rep.add(h.model.loc, "header (model)", (0, 1),
                f"\"{h.model.sha256}\" is not a SHA-256 digest",
                "write the 64 hex digits of the model file's SHA-256 (`sha256sum FILE`); "
                "`tpc run` compares it with the file")
    if h.shape.dtype not in DTYPES:
        rep.add(h.shape.loc, "header (shape)", (0, 2), f"unknown dtype {h.shape.dtype}",
                "use one of " + ", ".join(DTYPES))


def _check_documents(plan: Plan, rep: Report) -> None:
    """H7: `documents eos ID mean M` needs format version 6 (H1); the separator is a token of the
    vocabulary and the mean document length at most the row's; the plan has no tensor axis
    (a rank of a tensor group would cut the documents of a row in parts). Every rank that runs
    a stage of a micro-batch loads it (its document boundaries; rules O3 and C3). No backward is
    split (`backward-input`): the executors run packed documents eagerly."""
    h = plan.header
    d = h.documents
    if d is None:
        return
    require_version(plan, rep, DOCUMENTS_VERSION, d.loc, "header (documents)", (0, 2), "`documents`")
    if d.eos >= h.shape.vocab:
        rep.add(d.loc, "header (documents)", (0, 2),
                f"the separator id {d.eos} is outside the vocabulary of {h.shape.vocab}",
                f"name the corpus's end-of-document token, an id below {h.shape.vocab}")
    if d.mean > h.shape.seq:
        rep.add(d.loc, "header (documents)", (0, 2),
                f"a mean document length of {d.mean} tokens is longer than the row of {h.shape.seq}",
                f"packed rows hold whole documents: give the corpus's mean length, at most {h.shape.seq}")
    if h.mesh.tensor != 1:
        rep.add(d.loc, "header (documents)", (0, 2),
                "packed documents on a mesh with a tensor axis: not supported",
                "drop `tensor` from the mesh line, or the documents line")
    split = next(((r, i) for r in plan.ranks for i in r.instrs if i.op in (Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)), None)
    if split is not None:
        rep.add(split[1].loc or d.loc, "header (documents)", (0, 2),
                f"`{split[1]}` in a plan over packed documents: a split backward runs a stage's traced "
                "programs, which do not take document boundaries; packed documents run each stage eagerly",
                "compile the plan with a schedule whose backward is whole (seq1f1b, terapipe, 1f1b, gpipe, ...)")


def _check_random_ltd(plan: Plan, rep: Report) -> None:
    """H8: `random-ltd units ... min-value K0 max-value K1 require-steps N seq-per-step Q` needs
    format version 6 (H1); its units are distinct middle units of the model, ascending (the
    first and the last unit, the embedding and the head, run every token); K0 <= K1 (the kept
    count grows). Refused with a tensor axis, with packed documents, and with a split backward
    (`backward-input`): a dropped unit runs under eager autograd on kept tokens the executor
    draws, and those run the stages' traced programs or cut a row's documents by position."""
    h = plan.header
    d = h.random_ltd
    if d is None:
        return
    where, order = "header (random-ltd)", (0, 2)
    require_version(plan, rep, RANDOM_LTD_VERSION, d.loc, where, order, "`random-ltd`")
    last = h.units.count - 1
    bad = [u for u in d.units if not 0 < u < last]
    if bad:
        rep.add(d.loc, where, order,
                f"random-ltd drops tokens in unit{'s' * (len(bad) > 1)} {', '.join(map(str, bad))}: "
                f"only the middle units 1..{last - 1} of the {h.units.count} may drop tokens (the first "
                "and the last run every token)",
                f"name units between 1 and {last - 1}" if last > 1 else
                "a model of fewer than three units has no middle unit: drop the random-ltd line")
    if list(d.units) != sorted(set(d.units)):
        rep.add(d.loc, where, order, f"random-ltd's units {' '.join(map(str, d.units))} are not distinct and ascending",
                f"write them once each, in order: {' '.join(map(str, sorted(set(d.units))))}")
    if d.min_value > d.max_value:
        rep.add(d.loc, where, order,
                f"min-value {d.min_value} is above max-value {d.max_value}: the kept count grows from "
                "min-value to max-value", f"swap them, or give min-value at most {d.max_value}")
    if h.mesh.tensor != 1:
        rep.add(d.loc, where, order, "random-ltd on a mesh with a tensor axis: not supported",
                "drop `tensor` from the mesh line, or the random-ltd line")
    if h.documents is not None:
        rep.add(d.loc, where, order,
                "random-ltd over packed documents: not supported (a dropped unit's kept tokens would "
                "need their documents' boundaries gathered too)", "drop the documents line or the random-ltd line")
    split = next((i for r in plan.ranks for i in r.instrs if i.op in (Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)), None)
    if split is not None:
        rep.add(split.loc or d.loc, where, order,
                f"`{split}` in a plan with random-ltd: a split backward runs a stage's traced programs, "
                "and a dropped unit runs under eager autograd on the tokens the executor draws each step",
                "compile the plan with a schedule whose backward is whole (seq1f1b, terapipe, 1f1b, gpipe, ...)")


def check_tensor_axis(plan, rep: Report) -> None:
    """T1-T4 for the mesh line's tensor axis (`plan`: a plan, or a bundle's index): `tensor T`
    needs format version 4 (H1), and T divides the vocabulary (the embedding and the head are
    split over the tensor ranks by vocabulary rows); `sequence-parallel` needs format version 5
    (H1) and a tensor axis (T3), and T divides every slice's tokens, of the training and the
    evaluation program (T4: each rank's messages carry 1/T of them)."""
    mesh = plan.header.mesh if hasattr(plan, "header") else plan.mesh
    if mesh.sequence:
        require_version(plan, rep, SEQUENCE_VERSION, mesh.loc, "header (mesh)", (0, 3), "`sequence-parallel`")
        if mesh.tensor == 1:
            rep.add(mesh.loc, "header (mesh)", (0, 3),
                    "`sequence-parallel` splits the tokens over the tensor ranks, and this mesh has none (tensor 1)",
                    "give the mesh a tensor axis (`tensor 2 sequence-parallel`), or drop `sequence-parallel`")
        elif hasattr(plan, "header"):
            _check_token_parts(plan, mesh.tensor, rep)
    if mesh.tensor == 1:
        return
    require_version(plan, rep, TENSOR_VERSION, mesh.loc, "header (mesh)", (0, 3), f"`tensor {mesh.tensor}`")
    shape = plan.header.shape if hasattr(plan, "header") else None
    if shape is not None and shape.vocab % mesh.tensor:
        rep.add(mesh.loc, "header (mesh)", (0, 3),
                f"tensor {mesh.tensor} does not divide the vocabulary of {shape.vocab}: the embedding and "
                "the head are split over the tensor ranks by vocabulary rows",
                f"use a tensor degree that divides {shape.vocab}, or pad the vocabulary to a multiple of "
                f"{mesh.tensor} in the model")


def _check_stages(plan: Plan, rep: Report) -> bool:
    h = plan.header
    pipe = h.mesh.pipe
    ok = True
    if not h.stages:
        rep.add(h.units.loc, "header (units)", (0, 5), "the plan has no stages",
                'add `stage 0 rank 0 units 0:N "LABEL"` lines below `units`')
        return False
    for k, st in enumerate(h.stages):
        where, order = f"header, stage line {k}", (0, 10 + k)
        if st.index != k:
            ok = False
            rep.add(st.loc, where, order, f"stage {st.index} is listed where stage {k} belongs",
                    f"number stage lines 0, 1, 2, ... in order: write `stage {k}` here")
        bad = [r for r in st.ranks if not 0 <= r < pipe]
        if bad:
            ok = False
            rep.add(st.loc, where, order,
                    f"stage {st.index} is placed on rank {bad[0]}, but the mesh has pipeline "
                    f"ranks 0..{pipe - 1}",
                    f"use a rank in 0..{pipe - 1}, or raise `mesh pipe`")
        if st.replicas:
            ok &= _check_replicas(plan, rep, st, where, order)
    if ok:
        held = {r for st in h.stages for r in st.ranks}
        for r in range(pipe):
            if r not in held:
                rep.add(h.mesh.loc, "header (mesh)", (0, 3), f"pipeline rank {r} holds no stage",
                        f"place a stage on rank {r}, or lower `mesh pipe` to the ranks in use")
    return ok


def _check_replicas(plan: Plan, rep: Report, st, where: str, order: tuple) -> bool:
    """H2 for `stage S ranks R0 R1 ...` (format version 3): distinct ranks and as many replicas
    as every other stage has. A tie may join replicated stages: its `reduce-tied` covers every
    rank holding a replica of a tied stage, and `reduce-replicas` leaves the tied parameter out
    (rule W1), so each copy's gradient is summed once."""
    h = plan.header
    require_version(plan, rep, REPLICA_VERSION, st.loc, where, order,
                    "`ranks` (weight replicas of a stage)")  # reported; the rest still checks
    if len(set(st.ranks)) != len(st.ranks):
        rep.add(st.loc, where, order, f"stage {st.index} names rank "
                f"{next(r for r in st.ranks if st.ranks.count(r) > 1)} for two of its replicas",
                "give each weight replica of a stage its own pipeline rank")
        return False
    if any(len(o.ranks) != len(st.ranks) for o in h.stages):
        other = next(o for o in h.stages if len(o.ranks) != len(st.ranks))
        rep.add(st.loc, where, order, f"stage {st.index} has {len(st.ranks)} weight replicas and "
                f"stage {other.index} {len(other.ranks)}",
                "give every stage the same number of replicas: each pipeline runs through all "
                "the stages")
        return False
    return True


def tiling_problems(ranges, end: int):
    """How consecutive [lo, hi) ranges fail to tile [0, end), in order: ("gap", i, lo, hi,
    expect) when range i starts after the previous one ends (at `expect`), ("overlap", ...)
    when it starts before, ("empty", ...) when hi <= lo, and finally ("end", None, None, None,
    expect) when the last range does not end at `end`. The one tiling rule of stages over units
    (H3) and of slices over a micro-batch's tokens (H5)."""
    expect = 0
    for i, (lo, hi) in enumerate(ranges):
        if lo > expect:
            yield "gap", i, lo, hi, expect
        elif lo < expect:
            yield "overlap", i, lo, hi, expect
        if hi <= lo:
            yield "empty", i, lo, hi, expect
        expect = hi
    if expect != end:
        yield "end", None, None, None, expect


def _check_units(plan: Plan, rep: Report) -> None:
    h = plan.header
    if not h.stages:
        return
    for kind, k, lo, hi, expect in tiling_problems([st.units for st in h.stages], h.units.count):
        if kind == "end":
            st = h.stages[-1]
            rep.add(st.loc, f"header, stage line {len(h.stages) - 1}", (0, 10 + len(h.stages) - 1),
                    f"the stages end at unit {expect}, but the model has {h.units.count} units",
                    f"end the last stage at unit {h.units.count}")
            continue
        st = h.stages[k]
        where, order = f"header, stage line {k}", (0, 10 + k)
        if kind == "gap":
            rep.add(st.loc, where, order,
                    f"units {expect}:{lo} belong to no stage (stage {st.index} starts at {lo})",
                    f"start stage {st.index} where the previous stage ends: units {expect}:{hi}")
        elif kind == "overlap":
            rep.add(st.loc, where, order,
                    f"stage {st.index} units {lo}:{hi} overlap the previous stage, which ends at "
                    f"{expect}", f"start stage {st.index} at unit {expect}")
        else:
            rep.add(st.loc, where, order, f"stage {st.index} has no units ({lo}:{hi})",
                    "give every stage a range LO:HI with HI > LO")


def _check_ties(plan: Plan, rep: Report) -> None:
    h = plan.header
    k = len(h.stages)
    seen: dict[str, int] = {}
    for n, tie in enumerate(h.ties):
        where, order = f"header, tie line {n}", (0, 5000 + n)
        if tie.name in seen:
            rep.add(tie.loc, where, order, f"tie \"{tie.name}\" is declared twice",
                    "merge the two tie lines into one that lists all its stages")
        seen.setdefault(tie.name, n)
        bad = [s for s in tie.stages if not 0 <= s < k]
        if bad:
            rep.add(tie.loc, where, order,
                    f"tie \"{tie.name}\" names stage {bad[0]}, which does not exist",
                    f"stages are 0..{k - 1}")
        elif len(set(tie.stages)) < 2:
            rep.add(tie.loc, where, order,
                    f"tie \"{tie.name}\" names fewer than two distinct stages",
                    "a tie is a parameter shared by two or more stages; list them all, "
                    "or remove the line")


def _check_microbatches(plan: Plan, rep: Report) -> bool:
    h = plan.header
    batch, data, seq = h.shape.batch, h.mesh.data, h.shape.seq
    if batch % data:
        rep.add(h.shape.loc, "header (shape)", (0, 2),
                f"batch {batch} is not divisible by `mesh data {data}`",
                f"use a global batch that is a multiple of {data}: each data-parallel replica "
                "trains on batch / data rows")
    if not h.microbatches:
        rep.add(h.shape.loc, "header (shape)", (0, 2), "the plan has no micro-batches",
                f"add `microbatch 0 size {batch // data} slices 0:{seq}` at the end of the header")
        return False
    ok = True
    for k, mb in enumerate(h.microbatches):
        where, order = f"header, microbatch line {k}", (0, 9000 + k)
        if mb.index != k:
            ok = False
            rep.add(mb.loc, where, order,
                    f"microbatch {mb.index} is listed where microbatch {k} belongs",
                    f"number micro-batches 0, 1, 2, ... in order: write `microbatch {k}`")
        if mb.size < 1:
            rep.add(mb.loc, where, order, f"microbatch {mb.index} has size {mb.size}",
                    "every micro-batch takes at least one row")
        if mb.replica and require_version(plan, rep, REPLICA_VERSION, mb.loc, where, order,
                                          "`replica` (a micro-batch's weight replica)"):
            if mb.replica >= h.replicas:
                rep.add(mb.loc, where, order, f"microbatch {mb.index} runs on replica {mb.replica}, "
                        f"but the stages have {h.replicas} weight replica{'s' * (h.replicas > 1)}",
                        f"use a replica in 0..{h.replicas - 1}, or give the stages more ranks "
                        "(`stage S ranks R0 R1`)")
                ok = False
        _check_slices(mb, seq, rep, where, order)
    total = sum(mb.size for mb in h.microbatches)
    if batch % data == 0 and total != batch // data:
        last = h.microbatches[-1]
        rep.add(last.loc, f"header, microbatch line {len(h.microbatches) - 1}",
                (0, 9000 + len(h.microbatches) - 1),
                f"micro-batch sizes sum to {total}, but each replica's batch is "
                f"{batch // data} rows (batch {batch} / data {data})",
                f"make the sizes sum to {batch // data}")
    return ok


def _check_slices(mb, seq: int, rep: Report, where: str, order: tuple) -> None:
    if not mb.slices:
        rep.add(mb.loc, where, order, f"microbatch {mb.index} has no token slices",
                f"add `slices 0:{seq}` (or several slices that tile 0:{seq})")
        return
    for kind, i, lo, hi, expect in tiling_problems(mb.slices, seq):
        if kind == "gap":
            rep.add(mb.loc, where, order,
                    f"microbatch {mb.index}: tokens {expect}:{lo} are in no slice "
                    f"(slice {i} is {lo}:{hi})", f"start slice {i} at token {expect}")
        elif kind == "overlap":
            rep.add(mb.loc, where, order,
                    f"microbatch {mb.index}: slice {i} ({lo}:{hi}) overlaps the slice before it, "
                    f"which ends at {expect}", f"start slice {i} at token {expect}")
        elif kind == "empty":
            rep.add(mb.loc, where, order, f"microbatch {mb.index}: slice {i} ({lo}:{hi}) is empty",
                    "every slice holds at least one token: write A:B with B > A")
        else:
            rep.add(mb.loc, where, order,
                    f"microbatch {mb.index}: the slices end at token {expect}, but seq is {seq}",
                    f"end the last slice at {seq}: slices tile 0:{seq}")


def _check_sections(plan: Plan, rep: Report) -> bool:
    pipe = plan.header.mesh.pipe
    ok = True
    for k, rp in enumerate(plan.ranks):
        if k >= pipe:
            ok = False
            rep.add(rp.loc, f"rank section {k}", (1, k, -1),
                    f"rank {rp.rank} section, but the mesh has {pipe} pipeline ranks",
                    f"one `rank R` section per pipeline rank 0..{pipe - 1}: remove this section "
                    "or raise `mesh pipe`")
        elif rp.rank != k:
            ok = False
            rep.add(rp.loc, f"rank section {k}", (1, k, -1),
                    f"rank {rp.rank} section where the section of rank {k} belongs",
                    f"list one section per pipeline rank in order: write `rank {k}` here")
    if len(plan.ranks) < pipe:
        ok = False
        missing = ", ".join(str(r) for r in range(len(plan.ranks), pipe))
        loc = plan.header.mesh.loc
        rep.add(loc, "header (mesh)", (0, 3),
                f"the mesh has {pipe} pipeline ranks, but the plan has "
                f"{len(plan.ranks)} rank sections (missing: {missing})",
                f"add a `rank R` section for every rank 0..{pipe - 1}")
    return ok


def _check_token_parts(plan, parts: int, rep: Report) -> None:
    """T4: every slice's tokens split evenly over the `parts` tensor ranks (the first slice
    that does not is reported, per program)."""
    programs = [("", plan.header.microbatches)]
    if plan.eval is not None:
        programs.append(("the evaluation's ", plan.eval.microbatches))
    for what, mbs in programs:
        for mb in mbs:
            bad = next(((lo, hi) for lo, hi in mb.slices if (hi - lo) % parts), None)
            if bad is not None:
                lo, hi = bad
                rep.add(mb.loc, "header (microbatch)", (0, 4),
                        f"{what}micro-batch {mb.index}'s slice {lo}:{hi} has {hi - lo} tokens, which the {parts} "
                        "tensor ranks of `sequence-parallel` cannot split evenly",
                        f"cut slices whose lengths are multiples of {parts} (`tpc compile --slices` with such "
                        "lengths), or drop `sequence-parallel`")
                break
