"""Static verification of a plan: every rule of the plan format, all errors at once, located.

`verify(plan)` returns every error as a `Diagnostic` at the offending line (or, for a plan built
in memory without locations, at "rank R, instruction N (...)", N counting from 0 in
`plan.ranks[R].instrs`), sorted by line; `check(plan)` raises them as one `TpirError`;
`verify_file(path)` reads, parses and checks a `.tpir` file so that errors render with the
source line and a caret. The compiler runs `check` after every pass that changes a plan and the
executors run it before they execute one, so this module is the precise statement of what a
valid plan is. The rules, in the order they are checked:

Header (a broken numbering of stages, micro-batches or rank sections makes every later rule
meaningless, so those stop verification after the header):
  H1  `tpir 1`: the format version this module knows; the model's sha256 is 64 hex digits;
      the dtype is one of `DTYPES`.
  H2  stages are listed as stage 0, 1, ..., K-1 (K >= 1), each on a pipeline rank 0..pipe-1;
      every pipeline rank holds at least one stage; several stages may share a rank.
  H3  the stages' unit ranges tile [0, units) in stage order: no gap, no overlap, none empty.
  H4  ties have distinct names and name >= 2 distinct existing stages.
  H5  the global batch is divisible by `mesh data`; micro-batches are listed as 0..M-1
      (M >= 1), each of size >= 1, the sizes summing to batch / data; each micro-batch's
      slices tile [0, seq) in order: no gap, no overlap, no empty slice.
  H6  one `rank R` section per pipeline rank, in rank order.

Operands (an instruction that fails one of these is reported once and then left out of the
rules below, so one wrong number gives one error, not a cascade):
  O1  the stage, micro-batch, slice (of that micro-batch), peer rank and tie exist.
  O2  an instruction about stage S is in the section of the rank that holds S.
  O3  `load mb M` only on a rank that holds the first or the last stage.
  O4  `send act` of stage S goes to the rank of S+1, `recv act` of stage S comes from the rank
      of S-1, `send grad` of S goes to the rank of S-1, `recv grad` of S comes from the rank of
      S+1; that neighbour exists; and it is on another rank (two stages on one rank pass
      activations and gradients locally: a send or receive between them is an error).
  O5  `allreduce` only when `mesh data` > 1.
  O6  `reduce-tied NAME` only on a rank that holds a stage of the tie, and only when the tie's
      stages span more than one rank (otherwise the gradient is summed locally).

Completeness (each extra copy of an instruction is an error naming the first copy's line):
  C1  for every (stage, mb, slice): exactly one `forward`, and either exactly one `backward` or
      exactly one `backward-input` plus one `backward-weight`, never both kinds.
  C2  a `checkpoint` forward is recomputed exactly once; only a checkpoint forward is.
  C3  each rank holding the first or the last stage loads each micro-batch exactly once.
  C4  when stages S and S+1 are on different ranks, for every (mb, slice): exactly one
      `send act stage S` and one `recv act stage S+1`, exactly one `send grad stage S+1` and
      one `recv grad stage S`.
  C5  `free-kv` at most once per (stage, mb).
  C6  with `mesh data` > 1, exactly one `allreduce stage S` per stage.
  C7  `reduce-tied NAME` exactly once on each rank holding a stage of a tie that spans > 1 rank.
  C8  exactly one `step` on each rank that holds a stage.

Program order on a rank (X "after" Y: Y's line comes earlier in the same rank section):
  R1  forward (s,m,i) after forward (s,m,i-1): the KV cache of the earlier slices.
  R2  forward (s,m,i) of s > 0 after `recv act stage s mb m slice i`, or, when stage s-1 is on
      the same rank, after forward (s-1,m,i).
  R3  forward of the first and of the last stage after `load` of its micro-batch (token ids,
      targets).
  R4  recompute (s,m,i) after its forward; backward (s,m,i) after its recompute.
  R5  backward or backward-input (s,m,i) after forward (s,m,i), after the backward(-input) of
      (s,m,i+1) (later slices send gradients into this slice's keys and values: reverse token
      order), and, for s < K-1, after `recv grad stage s mb m slice i` or, when stage s+1 is on
      the same rank, after the backward(-input) of (s+1,m,i).
  R6  backward-weight (s,m,i) after backward-input (s,m,i).
  R7  `send act` (s,m,i) after forward (s,m,i); `send grad` (s,m,i) after the backward(-input)
      of (s,m,i).
  R8  `free-kv stage s mb m` after every other instruction about stage s and micro-batch m.
  R9  `allreduce stage s` after every backward and backward-weight of stage s.
  R10 `reduce-tied NAME` after every backward and backward-weight of the tie's stages held by
      that rank.
  R11 `step` after every forward, recompute, backward(-input/-weight), allreduce and
      reduce-tied of its rank: it is the last instruction that touches parameters.

Communication across ranks:
  F1  between two ranks, in one direction, messages are received in the order they were sent
      (channels are FIFO and untagged): the first crossing pair of each channel is reported.
  D1  no deadlock: all ranks are simulated with the semantics of the format (a send is
      buffered and never blocks; a receive blocks until its send has run; `reduce-tied` blocks
      until every rank of its tie reaches it; `allreduce` is among identical data-parallel
      replicas and never waits on another pipeline rank). Each stuck rank is reported at the
      instruction it blocks on, with the chain of ranks waiting for each other. The
      simulation runs only when the matching rules (O4, O6, C4, C7) hold, since it needs every
      receive paired with its one send.
"""

