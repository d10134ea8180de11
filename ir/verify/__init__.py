"""Static verification of a plan: every rule of the plan format, all errors at once, located.

`verify(plan)` returns every error as a `Diagnostic` at the offending line (or, for a plan built
in memory without locations, at "rank R, instruction N (...)", N counting from 0 in
`plan.ranks[R].instrs`), sorted by line; `check(plan)` raises them as one `TpirError`;
`verify_file(path)` reads, parses and checks a `.tpir` file so that errors render with the
source line and a caret. `tpc compile` checks the plan it has lowered (the lowering passes
build an incomplete plan until the last one), `tpc verify` and `tpc simulate` check
what they read, and the executors check a plan before they run it, so this module is the
precise statement of what a valid plan is. The rules are checked in this order, header.py
(H), program.py (O, C, R) and comm.py (F, X, D); report.py holds what they share:

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
  H7  `documents eos ID mean M` (format version 6): ID is a token of the vocabulary, M at most
      the row's length, no tensor axis, no split backward (`backward-input`: the executors run
      packed documents eagerly); every rank that runs a stage of a micro-batch loads it
      (O3 and C3 then ask for those loads, and a forward of a middle stage waits for its load).
  H8  `random-ltd units U ... min-value K0 max-value K1 require-steps N seq-per-step Q` (format
      version 6): the units are distinct middle units (1..units-2), ascending; K0 <= K1; no
      tensor axis, no packed documents, no split backward (dropped units run eagerly).

Operands (an instruction that fails one of these is reported once and then left out of the
rules below, so one wrong number gives one error, not a cascade):
  O1  the stage, micro-batch, slice (of that micro-batch), peer rank and tie exist.
  O2  an instruction about stage S is in the section of the rank that holds S.
  O3  `load mb M` only on a rank that holds the first or the last stage (any stage of M's, over
      packed documents: H7).
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
      that rank (any of their weight replicas).
  R11 `step` after every forward, recompute, backward(-input/-weight), allreduce and
      reduce-tied of its rank: it is the last instruction that touches parameters.

Communication across ranks:
  F1  between two ranks, in one direction, messages are received in the order they were sent
      (channels are FIFO and untagged): the first crossing pair of each channel is reported.
  X1  (format version 2, H1) `exchange N` is followed by N >= 2 sends and receives, the sends
      first, no other instruction and no exchange among them.
  D1  no deadlock under the rules of the backend the plan is checked for (`comm`, tpc.ir.
      semantics): all ranks are simulated. `gloo` (the default of `verify`): a send is
      buffered and never blocks; a receive blocks until its send has run. `nccl`: a send or
      receive blocks its rank until its partner is posted on the other rank (rendezvous: one
      FIFO per rank pair, both directions), and an exchange until all its members are matched,
      which happens together. Under both, `reduce-tied` blocks until every rank of its tie
      reaches it; `allreduce` is among identical data-parallel replicas and never waits on
      another pipeline rank. Each stuck rank is reported at the instruction it blocks on, with
      the chain of ranks and lines waiting for each other. The simulation runs only when the
      matching rules (O4, O6, C4, C7, X1) hold, since it needs every receive paired with its one
      send. `tpc compile` checks under the rules of its target (`--comm`, NCCL unless told
      gloo), `tpc run` under those of the backend it runs on, `tpc verify` under `--comm`.

The evaluation program (format version 2: an `eval` line after the training program, its own
`microbatch` lines and rank sections; docs/ir.md, "The evaluation program") is checked as a plan
of its own (`Plan.evaluation()`: the same header with its micro-batches) by the rules above, with
these in place of the training-only ones (evaluation.py):
  E1  `eval` needs `tpir 2` (H1, `header.require_version`); its micro-batches follow H5 (sizes
      summing to batch / data, slices tiling [0, seq)) and it has one `rank R` section per
      pipeline rank, in order (H6).
  E2  forward only: its instructions are `load`, `forward` (never `checkpoint`), `send act`,
      `recv act`, `exchange` (X1), `free-kv` and `reduce-loss`; `reduce-loss` only there, only when `mesh data`
      > 1, and only on the rank of the last stage. O1-O4 hold as in training.
  E3  completeness: exactly one forward per (stage, mb, slice) (C1 without backward); loads
      (C3); for every activation crossing ranks one send and one receive (C4 without
      gradients); every (stage, mb) freed exactly once (no KV cache outlives the program); with
      `mesh data` > 1 exactly one `reduce-loss` on the rank of the last stage; no step.
  E4  order: R1-R3, R7 and R8 as in training; `reduce-loss` after every forward of the last
      stage on its rank. F1 and D1 as in training (a forward-only program sends one direction
      per pair of ranks, and `reduce-loss`, among identical replicas, never waits on another
      pipeline rank).

Weight replicas (format version 3: `stage S ranks R0 R1 ...`, `microbatch ... replica K`,
`reduce-replicas stage S`; docs/ir.md, "Weight replicas"):
  W1  each needs `tpir 3` (H1); a stage's replica ranks are distinct and exist (H2); every stage
      has as many replicas as the others. A tie may join replicated stages: its members (O6,
      C7, D1) are every rank holding any replica of a tied stage, and `reduce-replicas` sums
      the stage's other parameters, leaving the tied one to `reduce-tied` (one sum that counts
      each replica of each tied stage once).
  W2  a micro-batch's replica is one the stages have; the evaluation runs on replica 0 (E1).
  W3  "the rank of stage S" in O2-O4, C3, C4 and R2/R5 is the rank of S's replica for the
      instruction's micro-batch.
  W4  `reduce-replicas stage S` exactly once on each rank holding a replica of S, never for a
      stage of one replica; after every backward of S on its rank; before `step` (R11); it
      blocks in D1 until every rank of S's replicas reaches it, as reduce-tied does.

The tensor axis (format version 4: `mesh pipe P data D tensor T`; docs/ir.md, "The tensor axis"):
  T1  `tensor T` with T > 1 needs `tpir 4` (H1); `tensor 1` is no tensor axis.
  T2  T divides the shape's vocabulary (the embedding and the head are split by vocabulary rows).
  The T ranks of a stage's tensor group run the same rank section: the rules above hold per
  pipeline rank, as they do for data replicas.

Plan bundles (format version 2; `tpc.ir.verify.bundle.load_bundle` reads and checks one: an
index, `tpir 2` then `bundle`, the model, mesh, units, stage and tie lines its plans share, and
one `plan "PATH" seq L batch B` line per plan; each plan is verified by every rule above, its
errors located in its own file):
  B1  the index says `tpir 2` or newer (rule H1, `header.require_version`).
  B2  it lists at least one plan, by strictly increasing length; each plan file exists (paths
      are relative to the index's folder).
  B3  every plan has the index's model line (path, sha256, factory), mesh, units, stage split
      (each stage's index, rank and unit range) and ties: switching between them moves no weight.
  B4  each plan's shape has its plan line's seq and batch; all plans have one vocab and dtype.
The index's own stage lines are checked through B3: each equals that of a plan verified by H2-H4.
"""

