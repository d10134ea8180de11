"""The plan: frozen dataclasses for every line of a `.tpir` file.

A plan is a header (what was compiled, the mesh, the stages, the micro-batches and their token
slices) and one instruction stream per pipeline rank. Every data-parallel replica runs the same
streams on its own share of the batch, so streams are listed per pipeline rank only; which global
rank runs pipeline rank p of replica d is the mesh's to say (`MeshLine.value`, tpc.ir.mesh).

Every line-level value carries, outside equality, where it came from (`loc`), the full-line
comments written above it (`comments`) and the comment at the end of its line (`note`), so that
`print(parse(text)) == text` holds for canonical text with comments.

Instruction fields by op (see `OPERANDS`); `stage`, `mb` and `slice` are indices into the
header's stages, micro-batches and that micro-batch's slices:

    load mb M                         read micro-batch M's ids (first stage) / targets (last)
    forward stage S mb M slice I [checkpoint]
                                      forward of one token slice; `checkpoint` keeps no graph
    recompute stage S mb M slice I    rebuild the graph of a checkpointed forward
    backward stage S mb M slice I     input and weight gradient of one slice
    backward-input stage S mb M slice I
    backward-weight stage S mb M slice I
                                      split backward (zero-bubble schedules)
    send act|grad stage S mb M slice I to R
    recv act|grad stage S mb M slice I from R
                                      `stage` is always this rank's own stage: `send act stage 0`
                                      sends stage 0's output to the rank of stage 1; `recv act
                                      stage 1` receives stage 1's input from the rank of stage 0;
                                      `send grad stage 1` sends the gradient of stage 1's input;
                                      `recv grad stage 0` receives the gradient of stage 0's output
    free-kv stage S mb M              drop the KV cache (and its gradients) of stage S, mb M
    allreduce stage S                 sum stage S's gradients over the data-parallel group
    reduce-tied "NAME"                sum a tied parameter's gradient over the ranks holding it
    step                              optimizer step of every stage of this rank
    exchange N                        (version 2) the next N instructions, sends then
                                      receives, are one exchange: issued together and complete
                                      together (`batch_isend_irecv` on NCCL)
    reduce-loss                       sum the evaluation loss over the data-parallel group
                                      (evaluation program only, format version 2)
    reduce-replicas stage S           (version 3) sum stage S's gradients over the ranks holding
                                      its weight replicas (`stage S ranks R0 R1`)

A plan may hold, after the training program, an evaluation program (format version 2): an
`eval` line, its own micro-batches and one rank section per pipeline rank of the same mesh and
stages, running forward only (`EvalProgram`; `Plan.evaluation()` is it as a plan of its own).

What blocks depends on the backend's rules (tpc.ir.semantics: gloo's buffered sends, NCCL's
rendezvous sends); between two ranks, messages in one direction are received in the order they
were sent. `reduce-tied` blocks until every rank holding the tie has reached it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum

from tpc.ir.mesh import Mesh, tie_pipe_ranks

# The format version `tpc compile` writes. A plan keeps the version it was written in (printing a
# version-1 plan writes `tpir 1` again), every version in FORMAT_VERSIONS is read, and the
# verifier (rule H1) refuses a line or instruction that is newer than its plan's version line.
FORMAT_VERSION = 6
# each version this tpc reads, with what it added over the one before (docs/ir.md, "Versions")
FORMAT_VERSIONS: dict[int, str] = {
    1: "the first format",
    2: "the additions listed under version 2 in docs/ir.md",
    3: "weight replicas: `stage S ranks R0 R1`, `microbatch ... replica K`, `reduce-replicas`",
    4: "a tensor axis: `mesh pipe P data D tensor T`",
    5: "sequence parallelism: `mesh pipe P data D tensor T sequence-parallel`",
    6: "packed documents: `documents eos ID mean M`; random layerwise token dropping: "
       "`random-ltd units U ... min-value K0 max-value K1 require-steps N seq-per-step Q`",
}
# the format version that added weight replicas (two pipelines over the same stages)
REPLICA_VERSION = 3
# the format version that added the mesh's tensor axis
TENSOR_VERSION = 4
# the format version that added sequence parallelism over the tensor axis
SEQUENCE_VERSION = 5
# the format version that added packed documents (`documents eos ID mean M`)
DOCUMENTS_VERSION = 6
# the format version that added random layerwise token dropping (`random-ltd units ...`)
RANDOM_LTD_VERSION = 6


@dataclass(frozen=True)
class Loc:
    """A position in a source file; line and column count from 1."""

    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


def _trivia():
    """Fields every line carries outside equality: location and comments."""
    return dict(
        loc=field(default=None, compare=False, kw_only=True, repr=False),
        comments=field(default=(), compare=False, kw_only=True, repr=False),
        note=field(default=None, compare=False, kw_only=True, repr=False),
    )


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(what)


@dataclass(frozen=True)
class Line:
    """Base of every line-level value: where it came from and the comments around it."""

    loc: Loc | None = field(default=None, compare=False, kw_only=True, repr=False)
    # full-line comments written above this line, each without the leading '#'
    comments: tuple[str, ...] = field(default=(), compare=False, kw_only=True, repr=False)
    # the comment at the end of this line, without the leading '#'
    note: str | None = field(default=None, compare=False, kw_only=True, repr=False)

    def with_trivia(self, **kw):
        return dataclasses.replace(self, **kw)


# ---------------------------------------------------------------------------------- header


@dataclass(frozen=True)
class ModelLine(Line):
    """`model "PATH" sha256 "HEX" factory "NAME"`: what the plan was compiled from."""

    path: str
    sha256: str
    factory: str = "model"


@dataclass(frozen=True)
class ShapeLine(Line):
    """`shape batch B seq L vocab V dtype D`: B is the global batch (all data ranks)."""

    batch: int
    seq: int
    vocab: int
    dtype: str = "float32"

    def __post_init__(self):
        _check(self.batch >= 1 and self.seq >= 1 and self.vocab >= 1, "shape sizes must be >= 1")


@dataclass(frozen=True)
class DocumentsLine(Line):
    """`documents eos ID mean M` (format version 6): the rows are packed documents, each ended
    by the separator token ID; attention stays inside a document, positions restart at each
    one, and the target after a separator (the next document's first token) is not predicted.
    M is the corpus's mean document length in tokens (its profile), which the cost model prices
    attention by."""

    eos: int
    mean: int

    def __post_init__(self):
        _check(self.eos >= 0 and self.mean >= 1, "the separator id must be >= 0 and the mean length >= 1")


@dataclass(frozen=True)
class RandomLTDLine(Line):
    """`random-ltd units U1 U2 ... min-value K0 max-value K1 require-steps N seq-per-step Q`
    (format version 6): random layerwise token dropping (DeepSpeed Data Efficiency's random-LTD).
    Units U1 < U2 < ... run on a random subset of each slice's tokens; the kept count per sequence
    follows DeepSpeed's `fixed_linear` schedule, with its names: K0 at step 0, growing linearly to
    K1 over N steps, rounded down to a multiple of Q (tpc.compiler.random_ltd), and capped at the
    plan's sequence length."""

    units: tuple[int, ...]
    min_value: int
    max_value: int
    require_steps: int
    seq_per_step: int = 1

    def __post_init__(self):
        _check(bool(self.units), "random-ltd names no unit")
        _check(min(self.min_value, self.max_value, self.require_steps, self.seq_per_step) >= 1,
               "min-value, max-value, require-steps and seq-per-step must be >= 1")


@dataclass(frozen=True)
class MeshLine(Line):
    """`mesh pipe P data D [tensor T [sequence-parallel]]`: P pipeline ranks times D
    data-parallel replicas, each stage's weights split over T tensor ranks (version 4; 1 when
    absent); `sequence-parallel` (version 5): the activations outside the tensor-parallel
    regions, the messages between stages among them, split over the T ranks along the tokens."""

    pipe: int
    data: int = 1
    tensor: int = 1
    sequence: bool = False

    def __post_init__(self):
        _check(self.pipe >= 1 and self.data >= 1 and self.tensor >= 1, "mesh sizes must be >= 1")

    @property
    def value(self) -> Mesh:
        """The mesh as a value: ranks <-> coordinates and the groups of each axis."""
        return Mesh.of(self.pipe, self.data, self.tensor)

    @property
    def sizes(self) -> str:
        """The line's words after `mesh`: "pipe 2 data 1", "pipe 2 data 1 tensor 2"."""
        tensor = f" tensor {self.tensor}" if self.tensor != 1 or self.sequence else ""
        return f"pipe {self.pipe} data {self.data}{tensor}" + (" sequence-parallel" if self.sequence else "")


@dataclass(frozen=True)
class ScheduleLine(Line):
    """`schedule "NAME"`: the builder that made the compute order (informational)."""

    name: str


@dataclass(frozen=True)
class UnitsLine(Line):
    """`units N`: how many partition units the front end found in the model."""

    count: int


@dataclass(frozen=True)
class Stage(Line):
    """`stage S rank R units LO:HI "LABEL"`: stage S runs units [LO, HI) on pipeline rank R.

    `stage S ranks R0 R1 ... units LO:HI` (format version 3): stage S has a weight replica on
    each of those pipeline ranks, replica k on rank Rk (Chimera's pipelines in opposite
    directions). A micro-batch runs on the replica its `microbatch` line names; `rank` is
    replica 0's rank and `replicas` the ranks of replicas 1, 2, ..."""

    index: int
    rank: int
    units: tuple[int, int]
    label: str = ""
    replicas: tuple[int, ...] = ()

    @property
    def ranks(self) -> tuple[int, ...]:
        """The pipeline rank of each weight replica, replica 0 first."""
        return (self.rank, *self.replicas)


@dataclass(frozen=True)
class Tie(Line):
    """`tie "NAME" stages S T ...`: one parameter used by several stages (weight tying)."""

    name: str
    stages: tuple[int, ...]


@dataclass(frozen=True)
class Microbatch(Line):
    """`microbatch M size N slices 0:A A:B ... [replica K]`: N rows of this replica's batch, cut
    in slices, run on weight replica K of every stage (format version 3; 0 when absent)."""

    index: int
    size: int
    slices: tuple[tuple[int, int], ...]
    replica: int = 0

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(hi - lo for lo, hi in self.slices)


@dataclass(frozen=True)
class Header:
    model: ModelLine
    shape: ShapeLine
    mesh: MeshLine
    schedule: ScheduleLine
    units: UnitsLine
    stages: tuple[Stage, ...]
    microbatches: tuple[Microbatch, ...]
    ties: tuple[Tie, ...] = ()
    version: int = FORMAT_VERSION
    # `documents eos ID mean M` (format version 6): None for rows of one text each
    documents: DocumentsLine | None = None
    # `random-ltd units ...` (format version 6): None when every unit runs every token
    random_ltd: RandomLTDLine | None = None
    # comments above the `tpir` line, and on it
    version_comments: tuple[str, ...] = field(default=(), compare=False, repr=False)
    version_note: str | None = field(default=None, compare=False, repr=False)
    version_loc: Loc | None = field(default=None, compare=False, repr=False)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_rank(self, stage: int, mb: int | None = None) -> int:
        """The pipeline rank that runs stage `stage` for micro-batch `mb`. Without `mb` only for
        a stage without weight replicas (a ValueError otherwise: which replica would it be?)."""
        st = self.stages[stage]
        if not st.replicas:
            return st.rank
        if mb is None:
            raise ValueError(f"stage {stage} has weight replicas on ranks {list(st.ranks)}: "
                             "its rank depends on the micro-batch")
        return st.ranks[self.microbatches[mb].replica]

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """Every pipeline rank holding a weight replica of `stage`, replica 0's first."""
        return self.stages[stage].ranks

    def tie_ranks(self, name: str) -> tuple[int, ...]:
        """The pipeline ranks holding any weight replica of a stage of tie `name` (the members
        of its `reduce-tied` within a data-parallel replica), ascending; () for an undeclared
        tie."""
        ranks = [st.ranks for st in self.stages]
        return next((tie_pipe_ranks(ranks, t.stages) for t in self.ties if t.name == name), ())

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        """The stages whose weights (any replica) live on pipeline rank `rank`."""
        return tuple(s.index for s in self.stages if rank in s.ranks)

    @property
    def replicas(self) -> int:
        """How many weight replicas each stage has: 2 for a bidirectional pipeline, else 1."""
        return max((len(s.ranks) for s in self.stages), default=1)

    @property
    def replica_batch(self) -> int:
        """Rows of the batch each data-parallel replica trains on."""
        return self.shape.batch // self.mesh.data

    @property
    def tokens_per_step(self) -> int:
        """Tokens of the whole (global) batch: the loss is the mean over all of them."""
        return self.shape.batch * self.shape.seq

    def microbatch_rows(self, mb: int) -> tuple[int, int]:
        """[start, end) rows of micro-batch `mb` within this replica's batch."""
        start = sum(m.size for m in self.microbatches[:mb])
        return start, start + self.microbatches[mb].size


# ---------------------------------------------------------------------------- instructions


class Op(str, Enum):
    """The one enum of instruction kinds."""

    LOAD = "load"
    FORWARD = "forward"
    RECOMPUTE = "recompute"
    BACKWARD = "backward"
    BACKWARD_INPUT = "backward-input"
    BACKWARD_WEIGHT = "backward-weight"
    SEND = "send"
    RECV = "recv"
    FREE_KV = "free-kv"
    ALLREDUCE = "allreduce"
    REDUCE_TIED = "reduce-tied"
    STEP = "step"
    EXCHANGE = "exchange"
    REDUCE_LOSS = "reduce-loss"  # format version 2: the evaluation program's loss
    REDUCE_REPLICAS = "reduce-replicas"  # format version 3: sum a stage's replicas' gradients


class Payload(str, Enum):
    ACT = "act"  # a stage's output activation, travelling forward
    GRAD = "grad"  # the gradient of a stage's input, travelling backward


# Which fields each op takes, in printing order. `payload` and `peer` only for send/recv,
# `tie` only for reduce-tied, `checkpoint` only for forward.
OPERANDS: dict[Op, tuple[str, ...]] = {
    Op.LOAD: ("mb",),
    Op.FORWARD: ("stage", "mb", "slice"),
    Op.RECOMPUTE: ("stage", "mb", "slice"),
    Op.BACKWARD: ("stage", "mb", "slice"),
    Op.BACKWARD_INPUT: ("stage", "mb", "slice"),
    Op.BACKWARD_WEIGHT: ("stage", "mb", "slice"),
    Op.SEND: ("payload", "stage", "mb", "slice", "peer"),
    Op.RECV: ("payload", "stage", "mb", "slice", "peer"),
    Op.FREE_KV: ("stage", "mb"),
    Op.ALLREDUCE: ("stage",),
    Op.REDUCE_TIED: ("tie",),
    Op.STEP: (),
    Op.EXCHANGE: ("count",),
    Op.REDUCE_LOSS: (),
    Op.REDUCE_REPLICAS: ("stage",),
}

# instructions added after format version 1, with the version that added them (rule H1)
SINCE_VERSION: dict[Op, int] = {Op.EXCHANGE: 2, Op.REDUCE_REPLICAS: REPLICA_VERSION}

COMPUTE_OPS = frozenset(
    {Op.FORWARD, Op.RECOMPUTE, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT}
)
BACKWARD_OPS = frozenset({Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT})


@dataclass(frozen=True)
class Instr(Line):
    """One instruction of a rank's stream. Fields not in `OPERANDS[op]` stay None/False."""

    op: Op
    stage: int | None = None
    mb: int | None = None
    slice: int | None = None
    payload: Payload | None = None
    peer: int | None = None
    tie: str | None = None
    checkpoint: bool = False
    count: int | None = None  # exchange: how many sends and receives follow in it

    def __post_init__(self):
        # messages are built only on failure: plans have 100k instructions, parsed often
        wanted = OPERANDS[self.op]
        for name in ("stage", "mb", "slice", "payload", "peer", "tie", "count"):
            value = getattr(self, name)
            if name in wanted:
                if value is None:
                    raise ValueError(f"{self.op.value} needs {name}")
                if isinstance(value, int) and value < 0:
                    raise ValueError(f"{self.op.value}: {name} must be >= 0, got {value}")
            elif value is not None:
                raise ValueError(f"{self.op.value} takes no {name}")
        if self.checkpoint and self.op is not Op.FORWARD:
            raise ValueError("only forward takes checkpoint")

    @property
    def key(self) -> tuple[int | None, int | None, int | None]:
        """(stage, micro-batch, slice): the unit of work this instruction is about."""
        return (self.stage, self.mb, self.slice)

    def __str__(self) -> str:
        """The instruction as it is written in a .tpir file (without comments)."""
        parts = [self.op.value]
        for name in OPERANDS[self.op]:
            value = getattr(self, name)
            if name == "payload":
                parts.append(value.value)
            elif name == "peer":
                parts += ["to" if self.op is Op.SEND else "from", str(value)]
            elif name == "tie":
                parts.append(quote(value))
            elif name == "count":
                parts.append(str(value))
            else:
                parts += [name, str(value)]
        if self.checkpoint:
            parts.append("checkpoint")
        return " ".join(parts)


@dataclass(frozen=True)
class RankProgram(Line):
    """`rank R` followed by that pipeline rank's instructions, in execution order."""

    rank: int
    instrs: tuple[Instr, ...]


# the format version that added the evaluation program (`eval`, `reduce-loss`)
EVAL_VERSION = 2
# the instructions an evaluation program may hold: forward only (rule E2)
# (`exchange`: where a rank holds several stages, NCCL's rules pair its sends and receives)
EVAL_OPS = frozenset({Op.LOAD, Op.FORWARD, Op.SEND, Op.RECV, Op.EXCHANGE, Op.FREE_KV, Op.REDUCE_LOSS})


@dataclass(frozen=True)
class EvalProgram(Line):
    """`eval`, then the evaluation program's `microbatch` lines and one `rank R` section per
    pipeline rank: the forward of every slice of one batch of `shape batch` rows (the same
    mesh, stages and sequence length as training), its own micro-batches and token slices,
    no backward and no step. The loss is summed on the last stage (`reduce-loss` sums it over
    the data-parallel group). Format version 2."""

    microbatches: tuple[Microbatch, ...]
    ranks: tuple[RankProgram, ...]


@dataclass(frozen=True)
class Plan:
    header: Header
    ranks: tuple[RankProgram, ...]
    # comments after the last line of the file
    trailing_comments: tuple[str, ...] = field(default=(), compare=False, repr=False)
    # the file the plan was read from, for diagnostics
    source: str = field(default="<plan>", compare=False, repr=False)
    # the evaluation program, if the plan has one (format version 2)
    eval: EvalProgram | None = None
    # True for the plan `evaluation()` returns: a forward-only program (rules E2-E4)
    forward_only: bool = False

    def program(self, rank: int) -> RankProgram:
        return self.ranks[rank]

    def evaluation(self) -> "Plan | None":
        """The evaluation program as a plan of its own (the header with the evaluation's
        micro-batches, its rank sections, `forward_only`), which the verifier, the simulator
        and the executors read like any plan; None when there is none. The evaluation runs
        every token through every unit: its header has no `random-ltd` line."""
        if self.eval is None:
            return None
        header = dataclasses.replace(self.header, microbatches=self.eval.microbatches, random_ltd=None)
        return Plan(header=header, ranks=self.eval.ranks, source=self.source, forward_only=True)


# ------------------------------------------------------------------ the plan bundle (version 2)


@dataclass(frozen=True)
class BundleLine(Line):
    """`bundle`: the line after `tpir 2` that makes a file a plan bundle's index."""


@dataclass(frozen=True)
class BundleMember(Line):
    """`plan "PATH" seq L batch B`: one plan of the bundle, compiled for sequence length L and a
    global batch of B sequences. PATH is relative to the index file's folder."""

    path: str
    seq: int
    batch: int

    def __post_init__(self):
        _check(self.seq >= 1 and self.batch >= 1, "seq and batch must be >= 1")


@dataclass(frozen=True)
class Bundle:
    """The index of a plan bundle: one plan per sequence length, all with the same model, mesh,
    units, stage split and ties (so weights never move when a run switches plans), recorded
    here once. Members are listed by increasing length (docs/ir.md, "Plan bundles")."""

    bundle: BundleLine
    model: ModelLine
    mesh: MeshLine
    units: UnitsLine
    stages: tuple[Stage, ...]
    members: tuple[BundleMember, ...]
    ties: tuple[Tie, ...] = ()
    version: int = FORMAT_VERSION
    version_comments: tuple[str, ...] = field(default=(), compare=False, repr=False)
    version_note: str | None = field(default=None, compare=False, repr=False)
    version_loc: Loc | None = field(default=None, compare=False, repr=False)
    trailing_comments: tuple[str, ...] = field(default=(), compare=False, repr=False)
    source: str = field(default="<bundle>", compare=False, repr=False)

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(m.seq for m in self.members)

    def member(self, seq: int) -> BundleMember | None:
        return next((m for m in self.members if m.seq == seq), None)


def quote(text: str) -> str:
    """A string literal as the printer writes it: double quotes; backslash escapes for
    backslash, double quote, newline, carriage return and tab (one line, always)."""
    escaped = (
        text.replace("\\", "\\\\")
        .replace('"', '\\"')
        .replace("\n", "\\n")
        .replace("\r", "\\r")
        .replace("\t", "\\t")
    )
    return '"' + escaped + '"'