from __future__ import annotations

import re
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path

from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import FORMAT_VERSION, Instr, Loc, Op, Payload, Plan
from tpc.ir.semantics import Message, channel, message, neighbour_stage

__all__ = ["verify", "check", "verify_file", "DTYPES"]

# parameter dtypes a plan may name (`shape ... dtype D`); the executors map them to torch dtypes
DTYPES = ("float32", "float16", "bfloat16", "float64")
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")

ACT, GRAD = Payload.ACT, Payload.GRAD


class _O:
    """The members of `Op` as plain class attributes. Reading an Enum member is a descriptor
    call in Python 3.11, and the verifier reads them a few times per instruction."""

    LOAD, FORWARD, RECOMPUTE, STEP = Op.LOAD, Op.FORWARD, Op.RECOMPUTE, Op.STEP
    BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT
    SEND, RECV, FREE_KV = Op.SEND, Op.RECV, Op.FREE_KV
    ALLREDUCE, REDUCE_TIED = Op.ALLREDUCE, Op.REDUCE_TIED


# ops whose instructions are about one (stage, mb, slice)
_SLICE_OPS = (_O.FORWARD, _O.RECOMPUTE, _O.BACKWARD, _O.BACKWARD_INPUT, _O.BACKWARD_WEIGHT)
# ops that read or write parameters or their gradients: `step` must come after all of them
_PARAM_OPS = frozenset(_SLICE_OPS) | {_O.ALLREDUCE, _O.REDUCE_TIED}
# ops that add to a stage's weight gradients: allreduce and reduce-tied come after them
_WEIGHT_GRAD_OPS = frozenset({_O.BACKWARD, _O.BACKWARD_WEIGHT})


# ------------------------------------------------------------------------------ public API


def verify(plan: Plan) -> list[Diagnostic]:
    """Every error of `plan`, sorted by line (by rank and instruction when there are no lines)."""
    report = _Report(plan)
    if _check_header(plan, report):
        _check_program(plan, report)
    return report.sorted()


def check(plan: Plan) -> Plan:
    """`plan` itself if it is valid; otherwise a `TpirError` carrying every diagnostic."""
    diagnostics = verify(plan)
    if diagnostics:
        raise TpirError(diagnostics, source=None)
    return plan


def verify_file(path: str) -> Plan:
    """Read, parse and check a `.tpir` file; errors carry its text so carets render."""
    from tpc.ir.parse import parse

    p = Path(path)
    if not p.is_file():
        raise TpirError(Diagnostic(f"no such file: {path}", hint="give the path of a .tpir plan"))
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TpirError(
            Diagnostic(f"cannot read {path}: {e}", hint="a .tpir plan is a UTF-8 text file")
        ) from None
    try:
        plan = parse(text, file=path)
    except TpirError as e:
        if e.source is None:
            raise TpirError(e.diagnostics, source=text) from None
        raise
    diagnostics = verify(plan)
    if diagnostics:
        raise TpirError(diagnostics, source=text)
    return plan


# ---------------------------------------------------------------------------- diagnostics


class _Report:
    """Collects diagnostics with a sort key, and knows how to name a place in the plan."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self._items: list[tuple[tuple, Diagnostic]] = []
        # errors that break send/receive or reduce-tied pairing: the deadlock simulation
        # needs every receive paired with exactly one send, so it runs only when this is 0
        self.comm_errors = 0

    def add(self, loc: Loc | None, where: str, order: tuple, message: str, hint: str,
            comm: bool = False) -> None:
        diag = Diagnostic(message, loc=loc, hint=hint, where="" if loc else where)
        self._items.append(((loc.line if loc else 0, loc.col if loc else 0, order), diag))
        self.comm_errors += comm

    def instr(self, r: int, p: int, message: str, hint: str, comm: bool = False) -> None:
        ins = self.plan.ranks[r].instrs[p]
        self.add(ins.loc, f"rank {r}, instruction {p} ({ins})", (1, r, p), message, hint, comm)

    def section(self, r: int, message: str, hint: str, comm: bool = False) -> None:
        """An error about something missing from rank r's section: located at `rank r`."""
        self.add(self.plan.ranks[r].loc, f"rank {r}", (1, r, -1), message, hint, comm)

    def sorted(self) -> list[Diagnostic]:
        return [d for _, d in sorted(self._items, key=lambda kd: kd[0])]

    # -- naming places, for messages and hints

    def ref(self, r: int, p: int) -> str:
        """'line 17 (backward stage 0 mb 0 slice 2)' or 'rank 0, instruction 7 (...)'."""
        ins = self.plan.ranks[r].instrs[p]
        return f"{self.at(r, p)} ({ins})"

    def at(self, r: int, p: int) -> str:
        """'line 17' or 'rank 0, instruction 7'."""
        loc = self.plan.ranks[r].instrs[p].loc
        return f"line {loc.line}" if loc else f"rank {r}, instruction {p}"