from __future__ import annotations

from pathlib import Path

from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Plan
from tpc.ir.semantics import COMMS, DEFAULT_COMM, CommRules
from tpc.ir.verify.comm import check_deadlock, check_exchanges, check_fifo
from tpc.ir.verify.evaluation import check_evaluation
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

__all__ = ["verify", "check", "verify_file", "DTYPES", "COMMS"]


# ------------------------------------------------------------------------------ public API


def verify(plan: Plan, comm: CommRules = DEFAULT_COMM) -> list[Diagnostic]:
    """Every error of `plan` under the communication rules `comm` (`CommRules`: GLOO, buffered
    sends, or NCCL, rendezvous sends; a spelling is read by `CommRules.of`), sorted by line (by
    rank and instruction when there are no lines)."""
    comm = CommRules.of(comm)
    report = Report(plan)
    if check_header(plan, report):
        _check_program(plan, report, comm)
    if plan.eval is not None:
        check_evaluation(plan, report, lambda p, r: _check_program(p, r, comm))
    return report.sorted()


def check(plan: Plan, comm: CommRules = DEFAULT_COMM) -> Plan:
    """`plan` itself if it is valid under `comm`'s rules; otherwise a `TpirError` carrying every
    diagnostic."""
    diagnostics = verify(plan, comm)
    if diagnostics:
        raise TpirError(diagnostics, source=None)
    return plan


def verify_file(path: str, comm: CommRules = DEFAULT_COMM) -> Plan:
    """Read, parse and check a `.tpir` file under `comm`'s rules; errors carry its text so
    carets render."""
    from tpc.ir.parse import parse

    from tpc.ir.files import read_text

    text = read_text(path)
    try:
        plan = parse(text, file=path)
    except TpirError as e:
        if e.source is None:
            raise TpirError(e.diagnostics, source=text) from None
        raise
    diagnostics = verify(plan, comm)
    if diagnostics:
        raise TpirError(diagnostics, source=text)
    return plan


def _check_program(plan: Plan, rep: Report, comm: CommRules) -> None:
    """The instruction rules (O, C, R, F, X, D; in a forward-only plan E2-E4) of one program."""
    shape = Shape.of(plan)
    valid = check_operands(plan, shape, rep)
    idx = build_index(plan, valid)
    check_duplicates(idx, rep)
    check_compute_complete(plan, shape, idx, rep)
    check_comm_complete(shape, idx, rep)
    check_once_per_rank(plan, shape, idx, rep)
    check_order(plan, shape, idx, rep)
    check_fifo(plan, shape, idx, rep)
    check_exchanges(plan, rep)
    if rep.comm_errors == 0:
        check_deadlock(plan, shape, idx, rep, comm)
