"""Instruction rules (see tpc.ir.verify): operands O1-O6, completeness C1-C8 and program
order on a rank R1-R11."""

from __future__ import annotations

from tpc.ir.nodes import EVAL_OPS, REPLICA_VERSION, Instr, Payload, Plan
from tpc.ir.semantics import neighbour_stage
from tpc.ir.verify.header import require_version
from tpc.ir.verify.report import ACT, GRAD, O, Index, Report, Shape, text


# -------------------------------------------------------------------------------- operands


def check_operands(plan: Plan, shape: Shape, rep: Report) -> list[list[bool]]:
    """Rules O1-O6: report each bad instruction once; return which ones are usable."""
    valid = []
    for r, rp in enumerate(plan.ranks):
        ok = []
        for p, ins in enumerate(rp.instrs):
            if ins.op is O.REDUCE_REPLICAS and not require_version(
                    plan, rep, REPLICA_VERSION, ins.loc, f"rank {r}, instruction {p} ({ins})",
                    (1, r, p), "`reduce-replicas`"):
                ok.append(False)
                rep.comm_errors += 1
                continue
            problem = _operand_problem(ins, r, shape)
            if problem is not None:
                message, hint, comm = problem
                rep.instr(r, p, message, hint, comm=comm)
            ok.append(problem is None)
        valid.append(ok)
    return valid


def _operand_problem(ins: Instr, r: int, shape: Shape) -> tuple[str, str, bool] | None:
    """(message, hint, breaks pairing) for the first operand rule `ins` breaks, or None."""
    comm = ins.op in (O.SEND, O.RECV, O.REDUCE_TIED, O.REDUCE_REPLICAS)
    k, m_count = shape.k, len(shape.nslices)
    if shape.forward_only:
        problem = _eval_problem(ins, r, shape)
        if problem is not None:
            return problem
    elif ins.op is O.REDUCE_LOSS:
        return ("reduce-loss belongs to the evaluation program (below `eval`)",
                "remove this line: a training step's loss is summed by the executor", False)
    if ins.stage is not None and ins.stage >= k:
        return f"stage {ins.stage} does not exist", f"the plan has stages 0..{k - 1}", comm
    if ins.mb is not None and ins.mb >= m_count:
        return (f"micro-batch {ins.mb} does not exist",
                f"the plan has micro-batches 0..{m_count - 1}", comm)
    if ins.slice is not None and ins.slice >= shape.nslices[ins.mb]:
        n = shape.nslices[ins.mb]
        return (f"micro-batch {ins.mb} has no slice {ins.slice}",
                f"micro-batch {ins.mb} is cut into {n} slices: 0..{n - 1}", comm)
    if ins.peer is not None and ins.peer >= shape.pipe:
        return (f"rank {ins.peer} does not exist",
                f"the mesh has pipeline ranks 0..{shape.pipe - 1}", comm)
    if ins.stage is not None and ins.mb is not None and shape.rank(ins.stage, ins.mb) != r:
        owner = shape.rank(ins.stage, ins.mb)
        which = (f" for micro-batch {ins.mb} (replica {shape.replica[ins.mb]})"
                 if len(shape.ranks_of[ins.stage]) > 1 else "")
        return (f"stage {ins.stage} is held by rank {owner}{which}, not by rank {r}",
                f"move this line to the section of rank {owner}", comm)
    if ins.stage is not None and ins.mb is None and r not in shape.ranks_of[ins.stage]:
        owners = " and ".join(str(q) for q in shape.ranks_of[ins.stage])
        return (f"stage {ins.stage} is held by rank {owners}, not by rank {r}",
                f"move this line to the section of rank {owners}", comm)
    if ins.op is O.LOAD and r not in shape.load_ranks(ins.mb):
        if shape.documents:
            return (f"micro-batch {ins.mb} runs no stage on rank {r}: it loads nothing",
                    "remove this line", False)
        if r not in shape.ends:
            return (f"rank {r} holds neither the first nor the last stage: it loads nothing",
                    "remove this line; only the ranks of the first stage (token ids) and of the "
                    "last stage (targets) load micro-batches", False)
        ranks = " and ".join(str(q) for q in sorted(shape.load_ranks(ins.mb)))
        return (f"micro-batch {ins.mb} runs on replica {shape.replica[ins.mb]}, whose first and "
                f"last stages are on rank {ranks}: rank {r} does not load it",
                f"move this line to rank {ranks}", False)
    if ins.op in (O.SEND, O.RECV):
        return _peer_problem(ins, r, shape)
    if ins.op is O.ALLREDUCE and shape.data == 1:
        return ("allreduce with `mesh data 1`: there is no data-parallel group to reduce over",
                "remove this line, or raise `mesh data`", False)
    if ins.op is O.REDUCE_TIED:
        return _tie_problem(ins, r, shape)
    if ins.op is O.REDUCE_REPLICAS and len(shape.ranks_of[ins.stage]) == 1:
        return (f"stage {ins.stage} has one weight replica: there is nothing to reduce across "
                "ranks", "remove this line, or give the stage more ranks (`stage S ranks R0 R1`)",
                True)
    return None