def _text(op: Op, stage=None, mb=None, slice=None, payload=None, peer=None, tie=None) -> str:
    """An instruction as written in a plan, for hints that say what to add."""
    return "`" + str(Instr(op, stage, mb, slice, payload, peer, tie)) + "`"


# --------------------------------------------------------------------------------- header


def _check_header(plan: Plan, rep: _Report) -> bool:
    """Rules H1-H6. False when the numbering is too broken to check the instructions."""
    h = plan.header
    ok = True
    if h.version != FORMAT_VERSION:
        rep.add(h.version_loc, "header (tpir)", (0, 0), f"unknown format version {h.version}",
                f"this tpc reads `tpir {FORMAT_VERSION}`")
    _check_model_and_dtype(plan, rep)
    ok &= _check_stages(plan, rep)
    _check_units(plan, rep)
    _check_ties(plan, rep)
    ok &= _check_microbatches(plan, rep)
    ok &= _check_sections(plan, rep)
    return ok


def _check_model_and_dtype(plan: Plan, rep: _Report) -> None:
    h = plan.header
    if not _SHA256.fullmatch(h.model.sha256):
        rep.add(h.model.loc, "header (model)", (0, 1),
                f"\"{h.model.sha256}\" is not a SHA-256 digest",
                "write the 64 hex digits of the model file's SHA-256 (`sha256sum FILE`); "
                "`tpc run` compares it with the file")
    if h.shape.dtype not in DTYPES:
        rep.add(h.shape.loc, "header (shape)", (0, 2), f"unknown dtype {h.shape.dtype}",
                "use one of " + ", ".join(DTYPES))


def _check_stages(plan: Plan, rep: _Report) -> bool:
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
        if not 0 <= st.rank < pipe:
            ok = False
            rep.add(st.loc, where, order,
                    f"stage {st.index} is placed on rank {st.rank}, but the mesh has pipeline "
                    f"ranks 0..{pipe - 1}",
                    f"use a rank in 0..{pipe - 1}, or raise `mesh pipe`")
    if ok:
        held = {st.rank for st in h.stages}
        for r in range(pipe):
            if r not in held:
                rep.add(h.mesh.loc, "header (mesh)", (0, 3), f"pipeline rank {r} holds no stage",
                        f"place a stage on rank {r}, or lower `mesh pipe` to the ranks in use")
    return ok


def _check_units(plan: Plan, rep: _Report) -> None:
    h = plan.header
    expect = 0
    for k, st in enumerate(h.stages):
        where, order = f"header, stage line {k}", (0, 10 + k)
        lo, hi = st.units
        if lo > expect:
            rep.add(st.loc, where, order,
                    f"units {expect}:{lo} belong to no stage (stage {st.index} starts at {lo})",
                    f"start stage {st.index} where the previous stage ends: units {expect}:{hi}")
        elif lo < expect:
            rep.add(st.loc, where, order,
                    f"stage {st.index} units {lo}:{hi} overlap the previous stage, which ends at "
                    f"{expect}", f"start stage {st.index} at unit {expect}")
        if hi <= lo:
            rep.add(st.loc, where, order, f"stage {st.index} has no units ({lo}:{hi})",
                    "give every stage a range LO:HI with HI > LO")
        expect = hi
    if h.stages and expect != h.units.count:
        st = h.stages[-1]
        rep.add(st.loc, f"header, stage line {len(h.stages) - 1}", (0, 10 + len(h.stages) - 1),
                f"the stages end at unit {expect}, but the model has {h.units.count} units",
                f"end the last stage at unit {h.units.count}")


def _check_ties(plan: Plan, rep: _Report) -> None:
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


def _valid_ties(plan: Plan) -> dict[str, frozenset[int]]:
    """Ties that passed H4 (first declaration of a name), as name -> stages."""
    k = len(plan.header.stages)
    out: dict[str, frozenset[int]] = {}
    for tie in plan.header.ties:
        stages = frozenset(tie.stages)
        if tie.name not in out and len(stages) >= 2 and all(0 <= s < k for s in stages):
            out[tie.name] = stages
    return out


def _check_microbatches(plan: Plan, rep: _Report) -> bool:
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


def _check_slices(mb, seq: int, rep: _Report, where: str, order: tuple) -> None:
    if not mb.slices:
        rep.add(mb.loc, where, order, f"microbatch {mb.index} has no token slices",
                f"add `slices 0:{seq}` (or several slices that tile 0:{seq})")
        return
    expect = 0
    for i, (lo, hi) in enumerate(mb.slices):
        if lo > expect:
            rep.add(mb.loc, where, order,
                    f"microbatch {mb.index}: tokens {expect}:{lo} are in no slice "
                    f"(slice {i} is {lo}:{hi})", f"start slice {i} at token {expect}")
        elif lo < expect:
            rep.add(mb.loc, where, order,
                    f"microbatch {mb.index}: slice {i} ({lo}:{hi}) overlaps the slice before it, "
                    f"which ends at {expect}", f"start slice {i} at token {expect}")
        if hi <= lo:
            rep.add(mb.loc, where, order, f"microbatch {mb.index}: slice {i} ({lo}:{hi}) is empty",
                    "every slice holds at least one token: write A:B with B > A")
        expect = hi
    if expect != seq:
        rep.add(mb.loc, where, order,
                f"microbatch {mb.index}: the slices end at token {expect}, but seq is {seq}",
                f"end the last slice at {seq}: slices tile 0:{seq}")


