"""Static verification of a plan: every rule of the plan format, all errors at once, located.

`verify(plan)` returns every error as a `Diagnostic` at the offending line (or, for a plan built
in memory without locations, at "rank R, instruction N (...)", N counting from 0 in
`plan.ranks[R].instrs`), sorted by line; `check(plan)` raises them as one `TpirError`;
`verify_file(path)` reads, parses and checks a `.tpir` file so that errors render with the
source line and a caret. `tpc compile` checks the plan it has lowered (the lowering passes
build an incomplete plan until the last one), `tpc verify` and `tpc simulate` check
what they read, and the executors check a plan before they run it, so this module is the
precise statement of what a valid plan is. The rules are checked in this order, header.py
(H), program.py (O, C, R) and comm.py (F, D); report.py holds what they share:

Header (a broken numbering of stages, micro-batches or rank sections makes every later rule
meaningless, so those stop verification after the header):
  H1  `tpir N`: a format version this module reads (`FORMAT_VERSIONS`), and no line or
      instruction newer than N (`header.require_version`); the model's sha256 is 64 hex digits;
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
  R9  `allreduce stage s` after every backward and backward-weight of stage s, and of every
      stage on its rank joined to s by ties (`semantics.allreduce_covers`: a tied parameter of
      two stages on one rank is one tensor, reduced by the first of their allreduces).
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

from pathlib import Path

from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Plan
from tpc.ir.verify.comm import check_deadlock, check_fifo
from tpc.ir.verify.header import DTYPES, check_header
from tpc.ir.verify.program import (
    check_comm_complete,
    check_compute_complete,
    check_duplicates,
    check_once_per_rank,
    check_operands,
    check_order,
)
from tpc.ir.verify.report import Report, Shape, build_index

__all__ = ["verify", "check", "verify_file", "DTYPES"]


# ------------------------------------------------------------------------------ public API


def verify(plan: Plan) -> list[Diagnostic]:
    """Every error of `plan`, sorted by line (by rank and instruction when there are no lines)."""
    report = Report(plan)
    if check_header(plan, report):
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


def _check_program(plan: Plan, rep: Report) -> None:
    shape = Shape.of(plan)
    valid = check_operands(plan, shape, rep)
    idx = build_index(plan, valid)
    check_duplicates(idx, rep)
    check_compute_complete(plan, shape, idx, rep)
    check_comm_complete(shape, idx, rep)
    check_once_per_rank(plan, shape, idx, rep)
    check_order(plan, shape, idx, rep)
    check_fifo(plan, shape, idx, rep)
    if rep.comm_errors == 0:
        check_deadlock(plan, shape, idx, rep)