def _eval_problem(ins: Instr, r: int, shape: Shape) -> tuple[str, str, bool] | None:
    """E2: the evaluation program runs forward only, and its loss is reduced where it is."""
    comm = ins.op in (O.SEND, O.RECV, O.REDUCE_TIED, O.REDUCE_REPLICAS)
    if ins.op not in EVAL_OPS or ins.payload is GRAD:
        return (f"the evaluation program runs forward only: no `{ins.op.value}"
                f"{' grad' if ins.payload is GRAD else ''}` in it",
                "remove this line: an evaluation has no backward, no gradient message, no "
                "gradient reduction and no step; it may hold load, forward, send act, recv act, "
                "exchange, free-kv and reduce-loss", comm)
    if ins.checkpoint:
        return ("an evaluation forward keeps no graph: `checkpoint` means nothing there",
                "drop `checkpoint`", False)
    if ins.op is O.REDUCE_LOSS:
        last = shape.ranks_of[-1][0]  # the evaluation runs on replica 0 (rule E1)
        if shape.data == 1:
            return ("reduce-loss with `mesh data 1`: there is no data-parallel group to sum over",
                    "remove this line, or raise `mesh data`", False)
        if r != last:
            return (f"reduce-loss on rank {r}, which does not hold the last stage: the loss is "
                    f"on rank {last}", f"move this line to the evaluation's rank {last}", False)
    return None


def _peer_problem(ins: Instr, r: int, shape: Shape) -> tuple[str, str, bool] | None:
    s, last = ins.stage, shape.k - 1
    sends = ins.op is O.SEND
    nb = neighbour_stage(ins)
    if not 0 <= nb <= last:
        why = {
            (True, ACT): "the last stage sends no activation: its output is the loss",
            (False, ACT): "the first stage receives no activation: it loads its token ids",
            (True, GRAD): "the first stage sends no input gradient: its input is token ids",
            (False, GRAD): "the last stage receives no gradient: it starts from its loss",
        }[(sends, ins.payload)]
        return why, "remove this line", True
    owner = shape.rank(nb, ins.mb)
    if owner == r:
        return (f"stages {min(s, nb)} and {max(s, nb)} are both on rank {r}: no {ins.op.value} "
                "between them",
                "remove this line: the executor passes activations and gradients between "
                "stages of one rank locally", True)
    if ins.peer != owner:
        word = "to" if sends else "from"
        return (f"stage {nb} is on rank {owner}, not rank {ins.peer}",
                f"write `{word} {owner}`", True)
    return None


def _tie_problem(ins: Instr, r: int, shape: Shape) -> tuple[str, str, bool] | None:
    if ins.tie not in shape.tie_names:
        names = ", ".join(f'"{n}"' for n in sorted(shape.tie_names)) or "none"
        return (f"no tie named \"{ins.tie}\"", f"the header declares these ties: {names}", True)
    if ins.tie not in shape.ties:
        return None  # a malformed tie line: H4 reported it; the instruction is not checked
    ranks = shape.tie_ranks[ins.tie]
    if len(ranks) == 1:
        return (f"every stage of tie \"{ins.tie}\" is on rank {r}: there is nothing to reduce "
                "across ranks", "remove this line: the gradient is summed locally", True)
    if r not in ranks:
        listed = ", ".join(str(x) for x in sorted(ranks))
        return (f"rank {r} holds no stage of tie \"{ins.tie}\"",
                f"remove this line; reduce-tied \"{ins.tie}\" runs on ranks {listed}", True)
    return None