def _check_sections(plan: Plan, rep: _Report) -> bool:
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


# ----------------------------------------------------------------------------- the index


@dataclass
class _Index:
    """Where each instruction is: key -> [(rank, position)] in program order of each rank.

    Keys: (op, payload, stage, mb, slice) for per-slice ops, send and recv; (op, stage, mb) for
    free-kv; (op, stage) for allreduce; (op, rank, mb) for load; (op, rank, tie) for
    reduce-tied; (op, rank) for step. Only instructions that passed the operand rules are here.
    """

    occ: dict[tuple, list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))
    # per rank, the positions of the instructions that passed the operand rules
    valid: list[list[bool]] = field(default_factory=list)
    # per rank, each instruction's key (None for those that failed the operand rules)
    keys: list[list[tuple | None]] = field(default_factory=list)
    # (stage, mb) -> last position of an instruction about them other than free-kv
    last_about: dict[tuple[int, int], int] = field(default_factory=dict)
    # stage -> last position of a backward or backward-weight of it
    last_wgrad: dict[int, int] = field(default_factory=dict)
    # rank -> last position of an instruction that touches parameters
    last_param: dict[int, int] = field(default_factory=dict)

    def first(self, key: tuple) -> int | None:
        """Position of the first copy of `key` (all copies are on one rank), or None."""
        at = self.occ.get(key)
        return at[0][1] if at else None

    def backward(self, s: int, m: int, i: int) -> int | None:
        """Position of the backward or backward-input of (s, m, i), whichever exists."""
        p = self.first((_O.BACKWARD, None, s, m, i))
        return p if p is not None else self.first((_O.BACKWARD_INPUT, None, s, m, i))


def _key(ins: Instr, r: int) -> tuple:
    op = ins.op
    if op is _O.LOAD:
        return (op, r, ins.mb)
    if op is _O.REDUCE_TIED:
        return (op, r, ins.tie)
    if op is _O.STEP:
        return (op, r)
    if op is _O.FREE_KV:
        return (op, ins.stage, ins.mb)
    if op is _O.ALLREDUCE:
        return (op, ins.stage)
    return (op, ins.payload, ins.stage, ins.mb, ins.slice)


def _build_index(plan: Plan, valid: list[list[bool]]) -> _Index:
    idx = _Index(valid=valid)
    occ, last_about = idx.occ, idx.last_about
    last_wgrad, last_param = idx.last_wgrad, idx.last_param
    for r, rp in enumerate(plan.ranks):
        ok = valid[r]
        keys: list[tuple | None] = [None] * len(rp.instrs)
        idx.keys.append(keys)
        for p, ins in enumerate(rp.instrs):
            if not ok[p]:
                continue
            key = keys[p] = _key(ins, r)
            occ[key].append((r, p))
            op = ins.op
            if ins.stage is not None and ins.mb is not None and op is not _O.FREE_KV:
                last_about[(ins.stage, ins.mb)] = p
            if op in _WEIGHT_GRAD_OPS:
                last_wgrad[ins.stage] = p
            if op in _PARAM_OPS:
                last_param[r] = p
    return idx


# ------------------------------------------------------------------------- the program


@dataclass
class _Shape:
    """What the rules need from the header, precomputed."""

    k: int
    pipe: int
    data: int
    stage_rank: list[int]
    nslices: list[int]
    ties: dict[str, frozenset[int]]
    tie_names: frozenset[str]
    # tie -> ranks holding its stages
    tie_ranks: dict[str, frozenset[int]]
    ends: frozenset[int]  # the ranks of the first and last stage: they load

    @staticmethod
    def of(plan: Plan) -> "_Shape":
        h = plan.header
        stage_rank = [st.rank for st in h.stages]
        ties = _valid_ties(plan)
        return _Shape(
            k=len(h.stages), pipe=h.mesh.pipe, data=h.mesh.data, stage_rank=stage_rank,
            nslices=[len(mb.slices) for mb in h.microbatches], ties=ties,
            tie_names=frozenset(t.name for t in h.ties),
            tie_ranks={n: frozenset(stage_rank[s] for s in st) for n, st in ties.items()},
            ends=frozenset({stage_rank[0], stage_rank[-1]}),
        )


def _check_program(plan: Plan, rep: _Report) -> None:
    shape = _Shape.of(plan)
    valid = _check_operands(plan, shape, rep)
    idx = _build_index(plan, valid)
    _check_duplicates(idx, rep)
    _check_compute_complete(plan, shape, idx, rep)
    _check_comm_complete(shape, idx, rep)
    _check_once_per_rank(plan, shape, idx, rep)
    _check_order(plan, shape, idx, rep)
    _check_fifo(plan, shape, idx, rep)
    if rep.comm_errors == 0:
        _check_deadlock(plan, shape, idx, rep)


# -------------------------------------------------------------------------------- operands


