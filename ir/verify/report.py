"""What every rule of the verifier shares: the report that collects located diagnostics, the
index of where each instruction is, and the shape of the plan the rules need."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from tpc.ir.diagnostics import Diagnostic
from tpc.ir.nodes import Instr, Loc, Op, Payload, Plan
from tpc.ir.semantics import allreduce_covers, replica_group
from tpc.ir.mesh import tie_pipe_ranks

ACT, GRAD = Payload.ACT, Payload.GRAD


class O:
    """The members of `Op` as plain class attributes. Reading an Enum member is a descriptor
    call in Python 3.11, and the verifier reads them a few times per instruction."""

    LOAD, FORWARD, RECOMPUTE, STEP = Op.LOAD, Op.FORWARD, Op.RECOMPUTE, Op.STEP
    BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT
    SEND, RECV, FREE_KV = Op.SEND, Op.RECV, Op.FREE_KV
    ALLREDUCE, REDUCE_TIED, EXCHANGE, REDUCE_LOSS = Op.ALLREDUCE, Op.REDUCE_TIED, Op.EXCHANGE, Op.REDUCE_LOSS
    REDUCE_REPLICAS = Op.REDUCE_REPLICAS


# ops whose instructions are about one (stage, mb, slice)
SLICE_OPS = (O.FORWARD, O.RECOMPUTE, O.BACKWARD, O.BACKWARD_INPUT, O.BACKWARD_WEIGHT)
# ops that read or write parameters or their gradients: `step` must come after all of them
PARAM_OPS = frozenset(SLICE_OPS) | {O.ALLREDUCE, O.REDUCE_TIED, O.REDUCE_REPLICAS}
# ops that add to a stage's weight gradients: allreduce and reduce-tied come after them
WEIGHT_GRAD_OPS = frozenset({O.BACKWARD, O.BACKWARD_WEIGHT})


class Report:
    """Collects diagnostics with a sort key, and knows how to name a place in the plan."""

    def __init__(self, plan: Plan, section: str = ""):
        self.plan = plan
        # "eval " for the evaluation program: "eval rank 0, instruction 3" in a plan without lines
        self.section_word = section
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
        self.add(ins.loc, f"{self.section_word}rank {r}, instruction {p} ({ins})",
                 (1 + bool(self.section_word), r, p), message, hint, comm)

    def section(self, r: int, message: str, hint: str, comm: bool = False) -> None:
        """An error about something missing from rank r's section: located at `rank r`."""
        self.add(self.plan.ranks[r].loc, f"{self.section_word}rank {r}",
                 (1 + bool(self.section_word), r, -1), message, hint, comm)

    def merge(self, other: "Report") -> None:
        """Take the diagnostics of another program's report (the evaluation's)."""
        self._items += other._items

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
        return f"line {loc.line}" if loc else f"{self.section_word}rank {r}, instruction {p}"


def text(op: Op, stage=None, mb=None, slice=None, payload=None, peer=None, tie=None) -> str:
    """An instruction as written in a plan, for hints that say what to add."""
    return "`" + str(Instr(op, stage, mb, slice, payload, peer, tie)) + "`"


# ----------------------------------------------------------------------------- the index


@dataclass
class Index:
    """Where each instruction is: key -> [(rank, position)] in program order of each rank.

    Keys: (op, payload, stage, mb, slice) for per-slice ops, send and recv; (op, stage, mb) for
    free-kv; (op, stage, rank) for allreduce and reduce-replicas (a stage with weight replicas
    reduces on each replica's rank); (op, rank, mb) for load; (op, rank, tie) for
    reduce-tied; (op, rank) for step. Only instructions that passed the operand rules are here.
    """

    occ: dict[tuple, list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))
    # per rank, the positions of the instructions that passed the operand rules
    valid: list[list[bool]] = field(default_factory=list)
    # per rank, each instruction's key (None for those that failed the operand rules)
    keys: list[list[tuple | None]] = field(default_factory=list)
    # (stage, mb) -> last position of an instruction about them other than free-kv
    last_about: dict[tuple[int, int], int] = field(default_factory=dict)
    # (rank, stage) -> last position of a backward or backward-weight of it on that rank (a
    # stage with weight replicas has backwards on each replica's rank)
    last_wgrad: dict[tuple[int, int], int] = field(default_factory=dict)
    # rank -> last position of an instruction that touches parameters
    last_param: dict[int, int] = field(default_factory=dict)

    def first(self, key: tuple) -> int | None:
        """Position of the first copy of `key` (all copies are on one rank), or None."""
        at = self.occ.get(key)
        return at[0][1] if at else None

    def backward(self, s: int, m: int, i: int) -> int | None:
        """Position of the backward or backward-input of (s, m, i), whichever exists."""
        p = self.first((O.BACKWARD, None, s, m, i))
        return p if p is not None else self.first((O.BACKWARD_INPUT, None, s, m, i))