# ---------------------------------------------------------------------------- completeness


def check_duplicates(idx: Index, rep: Report) -> None:
    """Every instruction exists at most once (C1-C8): report each extra copy."""
    for key, at in idx.occ.items():
        if len(at) < 2:
            continue
        r0, p0 = at[0]
        comm = key[0] in (O.SEND, O.RECV, O.REDUCE_TIED, O.REDUCE_REPLICAS)
        for r, p in at[1:]:
            rep.instr(r, p, f"duplicate instruction: the same one is at {rep.ref(r0, p0)}",
                      "remove one of the two", comm=comm)


def check_compute_complete(plan: Plan, shape: Shape, idx: Index, rep: Report) -> None:
    """C1, C2: one forward and one backward (or split pair) per slice; recompute iff checkpoint."""
    occ, first = idx.occ, idx.first
    for s in range(shape.k):
        for m, n in enumerate(shape.nslices):
            r = shape.rank(s, m)
            for i in range(n):
                what = f"stage {s} mb {m} slice {i}"
                fwd = occ.get((O.FORWARD, None, s, m, i))
                if not fwd:
                    after = first((O.FORWARD, None, s, m, i - 1)) if i else None
                    place = f", below {rep.ref(r, after)}" if after is not None else ""
                    rep.section(r, f"no forward of {what}",
                                f"add {text(O.FORWARD, s, m, i)} to rank {r}{place}")
                if shape.forward_only:
                    continue  # E3: a forward and nothing else
                _check_backward_complete(shape, idx, rep, s, m, i)
                if fwd:
                    _check_recompute(rep, idx, fwd[0], s, m, i)


def _check_backward_complete(shape: Shape, idx: Index, rep: Report, s: int, m: int,
                             i: int) -> None:
    occ = idx.occ
    r = shape.rank(s, m)
    full = occ.get((O.BACKWARD, None, s, m, i), ())
    bin_ = occ.get((O.BACKWARD_INPUT, None, s, m, i), ())
    bw = occ.get((O.BACKWARD_WEIGHT, None, s, m, i), ())
    what = f"stage {s} mb {m} slice {i}"
    if full and (bin_ or bw):
        r2, p2 = (bin_ or bw)[0]
        rep.instr(r2, p2, f"{what} has both a backward ({rep.at(*full[0])}) and a split backward",
                  "use either one `backward` or a `backward-input` and a `backward-weight`, "
                  "not both")
    elif not full and not bin_ and not bw:
        place = ""
        after = idx.first((O.FORWARD, None, s, m, i))
        if after is not None:
            place = f", below {rep.ref(r, after)}"
        rep.section(r, f"no backward of {what}",
                    f"add {text(O.BACKWARD, s, m, i)} to rank {r}{place}")
    elif bin_ and not bw:
        rep.instr(*bin_[0], f"backward-input of {what} has no backward-weight",
                  f"add {text(O.BACKWARD_WEIGHT, s, m, i)} below this line, or make this a "
                  "full `backward`")
    elif bw and not bin_ and not full:
        rep.instr(*bw[0], f"backward-weight of {what} has no backward-input",
                  f"add {text(O.BACKWARD_INPUT, s, m, i)} above this line, or make this a "
                  "full `backward`")


def _check_recompute(rep: Report, idx: Index, fwd_at: tuple[int, int], s: int, m: int,
                     i: int) -> None:
    r, p = fwd_at
    checkpointed = rep.plan.ranks[r].instrs[p].checkpoint
    rec = idx.occ.get((O.RECOMPUTE, None, s, m, i))
    if checkpointed and not rec:
        bwd = idx.backward(s, m, i)
        place = f" above {rep.ref(r, bwd)}" if bwd is not None else " before its backward"
        rep.instr(r, p, f"checkpoint forward of stage {s} mb {m} slice {i} is never recomputed",
                  f"a checkpoint forward keeps no graph: add {text(O.RECOMPUTE, s, m, i)}"
                  f"{place}, or drop `checkpoint`")
    elif rec and not checkpointed:
        rep.instr(*rec[0], f"recompute of stage {s} mb {m} slice {i}, whose forward "
                  f"({rep.at(r, p)}) is not a checkpoint forward",
                  "remove this line, or add `checkpoint` to the forward")