def _check_operands(plan: Plan, shape: _Shape, rep: _Report) -> list[list[bool]]:
    """Rules O1-O6: report each bad instruction once; return which ones are usable."""
    valid = []
    for r, rp in enumerate(plan.ranks):
        ok = []
        for p, ins in enumerate(rp.instrs):
            problem = _operand_problem(ins, r, shape)
            if problem is not None:
                message, hint, comm = problem
                rep.instr(r, p, message, hint, comm=comm)
            ok.append(problem is None)
        valid.append(ok)
    return valid


def _operand_problem(ins: Instr, r: int, shape: _Shape) -> tuple[str, str, bool] | None:
    """(message, hint, breaks pairing) for the first operand rule `ins` breaks, or None."""
    comm = ins.op in (_O.SEND, _O.RECV, _O.REDUCE_TIED)
    k, m_count = shape.k, len(shape.nslices)
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
    if ins.stage is not None and shape.stage_rank[ins.stage] != r:
        owner = shape.stage_rank[ins.stage]
        return (f"stage {ins.stage} is held by rank {owner}, not by rank {r}",
                f"move this line to the section of rank {owner}", comm)
    if ins.op is _O.LOAD and r not in shape.ends:
        return (f"rank {r} holds neither the first nor the last stage: it loads nothing",
                "remove this line; only the ranks of the first stage (token ids) and of the "
                "last stage (targets) load micro-batches", False)
    if ins.op in (_O.SEND, _O.RECV):
        return _peer_problem(ins, r, shape)
    if ins.op is _O.ALLREDUCE and shape.data == 1:
        return ("allreduce with `mesh data 1`: there is no data-parallel group to reduce over",
                "remove this line, or raise `mesh data`", False)
    if ins.op is _O.REDUCE_TIED:
        return _tie_problem(ins, r, shape)
    return None


def _peer_problem(ins: Instr, r: int, shape: _Shape) -> tuple[str, str, bool] | None:
    s, last = ins.stage, shape.k - 1
    sends = ins.op is _O.SEND
    nb = neighbour_stage(ins)
    if not 0 <= nb <= last:
        why = {
            (True, ACT): "the last stage sends no activation: its output is the loss",
            (False, ACT): "the first stage receives no activation: it loads its token ids",
            (True, GRAD): "the first stage sends no input gradient: its input is token ids",
            (False, GRAD): "the last stage receives no gradient: it starts from its loss",
        }[(sends, ins.payload)]
        return why, "remove this line", True
    owner = shape.stage_rank[nb]
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


def _tie_problem(ins: Instr, r: int, shape: _Shape) -> tuple[str, str, bool] | None:
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


def _check_duplicates(idx: _Index, rep: _Report) -> None:
    """Every instruction exists at most once (C1-C8): report each extra copy."""
    for key, at in idx.occ.items():
        if len(at) < 2:
            continue
        r0, p0 = at[0]
        comm = key[0] in (_O.SEND, _O.RECV, _O.REDUCE_TIED)
        for r, p in at[1:]:
            rep.instr(r, p, f"duplicate instruction: the same one is at {rep.ref(r0, p0)}",
                      "remove one of the two", comm=comm)


def _check_compute_complete(plan: Plan, shape: _Shape, idx: _Index, rep: _Report) -> None:
    """C1, C2: one forward and one backward (or split pair) per slice; recompute iff checkpoint."""
    occ, first = idx.occ, idx.first
    for s in range(shape.k):
        r = shape.stage_rank[s]
        for m, n in enumerate(shape.nslices):
            for i in range(n):
                what = f"stage {s} mb {m} slice {i}"
                fwd = occ.get((_O.FORWARD, None, s, m, i))
                if not fwd:
                    after = first((_O.FORWARD, None, s, m, i - 1)) if i else None
                    place = f", below {rep.ref(r, after)}" if after is not None else ""
                    rep.section(r, f"no forward of {what}",
                                f"add {_text(_O.FORWARD, s, m, i)} to rank {r}{place}")
                _check_backward_complete(shape, idx, rep, s, m, i)
                if fwd:
                    _check_recompute(rep, idx, fwd[0], s, m, i)


def _check_backward_complete(shape: _Shape, idx: _Index, rep: _Report, s: int, m: int,
                             i: int) -> None:
    occ = idx.occ
    r = shape.stage_rank[s]
    full = occ.get((_O.BACKWARD, None, s, m, i), ())
    bin_ = occ.get((_O.BACKWARD_INPUT, None, s, m, i), ())
    bw = occ.get((_O.BACKWARD_WEIGHT, None, s, m, i), ())
    what = f"stage {s} mb {m} slice {i}"
    if full and (bin_ or bw):
        r2, p2 = (bin_ or bw)[0]
        rep.instr(r2, p2, f"{what} has both a backward ({rep.at(*full[0])}) and a split backward",
                  "use either one `backward` or a `backward-input` and a `backward-weight`, "
                  "not both")
    elif not full and not bin_ and not bw:
        place = ""
        after = idx.first((_O.FORWARD, None, s, m, i))
        if after is not None:
            place = f", below {rep.ref(r, after)}"
        rep.section(r, f"no backward of {what}",
                    f"add {_text(_O.BACKWARD, s, m, i)} to rank {r}{place}")
    elif bin_ and not bw:
        rep.instr(*bin_[0], f"backward-input of {what} has no backward-weight",
                  f"add {_text(_O.BACKWARD_WEIGHT, s, m, i)} below this line, or make this a "
                  "full `backward`")
    elif bw and not bin_ and not full:
        rep.instr(*bw[0], f"backward-weight of {what} has no backward-input",
                  f"add {_text(_O.BACKWARD_INPUT, s, m, i)} above this line, or make this a "
                  "full `backward`")