def index_key(ins: Instr, r: int) -> tuple:
    op = ins.op
    if op is O.LOAD:
        return (op, r, ins.mb)
    if op is O.REDUCE_TIED:
        return (op, r, ins.tie)
    if op is O.STEP or op is O.REDUCE_LOSS:
        return (op, r)
    if op is O.FREE_KV:
        return (op, ins.stage, ins.mb)
    if op is O.ALLREDUCE or op is O.REDUCE_REPLICAS:
        return (op, ins.stage, r)
    return (op, ins.payload, ins.stage, ins.mb, ins.slice)


def build_index(plan: Plan, valid: list[list[bool]]) -> Index:
    idx = Index(valid=valid)
    occ, last_about = idx.occ, idx.last_about
    last_wgrad, last_param = idx.last_wgrad, idx.last_param
    for r, rp in enumerate(plan.ranks):
        ok = valid[r]
        keys: list[tuple | None] = [None] * len(rp.instrs)
        idx.keys.append(keys)
        for p, ins in enumerate(rp.instrs):
            if not ok[p] or ins.op is O.EXCHANGE:
                continue  # an exchange groups the lines below it; rule X1 checks it
            key = keys[p] = index_key(ins, r)
            occ[key].append((r, p))
            op = ins.op
            if ins.stage is not None and ins.mb is not None and op is not O.FREE_KV:
                last_about[(ins.stage, ins.mb)] = p
            if op in WEIGHT_GRAD_OPS:
                last_wgrad[(r, ins.stage)] = p
            if op in PARAM_OPS:
                last_param[r] = p
    return idx


# ------------------------------------------------------------------------------ the shape


@dataclass
class Shape:
    """What the rules need from the header, precomputed."""

    k: int
    pipe: int
    data: int
    stage_rank: list[int]  # replica 0's rank of each stage
    nslices: list[int]
    ties: dict[str, frozenset[int]]
    tie_names: frozenset[str]
    # tie -> ranks holding its stages
    tie_ranks: dict[str, frozenset[int]]
    ends: frozenset[int]  # the ranks of the first and last stage: they load
    # (rank, stage) -> the stages whose gradients the rank's allreduce of the stage reduces
    # (semantics.allreduce_covers), for every stage the rank holds a replica of
    allreduce_covers: dict[tuple[int, int], frozenset[int]]
    forward_only: bool = False  # the evaluation program (rules E2-E4)
    # the rank of each weight replica of each stage (format version 3), replica 0's first
    ranks_of: list[tuple[int, ...]] = field(default_factory=list)
    # the weight replica each micro-batch runs on
    replica: list[int] = field(default_factory=list)
    # the members of every collective between pipeline ranks: ties, and the replicas of each
    # replicated stage (`semantics.collective_groups`)
    groups: dict = field(default_factory=dict)
    # a plan over packed documents (format version 6): every stage reads a micro-batch's
    # document boundaries, so every rank that runs a stage of it loads it (rule H7)
    documents: bool = False

    def rank(self, s: int, m: int) -> int:
        """The rank that runs stage s for micro-batch m."""
        return self.ranks_of[s][self.replica[m]]

    def load_ranks(self, m: int) -> frozenset[int]:
        """The ranks that load micro-batch m: its first stage's (ids) and last stage's (targets);
        over packed documents every stage's rank (its document boundaries)."""
        if self.documents:
            return frozenset(self.rank(s, m) for s in range(self.k))
        return frozenset({self.rank(0, m), self.rank(self.k - 1, m)})

    @staticmethod
    def of(plan: Plan) -> "Shape":
        h = plan.header
        stage_rank = [st.rank for st in h.stages]
        ranks_of = [st.ranks for st in h.stages]
        replica = [mb.replica if mb.replica < len(ranks_of[0]) else 0 for mb in h.microbatches]
        ties = valid_ties(plan)
        tie_ranks = {n: frozenset(tie_pipe_ranks(ranks_of, st)) for n, st in ties.items()}
        groups = {**tie_ranks, **{replica_group(s): frozenset(rs) for s, rs in enumerate(ranks_of)
                                  if len(rs) > 1}}
        return Shape(
            k=len(h.stages), pipe=h.mesh.pipe, data=h.mesh.data, stage_rank=stage_rank,
            nslices=[len(mb.slices) for mb in h.microbatches], ties=ties,
            tie_names=frozenset(t.name for t in h.ties),
            tie_ranks=tie_ranks,
            ends=frozenset(r for s in (0, len(h.stages) - 1) for r in ranks_of[s]),
            forward_only=plan.forward_only,
            allreduce_covers={(r, s): allreduce_covers(ranks_of, ties.values(), s, r)
                              for s in range(len(h.stages)) for r in ranks_of[s]},
            ranks_of=ranks_of, replica=replica, groups=groups, documents=h.documents is not None,
        )


def valid_ties(plan: Plan) -> dict[str, frozenset[int]]:
    """Ties that passed H4 (first declaration of a name), as name -> stages."""
    k = len(plan.header.stages)
    out: dict[str, frozenset[int]] = {}
    for tie in plan.header.ties:
        stages = frozenset(tie.stages)
        if tie.name not in out and len(stages) >= 2 and all(0 <= s < k for s in stages):
            out[tie.name] = stages
    return out