def check_comm_complete(shape: Shape, idx: Index, rep: Report) -> None:
    """C4: every activation and gradient crossing ranks has one send and one receive."""
    for s in range(shape.k - 1):
        for m, n in enumerate(shape.nslices):
            src, dst = shape.rank(s, m), shape.rank(s + 1, m)
            if src == dst:
                continue
            for i in range(n):
                _check_pair(idx, rep, ACT, s, s + 1, m, i, src, dst)
                if not shape.forward_only:
                    _check_pair(idx, rep, GRAD, s + 1, s, m, i, dst, src)


def _check_pair(idx: Index, rep: Report, payload: Payload, s_from: int, s_to: int, m: int,
                i: int, src: int, dst: int) -> None:
    """One message, from stage s_from on rank src to stage s_to on rank dst, is sent and
    received (C4)."""
    send = idx.occ.get((O.SEND, payload, s_from, m, i))
    recv = idx.occ.get((O.RECV, payload, s_to, m, i))
    if send and recv:
        return  # duplicates are reported by _check_duplicates
    send_text = text(O.SEND, s_from, m, i, payload, dst)
    recv_text = text(O.RECV, s_to, m, i, payload, src)
    # where the send belongs: after the compute producing the message; the receive: before
    # the compute consuming it
    if payload is ACT:
        produce = idx.first((O.FORWARD, None, s_from, m, i))
        consume = idx.first((O.FORWARD, None, s_to, m, i))
    else:
        produce = idx.backward(s_from, m, i)
        consume = idx.backward(s_to, m, i)
    send_place = f" below {rep.ref(src, produce)}" if produce is not None else ""
    recv_place = f" above {rep.ref(dst, consume)}" if consume is not None else ""
    if send and not recv:
        rep.instr(*send[0], f"nothing on rank {dst} receives this message",
                  f"add {recv_text} to rank {dst}{recv_place}", comm=True)
    elif recv and not send:
        rep.instr(*recv[0], f"rank {src} never sends this message",
                  f"add {send_text} to rank {src}{send_place}", comm=True)
    elif not send and not recv:
        kind = "activation" if payload is ACT else "input gradient"
        rep.section(src, f"the {kind} of stage {s_from} mb {m} slice {i} never goes to rank "
                    f"{dst} (stage {s_to})",
                    f"add {send_text} to rank {src}{send_place}, and {recv_text} to rank "
                    f"{dst}{recv_place}", comm=True)


def check_once_per_rank(plan: Plan, shape: Shape, idx: Index, rep: Report) -> None:
    """C3, C6, C7, C8: loads, allreduce, reduce-tied and step that must be there."""
    occ = idx.occ
    for r in range(len(plan.ranks)):
        held = [s for s in range(shape.k) if r in shape.ranks_of[s]]
        if not held:
            continue
        if r in shape.ends or shape.documents:
            for m in range(len(shape.nslices)):
                if r in shape.load_ranks(m) and not occ.get((O.LOAD, r, m)):
                    end_stage = next(s for s in range(shape.k) if shape.rank(s, m) == r)
                    use = idx.first((O.FORWARD, None, end_stage, m, 0))
                    place = f" above {rep.ref(r, use)}" if use is not None else ""
                    rep.section(r, f"rank {r} never loads micro-batch {m}",
                                f"add {text(O.LOAD, mb=m)}{place}")
        if shape.forward_only:
            _check_eval_once(shape, idx, rep, r, held)
            continue
        if shape.data > 1:
            for s in held:
                if not occ.get((O.ALLREDUCE, s, r)):
                    rep.section(r, f"stage {s} is never all-reduced over the {shape.data} "
                                "data-parallel replicas",
                                f"add {text(O.ALLREDUCE, s)} to rank {r} after the last "
                                f"backward of stage {s}, before `step`")
        for s in held:
            if len(shape.ranks_of[s]) > 1 and not occ.get((O.REDUCE_REPLICAS, s, r)):
                others = ", ".join(str(q) for q in shape.ranks_of[s] if q != r)
                rep.section(r, f"rank {r} never sums the gradients of stage {s} with its "
                            f"replica{'s' * (len(shape.ranks_of[s]) > 2)} on rank {others}",
                            f"add {text(O.REDUCE_REPLICAS, s)} to rank {r} after the last "
                            f"backward of stage {s}, before `step`", comm=True)
        for name in sorted(shape.ties):
            ranks = shape.tie_ranks[name]
            if len(ranks) > 1 and r in ranks and not occ.get((O.REDUCE_TIED, r, name)):
                rep.section(r, f"rank {r} never reduces tie \"{name}\"",
                            f"add {text(O.REDUCE_TIED, tie=name)} to rank {r} after the last "
                            "backward of its tied stages, before `step`", comm=True)
        if not occ.get((O.STEP, r)):
            rep.section(r, f"rank {r} never runs `step`",
                        "add `step` as the last instruction that touches parameters")