def _check_recompute(rep: _Report, idx: _Index, fwd_at: tuple[int, int], s: int, m: int,
                     i: int) -> None:
    r, p = fwd_at
    checkpointed = rep.plan.ranks[r].instrs[p].checkpoint
    rec = idx.occ.get((_O.RECOMPUTE, None, s, m, i))
    if checkpointed and not rec:
        bwd = idx.backward(s, m, i)
        place = f" above {rep.ref(r, bwd)}" if bwd is not None else " before its backward"
        rep.instr(r, p, f"checkpoint forward of stage {s} mb {m} slice {i} is never recomputed",
                  f"a checkpoint forward keeps no graph: add {_text(_O.RECOMPUTE, s, m, i)}"
                  f"{place}, or drop `checkpoint`")
    elif rec and not checkpointed:
        rep.instr(*rec[0], f"recompute of stage {s} mb {m} slice {i}, whose forward "
                  f"({rep.at(r, p)}) is not a checkpoint forward",
                  "remove this line, or add `checkpoint` to the forward")


def _check_comm_complete(shape: _Shape, idx: _Index, rep: _Report) -> None:
    """C4: every activation and gradient crossing ranks has one send and one receive."""
    for s in range(shape.k - 1):
        src, dst = shape.stage_rank[s], shape.stage_rank[s + 1]
        if src == dst:
            continue
        for m, n in enumerate(shape.nslices):
            for i in range(n):
                _check_pair(idx, rep, ACT, s, s + 1, m, i, src, dst)
                _check_pair(idx, rep, GRAD, s + 1, s, m, i, dst, src)


def _check_pair(idx: _Index, rep: _Report, payload: Payload, s_from: int, s_to: int, m: int,
                i: int, src: int, dst: int) -> None:
    """One message, from stage s_from on rank src to stage s_to on rank dst, is sent and
    received (C4)."""
    send = idx.occ.get((_O.SEND, payload, s_from, m, i))
    recv = idx.occ.get((_O.RECV, payload, s_to, m, i))
    if send and recv:
        return  # duplicates are reported by _check_duplicates
    send_text = _text(_O.SEND, s_from, m, i, payload, dst)
    recv_text = _text(_O.RECV, s_to, m, i, payload, src)
    # where the send belongs: after the compute producing the message; the receive: before
    # the compute consuming it
    if payload is ACT:
        produce = idx.first((_O.FORWARD, None, s_from, m, i))
        consume = idx.first((_O.FORWARD, None, s_to, m, i))
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


def _check_once_per_rank(plan: Plan, shape: _Shape, idx: _Index, rep: _Report) -> None:
    """C3, C6, C7, C8: loads, allreduce, reduce-tied and step that must be there."""
    occ = idx.occ
    for r in range(len(plan.ranks)):
        held = [s for s in range(shape.k) if shape.stage_rank[s] == r]
        if not held:
            continue
        if r in shape.ends:
            for m in range(len(shape.nslices)):
                if not occ.get((_O.LOAD, r, m)):
                    end_stage = 0 if shape.stage_rank[0] == r else shape.k - 1
                    use = idx.first((_O.FORWARD, None, end_stage, m, 0))
                    place = f" above {rep.ref(r, use)}" if use is not None else ""
                    rep.section(r, f"rank {r} never loads micro-batch {m}",
                                f"add {_text(_O.LOAD, mb=m)}{place}")
        if shape.data > 1:
            for s in held:
                if not occ.get((_O.ALLREDUCE, s)):
                    rep.section(r, f"stage {s} is never all-reduced over the {shape.data} "
                                "data-parallel replicas",
                                f"add {_text(_O.ALLREDUCE, s)} to rank {r} after the last "
                                f"backward of stage {s}, before `step`")
        for name in sorted(shape.ties):
            ranks = shape.tie_ranks[name]
            if len(ranks) > 1 and r in ranks and not occ.get((_O.REDUCE_TIED, r, name)):
                rep.section(r, f"rank {r} never reduces tie \"{name}\"",
                            f"add {_text(_O.REDUCE_TIED, tie=name)} to rank {r} after the last "
                            "backward of its tied stages, before `step`", comm=True)
        if not occ.get((_O.STEP, r)):
            rep.section(r, f"rank {r} never runs `step`",
                        "add `step` as the last instruction that touches parameters")


# ---------------------------------------------------------------------------- program order


def _check_order(plan: Plan, shape: _Shape, idx: _Index, rep: _Report) -> None:
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


def _needs(ins: Instr, r: int, shape: _Shape, idx: _Index, plan: Plan):
    """(position, why) of each instruction on rank r that `ins` needs before it (R1-R7).

    `why` is a format string and its arguments, formatted only for an error: this runs for
    every instruction of a plan, and most plans are valid."""
    op, s, m, i = ins.op, ins.stage, ins.mb, ins.slice
    first = idx.first
    out: list[tuple[int | None, tuple]] = []
    if op is _O.FORWARD:
        if i > 0:
            out.append((first((_O.FORWARD, None, s, m, i - 1)),
                        ("slice {} attends to the KV cache of slice {}", i, i - 1)))
        if s > 0:
            if shape.stage_rank[s - 1] == r:
                out.append((first((_O.FORWARD, None, s - 1, m, i)),
                            ("its input is the output of stage {}", s - 1)))
            else:
                out.append((first((_O.RECV, ACT, s, m, i)),
                            ("its input arrives with that receive",)))
        if s == 0:
            out.append((first((_O.LOAD, r, m)),
                        ("the first stage reads the micro-batch's token ids",)))
        elif s == shape.k - 1:
            out.append((first((_O.LOAD, r, m)),
                        ("the last stage reads the micro-batch's targets",)))
    elif op is _O.RECOMPUTE:
        out.append((first((_O.FORWARD, None, s, m, i)), ("it rebuilds the graph of that forward",)))
    elif op in (_O.BACKWARD, _O.BACKWARD_INPUT):
        fwd = first((_O.FORWARD, None, s, m, i))
        out.append((fwd, ("a slice is back-propagated after its forward",)))
        if fwd is not None and plan.ranks[r].instrs[fwd].checkpoint:
            out.append((first((_O.RECOMPUTE, None, s, m, i)),
                        ("a checkpoint forward keeps no graph: it is recomputed first",)))
        if i + 1 < shape.nslices[m]:
            out.append((idx.backward(s, m, i + 1),
                        ("slices are back-propagated in reverse token order: slice {} sends "
                         "gradients into the keys and values of slice {}", i + 1, i)))
        if s < shape.k - 1:
            if shape.stage_rank[s + 1] == r:
                out.append((idx.backward(s + 1, m, i),
                            ("the gradient of its output comes from stage {}", s + 1)))
            else:
                out.append((first((_O.RECV, GRAD, s, m, i)),
                            ("the gradient of its output arrives with that receive",)))
    elif op is _O.BACKWARD_WEIGHT:
        out.append((first((_O.BACKWARD_INPUT, None, s, m, i)),
                    ("the weight gradient comes after the input gradient of the same slice",)))
    elif op is _O.SEND:
        if ins.payload is ACT:
            out.append((first((_O.FORWARD, None, s, m, i)), ("it sends that forward's output",)))
        else:
            out.append((idx.backward(s, m, i), ("it sends that backward's input gradient",)))
    return [(p, why) for p, why in out if p is not None]


def _check_after_all(ins: Instr, r: int, p: int, shape: _Shape, idx: _Index,
                     rep: _Report) -> None:
    """R8-R11: instructions that must follow every instruction of some kind on their rank."""
    op = ins.op
    if op is _O.FREE_KV:
        last = idx.last_about.get((ins.stage, ins.mb))
        what = f"the KV cache of stage {ins.stage} mb {ins.mb}, which {{}} still uses"
    elif op is _O.ALLREDUCE:
        last = idx.last_wgrad.get(ins.stage)
        what = f"the gradients of stage {ins.stage}, to which {{}} still adds"
    elif op is _O.REDUCE_TIED:
        tied = [s for s in shape.ties.get(ins.tie, ()) if shape.stage_rank[s] == r]
        lasts = [idx.last_wgrad[s] for s in tied if s in idx.last_wgrad]
        last = max(lasts) if lasts else None
        what = f"the gradient of tie \"{ins.tie}\", to which {{}} still adds"
    elif op is _O.STEP:
        last = idx.last_param.get(r)
        what = f"the parameters of rank {r}, which {{}} still uses"
    else:
        return
    if last is not None and last > p:
        rep.instr(r, p, f"{ins} runs before it is done with " + what.format(rep.ref(r, last)),
                  f"move this line below {rep.at(r, last)}")


# ------------------------------------------------------------------------------------ FIFO


def _message(ins: Instr, r: int) -> tuple[int, int, Message]:
    """(sender rank, receiver rank, message) of a send or receive."""
    return (*channel(r, ins), message(ins))


def _channels(plan: Plan, idx: _Index):
    """(src, dst) -> ([(position, message)] of sends on src, the same of receives on dst)."""
    chans: dict[tuple[int, int], tuple[list, list]] = defaultdict(lambda: ([], []))
    for r, rp in enumerate(plan.ranks):
        ok = idx.valid[r]
        for p, ins in enumerate(rp.instrs):
            if ok[p] and ins.op in (_O.SEND, _O.RECV):
                src, dst, msg = _message(ins, r)
                chans[(src, dst)][ins.op is _O.RECV].append((p, msg))
    return chans