def _check_eval_once(shape: Shape, idx: Index, rep: Report, r: int, held: list[int]) -> None:
    """E3: an evaluation frees every KV cache it made, and reduces its loss over the
    data-parallel group on the rank of the last stage."""
    for s in held:
        for m, n in enumerate(shape.nslices):
            if shape.rank(s, m) != r:
                continue  # another replica's micro-batch
            if not idx.occ.get((O.FREE_KV, s, m)):
                after = idx.first((O.FORWARD, None, s, m, n - 1))
                place = f" below {rep.ref(r, after)}" if after is not None else ""
                rep.section(r, f"the KV cache of stage {s} mb {m} is never freed",
                            f"add {text(O.FREE_KV, s, m)}{place}: an evaluation keeps nothing "
                            "past its last slice")
    if shape.data > 1 and r == shape.ranks_of[-1][0] and not idx.occ.get((O.REDUCE_LOSS, r)):
        rep.section(r, f"the evaluation loss is never summed over the {shape.data} "
                    "data-parallel replicas", "add `reduce-loss` after the last forward of the "
                    "last stage")


# ---------------------------------------------------------------------------- program order


def check_order(plan: Plan, shape: Shape, idx: Index, rep: Report) -> None:
    """R1-R11: each instruction comes after what it needs, on its own rank."""
    for r, rp in enumerate(plan.ranks):
        keys = idx.keys[r]
        for p, ins in enumerate(rp.instrs):
            key = keys[p]
            if key is None or idx.occ[key][0][1] != p:
                continue  # failed an operand rule, or an extra copy (a duplicate): order is moot
            for need, why in _needs(ins, r, shape, idx, plan):
                if need > p:
                    reason = why[0].format(*why[1:])
                    rep.instr(r, p, f"{ins} runs before {rep.ref(r, need)}",
                              f"{reason}; move this line below {rep.at(r, need)}")
            _check_after_all(ins, r, p, shape, idx, rep)