def _check_fifo(plan: Plan, shape: _Shape, idx: _Index, rep: _Report) -> None:
    """F1: per channel, the receives take messages in the order they were sent."""
    for (src, dst), (sends, recvs) in sorted(_channels(plan, idx).items()):
        sent_at: dict[tuple, int] = {}
        for p, msg in sends:
            sent_at.setdefault(msg, p)
        top_send, top_recv = -1, -1
        for p, msg in recvs:
            sp = sent_at.get(msg)
            if sp is None:
                continue
            if sp < top_send:
                rep.instr(dst, p,
                          f"messages from rank {src} cross: this receive comes after "
                          f"{rep.ref(dst, top_recv)}, but rank {src} sends this one first: "
                          f"{rep.ref(src, sp)} before {rep.ref(src, top_send)}",
                          f"messages between two ranks arrive in the order they were sent: "
                          f"move this line above {rep.at(dst, top_recv)}, or swap the sends on "
                          f"rank {src}", comm=False)
                break
            top_send, top_recv = sp, p


# -------------------------------------------------------------------------------- deadlock


def _check_deadlock(plan: Plan, shape: _Shape, idx: _Index, rep: _Report) -> None:
    """D1: run every rank; a receive waits for its send, reduce-tied for its tie's ranks."""
    n_ranks = len(plan.ranks)
    streams = [
        [(p, ins) for p, ins in enumerate(rp.instrs)
         if idx.valid[r][p] and ins.op in (_O.SEND, _O.RECV, _O.REDUCE_TIED)
         and (ins.op is not _O.REDUCE_TIED or ins.tie in shape.ties)]
        for r, rp in enumerate(plan.ranks)
    ]
    ptr = [0] * n_ranks
    sent: set[tuple] = set()
    waiting_msg: dict[tuple, int] = {}
    arrived: dict[str, set[int]] = defaultdict(set)
    waiting_tie: dict[str, list[int]] = defaultdict(list)
    done_ties: set[str] = set()
    ready = deque(range(n_ranks))
    while ready:
        r = ready.popleft()
        stream = streams[r]
        while ptr[r] < len(stream):
            _, ins = stream[ptr[r]]
            if ins.op is _O.SEND:
                msg = _message(ins, r)[2]
                sent.add(msg)
                if msg in waiting_msg:
                    ready.append(waiting_msg.pop(msg))
            elif ins.op is _O.RECV:
                msg = _message(ins, r)[2]
                if msg not in sent:
                    waiting_msg[msg] = r
                    break
            elif ins.tie not in done_ties:
                arrived[ins.tie].add(r)
                if arrived[ins.tie] >= shape.tie_ranks[ins.tie]:
                    done_ties.add(ins.tie)
                    ready.extend(waiting_tie.pop(ins.tie, []))
                else:
                    waiting_tie[ins.tie].append(r)
                    break
            ptr[r] += 1
    stuck = [r for r in range(n_ranks) if ptr[r] < len(streams[r])]
    if stuck:
        _report_deadlock(plan, shape, idx, rep, streams, ptr, stuck, arrived)


def _report_deadlock(plan, shape, idx, rep, streams, ptr, stuck, arrived) -> None:
    blocked = {r: streams[r][ptr[r]][0] for r in stuck}
    waits_for: dict[int, list[int]] = {}
    for r in stuck:
        ins = plan.ranks[r].instrs[blocked[r]]
        if ins.op is _O.RECV:
            waits_for[r] = [ins.peer]
        else:
            waits_for[r] = sorted(shape.tie_ranks[ins.tie] - arrived[ins.tie])
    send_at = _send_positions(plan, idx)
    for r in stuck:
        chain = _wait_chain(r, waits_for, blocked, rep)
        ins = plan.ranks[r].instrs[blocked[r]]
        if ins.op is _O.RECV:
            src = ins.peer
            sp = send_at.get(_message(ins, r)[2])
            message = (f"deadlock: rank {r} waits here forever for rank {src}, which never "
                       f"reaches its matching send")
            fix = ""
            if sp is not None and src in blocked:
                fix = (f"; the send at {rep.ref(src, sp)} must run before rank {src} blocks at "
                       f"{rep.at(src, blocked[src])}: move one of them, or this receive")
        else:
            others = ", ".join(str(q) for q in waits_for[r])
            message = (f"deadlock: rank {r} waits here forever for rank(s) {others} to reach "
                       f"reduce-tied \"{ins.tie}\"")
            fix = "; reorder so that every rank of the tie reaches it without waiting on another"
        rep.instr(r, blocked[r], message, chain + fix)


def _send_positions(plan: Plan, idx: _Index) -> dict[tuple, int]:
    out: dict[tuple, int] = {}
    for r, rp in enumerate(plan.ranks):
        for p, ins in enumerate(rp.instrs):
            if idx.valid[r][p] and ins.op is _O.SEND:
                out.setdefault(_message(ins, r)[2], p)
    return out


def _wait_chain(start: int, waits_for: dict[int, list[int]], blocked: dict[int, int],
                rep: _Report) -> str:
    """'rank 0 waits at line 12 for rank 1, which waits at line 30 for rank 0'."""
    parts = [f"rank {start} waits at {rep.at(start, blocked[start])}"]
    seen = {start}
    r = start
    while True:
        nxt = [q for q in waits_for.get(r, ()) if q in blocked]
        if not nxt:
            return " ".join(parts)
        q = nxt[0]
        if q in seen:
            parts.append(f"for rank {q}")
            return " ".join(parts)
        parts.append(f"for rank {q}, which waits at {rep.at(q, blocked[q])}")
        seen.add(q)
        r = q