def _needs(ins: Instr, r: int, shape: Shape, idx: Index, plan: Plan):
    """(position, why) of each instruction on rank r that `ins` needs before it (R1-R7).

    `why` is a format string and its arguments, formatted only for an error: this runs for
    every instruction of a plan, and most plans are valid."""
    op, s, m, i = ins.op, ins.stage, ins.mb, ins.slice
    first = idx.first
    out: list[tuple[int | None, tuple]] = []
    if op is O.FORWARD:
        if i > 0:
            out.append((first((O.FORWARD, None, s, m, i - 1)),
                        ("slice {} attends to the KV cache of slice {}", i, i - 1)))
        if s > 0:
            if shape.rank(s - 1, m) == r:
                out.append((first((O.FORWARD, None, s - 1, m, i)),
                            ("its input is the output of stage {}", s - 1)))
            else:
                out.append((first((O.RECV, ACT, s, m, i)),
                            ("its input arrives with that receive",)))
        if s == 0:
            out.append((first((O.LOAD, r, m)),
                        ("the first stage reads the micro-batch's token ids",)))
        elif s == shape.k - 1:
            out.append((first((O.LOAD, r, m)),
                        ("the last stage reads the micro-batch's targets",)))
        elif shape.documents:
            out.append((first((O.LOAD, r, m)),
                        ("every stage reads the micro-batch's document boundaries",)))
    elif op is O.RECOMPUTE:
        out.append((first((O.FORWARD, None, s, m, i)), ("it rebuilds the graph of that forward",)))
    elif op in (O.BACKWARD, O.BACKWARD_INPUT):
        fwd = first((O.FORWARD, None, s, m, i))
        out.append((fwd, ("a slice is back-propagated after its forward",)))
        if fwd is not None and plan.ranks[r].instrs[fwd].checkpoint:
            out.append((first((O.RECOMPUTE, None, s, m, i)),
                        ("a checkpoint forward keeps no graph: it is recomputed first",)))
        if i + 1 < shape.nslices[m]:
            out.append((idx.backward(s, m, i + 1),
                        ("slices are back-propagated in reverse token order: slice {} sends "
                         "gradients into the keys and values of slice {}", i + 1, i)))
        if s < shape.k - 1:
            if shape.rank(s + 1, m) == r:
                out.append((idx.backward(s + 1, m, i),
                            ("the gradient of its output comes from stage {}", s + 1)))
            else:
                out.append((first((O.RECV, GRAD, s, m, i)),
                            ("the gradient of its output arrives with that receive",)))
    elif op is O.BACKWARD_WEIGHT:
        out.append((first((O.BACKWARD_INPUT, None, s, m, i)),
                    ("the weight gradient comes after the input gradient of the same slice",)))
    elif op is O.SEND:
        if ins.payload is ACT:
            out.append((first((O.FORWARD, None, s, m, i)), ("it sends that forward's output",)))
        else:
            out.append((idx.backward(s, m, i), ("it sends that backward's input gradient",)))
    return [(p, why) for p, why in out if p is not None]


def _check_after_all(ins: Instr, r: int, p: int, shape: Shape, idx: Index,
                     rep: Report) -> None:
    """R8-R11: instructions that must follow every instruction of some kind on their rank."""
    op = ins.op
    if op is O.FREE_KV:
        last = idx.last_about.get((ins.stage, ins.mb))
        what = f"the KV cache of stage {ins.stage} mb {ins.mb}, which {{}} still uses"
    elif op is O.ALLREDUCE:
        covered = shape.allreduce_covers.get((r, ins.stage), frozenset({ins.stage}))
        lasts = [idx.last_wgrad[(r, s)] for s in covered if (r, s) in idx.last_wgrad]
        last = max(lasts) if lasts else None
        tied = (f" (and of stage{'s' * (len(covered) > 2)} "
                f"{', '.join(str(s) for s in sorted(covered - {ins.stage}))}, tied to it on this rank)"
                if len(covered) > 1 else "")
        what = f"the gradients of stage {ins.stage}{tied}, to which {{}} still adds"
    elif op is O.REDUCE_TIED:
        tied = [s for s in shape.ties.get(ins.tie, ()) if r in shape.ranks_of[s]]
        lasts = [idx.last_wgrad[(r, s)] for s in tied if (r, s) in idx.last_wgrad]
        last = max(lasts) if lasts else None
        what = f"the gradient of tie \"{ins.tie}\", to which {{}} still adds"
    elif op is O.REDUCE_REPLICAS:
        last = idx.last_wgrad.get((r, ins.stage))
        what = f"the gradients of stage {ins.stage} on this rank, to which {{}} still adds"
    elif op is O.STEP:
        last = idx.last_param.get(r)
        what = f"the parameters of rank {r}, which {{}} still uses"
    elif op is O.REDUCE_LOSS:
        lasts = [p2 for (s, _), p2 in idx.last_about.items() if s == shape.k - 1]
        last = max(lasts) if lasts else None
        what = "the loss of the last stage, to which {} still adds"
    else:
        return
    if last is not None and last > p:
        rep.instr(r, p, f"{ins} runs before it is done with " + what.format(rep.ref(r, last)),
                  f"move this line below {rep.at(r, last)}")
