"""The options of `tpc compile`, typed and checked in one place, with one set of defaults.

`CompileOptions` is the single source of the defaults: the command line (cli/main.py) reads
them from its fields (`DEFAULTS`), and a flag left out is a field left out. It checks itself on
construction, every option against the others, before any model is traced; every mistake is a
TpirError naming the option and saying what would be right. `check_options(**given)` reads the
options as the command line spells them (`--stages auto`, `--slices 5,11`, `--memory-per-rank
16GiB`) or as values, and returns them checked; an option not given keeps its default.

    --stages N|auto          --microbatches N|auto    --tensor T|auto
    --slices N|l1,l2,...|auto                         --memory-per-rank 16GiB|512MiB|80GB|...
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from tpc.compiler.schedules import SCHEDULES, replicas, stages_per_rank
from tpc.compiler.optimise.slicing import AUTO, check_slices, equal_slices, ranges_of, slice_example
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.compiler.lowering.lower import DEFAULT_EXCHANGES, EXCHANGES, Exchanges
from tpc.ir.semantics import COMMS, DEFAULT_COMM, GLOO, CommRules

# Without a cost model (which the optimiser needs), `--slices auto` cuts the sequence into
# this many equal slices (about L/8 tokens each): enough to fill a short pipeline, few enough
# that per-slice overheads stay small.
AUTO_SLICE_COUNT = 8


def _error(option: str, message: str, hint: str) -> TpirError:
    return TpirError(Diagnostic(message, hint=hint, where=option))


# ------------------------------------------------------------------------------ options


@dataclass(frozen=True)
class CompileOptions:
    """What `tpc compile` is asked for, typed (`check_options` reads the command line's
    spellings into this). Checked on construction against itself, before any model is traced;
    every mistake is a TpirError naming the option. Each default is the default of the flag.

    `stages`, `microbatches`, `slices` and `schedule` may be AUTO: the plan search chooses them,
    which needs a cost model (`cost`: a profile from `tpc profile`, or `device_model`).
    `slices` is a count of equal slices, the lengths of each slice, or AUTO. With
    `stages=AUTO` the search splits `ranks` into pipeline x data (`dp` stays 1), and with
    `tensor=AUTO` too into pipeline x data x tensor."""

    seq_len: int  # tokens per sequence (required: the plan's shapes are static)
    batch: int  # sequences per optimizer step, all data replicas together (required)
    # pipeline stages: two fill a pipeline and keep the tiny examples quick; AUTO: the search
    stages: int | str = 2
    # micro-batches per step: one, so a plan needs no more rows than the batch; AUTO: the knapsack
    microbatches: int | str = 1
    # token slices per micro-batch: one (no token-level pipelining) until asked; lengths; AUTO
    slices: int | tuple[int, ...] | str = 1
    # 1F1B over token slices: the memory of 1F1B, the bubble TeraPipe's slices shrink
    schedule: str = "seq1f1b"
    dp: int = 1  # data-parallel replicas: none until asked
    # tensor-parallel ranks per stage (Megatron's split, found in the stage's graph and checked
    # at compile: docs/parallelism.md); 1: no tensor axis; AUTO: the search (with --stages auto)
    tensor: int | str = 1
    ranks: int | None = None  # total ranks; None: stages x dp x tensor (one stage per pipeline rank)
    # Megatron's sequence parallelism over the tensor ranks: the activations between the
    # tensor-parallel regions (and the messages between stages) split along the tokens
    sequence_parallel: bool = False
    # the forwards (and the backwards) of consecutive slices of a stage brought together in each
    # rank's stream (compiler/lowering/lower.py, `pair_slices`), so that each pair runs as one program in
    # which one slice's tensor collectives run while the other computes (compiler/tensor/overlap.py)
    tensor_overlap: bool = False
    factory: str = "model"  # the callable in the model file that returns the model
    cost: str | None = None  # a profile from `tpc profile`; None: no plan search
    device_model: str | None = None  # an analytic device (h100, ...); None: no plan search
    memory_per_rank: float | None = None  # bytes, for the plan search; None: no budget
    # the plan will run with `tpc run --shard-optimizer` (ZeRO-1): the memory model gives each
    # rank 1/d of the optimizer state when fitting --memory-per-rank (a run option, not a line
    # of the plan: the instructions and their times are the same either way)
    shard_optimizer: bool = False
    explain: bool = False  # say what the search considered (stderr)
    quiet: bool = False  # no progress lines
    virtual_stages: int = 1  # stages per pipeline rank: `stages` ranks hold stages x V stages
    recompute: str = "none"  # none | full | auto (compiler/lowering/recompute.py): keep activations
    # the communication rules the plan is lowered, searched and verified for (tpc.ir.semantics):
    # NCCL's (CUDA; sends paired into exchanges; a plan for them also runs on gloo) or GLOO's (CPU)
    comm: CommRules = DEFAULT_COMM
    # how a plan for NCCL carries the sends and receives ranks must post together
    # (compiler/lowering/lower.py): batched, one `exchange N` (one batch_isend_irecv) each, where
    # both directions' transfers overlap; or ordered, single operations in a deadlock-free order,
    # for GPUs on which a batched exchange hangs (docs/training.md, 'Communication')
    exchanges: Exchanges = DEFAULT_EXCHANGES
    # the passes after which the compile prints the IR (compiler/passes.py; "all": every one)
    print_after: tuple[str, ...] = ()
    # packed documents (`--documents eos:ID`): the separator id; None: each row is one text
    documents: int | None = None
    # the corpus's mean document length in tokens (`--document-length`), which the cost model
    # prices attention by; None: the row's length (no document ends inside a row)
    document_length: int | None = None
    # random layerwise token dropping (`--random-ltd UNITS --random-ltd-schedule S`,
    # tpc.compiler.random_ltd.RandomLTD): the plan's `random-ltd` line, which the cost model
    # prices the dropped units by; None: every unit runs every token
    random_ltd: object = None

    def __post_init__(self):
        _check(self)

    # -- what the options say, derived

    @property
    def searching(self) -> bool:
        """A cost model is named: the plan search prices the candidates."""
        return bool(self.cost or self.device_model)

    @property
    def stages_auto(self) -> bool:
        return self.stages == AUTO

    @property
    def schedule_auto(self) -> bool:
        return self.schedule == AUTO

    @property
    def slices_auto(self) -> bool:
        return self.slices == AUTO

    @property
    def tensor_auto(self) -> bool:
        return self.tensor == AUTO

    @property
    def tensor_size(self) -> int:
        """The tensor-parallel degree; 1 until the search picks it (AUTO)."""
        return 1 if self.tensor_auto else self.tensor

    @property
    def microbatch_count(self) -> int | None:
        """The number of micro-batches; None when the optimiser chooses (AUTO)."""
        return None if self.microbatches == AUTO else self.microbatches

    @property
    def pipe(self) -> int:
        """Pipeline ranks: the stages (half of them for a V-shaped schedule, two stages per
        rank; with --virtual-stages V, each holds V of them; with --ranks R fewer than stages x
        dp, R / dp ranks hold the stages in a loop), or with `stages=AUTO` a placeholder until
        the search picks the mesh (all ranks)."""
        if self.stages_auto:
            return self.ranks
        if stages_per_rank(self.schedule) == 2:
            return self.stages // 2
        if self.virtual_stages == 1 and self.ranks is not None:
            return self.ranks // (self.dp * self.tensor_size)
        return self.stages

    @property
    def num_stages(self) -> int:
        """The model's pipeline stages (a multiple of the pipeline ranks)."""
        return self.stages * self.virtual_stages

    @property
    def chunks(self) -> int:
        """Stages per pipeline rank (1 but with --virtual-stages or --ranks below stages x dp)."""
        return 1 if self.stages_auto else self.num_stages // self.pipe

    @property
    def data(self) -> int:
        return 1 if self.stages_auto else self.dp

    @property
    def cuts(self) -> tuple[tuple[int, int], ...]:
        """The token slices as [start, end) ranges. With AUTO and no cost model, AUTO_SLICE_COUNT
        equal slices (with one, the optimiser replaces them)."""
        if self.slices_auto:
            return equal_slices(min(AUTO_SLICE_COUNT, self.seq_len), self.seq_len)
        if isinstance(self.slices, int):
            return equal_slices(self.slices, self.seq_len)
        return ranges_of(self.slices)


_NEEDS_COSTS = ("give --cost FILE (from `tpc profile`) or --device-model v100|a100|h100|h200|SPEC.json")


def _positive(option: str, value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _error(option, f"{option} must be a positive whole number, got {value!r}", f"give {what}")
    return value



def _times_tensor(T: int) -> str:
    """' x --tensor T' in a product of the ranks, when there is a tensor axis."""
    return f" x --tensor {T}" if T > 1 else ""


def _check(o: CompileOptions) -> None:
    """Every option checked against the others (CompileOptions.__post_init__); nothing here
    needs the model."""
    from tpc.compiler.lowering.recompute import OPTION as RECOMPUTE

    try:
        object.__setattr__(o, "comm", CommRules.of(o.comm))  # a spelling read once, here
    except ValueError:
        raise _error("--comm", f"unknown communication rules {o.comm!r}",
                     "choose " + " or ".join(f"{k} ({v})" for k, v in COMMS.items())) from None
    try:
        object.__setattr__(o, "exchanges", Exchanges.of(o.exchanges))
    except ValueError:
        raise _error("--exchanges", f"unknown exchange lowering {o.exchanges!r}",
                     "choose " + " or ".join(f"{k} ({v})" for k, v in EXCHANGES.items())) from None
    if o.exchanges is not DEFAULT_EXCHANGES and o.comm == GLOO:
        raise _error("--exchanges", f"--exchanges {o.exchanges} with --comm gloo: a plan for gloo's "
                     "buffered sends has no exchange to order",
                     "leave out --exchanges, or compile for --comm nccl")
    _check_documents(o)
    _check_random_ltd(o)
    # pass names (compiler/pipeline.py); which are valid, the pipeline of these options says
    after = (o.print_after,) if isinstance(o.print_after, str) else tuple(o.print_after or ())
    object.__setattr__(o, "print_after", after)
    if not o.stages_auto:
        _positive("--stages", o.stages, "the number of pipeline stages, e.g. --stages 2")
    if o.microbatches != AUTO:
        _positive("--microbatches", o.microbatches, "the number of micro-batches per step, e.g. --microbatches 4")
    L = _positive("--seq-len", o.seq_len, "the training sequence length, e.g. --seq-len 128")
    B = _positive("--batch", o.batch, "the global batch size in sequences, e.g. --batch 8")
    D = _positive("--dp", o.dp, "the number of data-parallel replicas, e.g. --dp 1")
    R = _positive("--ranks", o.ranks, "the total number of ranks") if o.ranks is not None else None
    T = 1 if o.tensor_auto else _positive("--tensor", o.tensor, "the tensor-parallel ranks of each stage, "
                                          "e.g. --tensor 2, or auto with --stages auto --ranks N")
    V = _positive("--virtual-stages", o.virtual_stages, "the stages each pipeline rank holds, e.g. --virtual-stages 2")
    if o.recompute not in RECOMPUTE:
        raise _error("--recompute", f"--recompute {o.recompute!r} is not a choice",
                     "use none, full or auto (auto needs --memory-per-rank and a cost model)")
    if o.memory_per_rank is not None and not o.memory_per_rank > 0:
        raise _error("--memory-per-rank", f"--memory-per-rank must be positive, got {o.memory_per_rank}",
                     "give a memory size, e.g. 16GiB")
    costs = o.searching
    if o.stages_auto:
        if not costs:
            raise _error("--stages", "--stages auto compares pipeline depths by their predicted "
                         "step time, which needs a cost model", f"{_NEEDS_COSTS}, or give the number of stages")
        if R is None:
            raise _error("--stages", "--stages auto needs the number of ranks to split into "
                         "pipeline x data", "give --ranks N, e.g. --stages auto --ranks 4")
        if D != 1:
            raise _error("--dp", f"--dp {D} with --stages auto: the search chooses the "
                         "data-parallel degree", "leave out --dp (the search splits --ranks)")
        if V != 1:
            raise _error("--virtual-stages", f"--virtual-stages {V} with --stages auto: the search "
                         "places one stage per rank", "give --stages, or leave out --virtual-stages")
        if R % T:
            raise _error("--tensor", f"--tensor {T} does not divide --ranks {R}: the search splits the "
                         f"ranks into pipeline x data x tensor",
                         f"give --ranks a multiple of {T}, or --tensor auto")
    elif o.tensor_auto:
        raise _error("--tensor", "--tensor auto lets the plan search split --ranks into pipeline x "
                     "data x tensor", "add --stages auto --ranks N and a cost model, or give the "
                     "tensor degree, e.g. --tensor 2")
    if not o.stages_auto and stages_per_rank(o.schedule) == 2 and o.stages % 2:
        raise _error("--stages", f"schedule {o.schedule!r} runs a V: stage i and stage 2p-1-i on "
                     f"rank i, two stages on each of p ranks, so it needs an even number of "
                     f"stages, not {o.stages}",
                     f"use --stages {o.stages + 1} (on {(o.stages + 1) // 2} ranks) or "
                     f"--stages {max(2, o.stages - 1)}")
    if not o.stages_auto and stages_per_rank(o.schedule) == 2 and V != 1:
        raise _error("--virtual-stages", f"schedule {o.schedule!r} puts two stages on each rank "
                     "in a V by itself", "leave out --virtual-stages")
    if R is not None and not o.stages_auto and stages_per_rank(o.schedule) == 2 and R != (o.stages // 2) * D * T:
        raise _error("--ranks", f"--ranks {R} does not match --stages {o.stages} / 2 (two stages per "
                     f"rank) x --dp {D}{_times_tensor(T)} = {(o.stages // 2) * D * T}",
                     f"leave out --ranks, or make it pipeline ranks x dp{' x tensor' * (T > 1)}")
    if replicas(o.schedule) > 1 and V != 1:
        raise _error("--virtual-stages", f"schedule {o.schedule!r} puts one stage of each of its two "
                     "pipelines on every rank by itself", "leave out --virtual-stages")
    if replicas(o.schedule) > 1 and R is not None and not o.stages_auto and R != o.stages * D * T:
        raise _error("--ranks", f"--ranks {R} does not match --stages {o.stages} x --dp {D}{_times_tensor(T)} = "
                     f"{o.stages * D * T}: schedule {o.schedule!r} runs each stage on two ranks, one per "
                     "pipeline direction, and every rank holds one stage of each",
                     f"leave out --ranks, or make it stages x dp{' x tensor' * (T > 1)}")
    if R is not None and not o.stages_auto:
        K, DT = o.stages, D * T  # ranks of one pipeline rank: its data replicas' tensor groups
        dp = f"--dp {D}{_times_tensor(T)}"
        if V != 1 and R != K * DT:
            raise _error("--ranks", f"--ranks {R} does not match --stages {K} x {dp} = {K * DT} "
                         f"(--virtual-stages {V} puts {V} stages on each of the {K} pipeline ranks)",
                         f"leave out --ranks, or make it stages x dp{' x tensor' * (T > 1)}")
        if V == 1 and (R % DT or K % (R // DT)):
            per = "--dp" if T == 1 else "(--dp x --tensor)"
            raise _error("--ranks", f"--ranks {R} does not match --stages {K} x {dp} = {K * DT}, nor "
                         f"puts several stages on each pipeline rank (--ranks / {per} dividing the stages)",
                         f"leave out --ranks, or give {K * DT}, or p x {DT} with p dividing {K} "
                         f"(--stages {K} --ranks {(K // 2 or 1) * DT} puts 2 stages on each rank)")
    if o.chunks > 1 and costs and stages_per_rank(o.schedule) == 1:
        raise _error("--virtual-stages" if V != 1 else "--ranks",
                     f"{o.chunks} stages per pipeline rank with a cost model: the plan search "
                     "places one stage per rank",
                     "leave out --cost / --device-model and give the slices and micro-batches, "
                     "or one stage per rank")
    if o.sequence_parallel:
        if not o.tensor_auto and T == 1:
            raise _error("--sequence-parallel", "--sequence-parallel splits the tokens over the tensor ranks of "
                         "each stage, and there are none (--tensor 1)", "add --tensor T, e.g. --tensor 2")
        if not o.slices_auto and not o.tensor_auto:
            bad = next(((lo, hi) for lo, hi in o.cuts if (hi - lo) % T), None)
            if bad is not None:
                raise _error("--slices", f"slice {bad[0]}:{bad[1]} has {bad[1] - bad[0]} tokens, which the {T} "
                             "tensor ranks of --sequence-parallel cannot split evenly",
                             f"give slices whose lengths are multiples of {T}")
    if o.tensor_overlap and not o.tensor_auto and T == 1:
        raise _error("--tensor-overlap", "--tensor-overlap overlaps the tensor-parallel collectives of one "
                     "slice with the other slice's compute, and there are none (--tensor 1)",
                     "add --tensor T, e.g. --tensor 2, or leave out --tensor-overlap")
    if o.recompute == "auto" and (not costs or o.memory_per_rank is None):
        raise _error("--recompute", "--recompute auto chooses per stage what to recompute to fit "
                     "--memory-per-rank, priced by a cost model",
                     f"give --memory-per-rank SIZE and {_NEEDS_COSTS}; or --recompute none|full")
    K, D = o.pipe, o.data
    if B % D:
        raise _error(
            "--batch",
            f"a batch of {B} sequences does not split evenly over {D} data-parallel replicas",
            f"make --batch a multiple of --dp {D} (e.g. {B - B % D or D} or {B - B % D + D})",
        )
    rows = B // D
    M = o.microbatch_count
    if M is not None and M > rows:
        raise _error(
            "--microbatches",
            f"{M} micro-batches but each replica has only {rows} sequence(s) (--batch {B} / --dp {D})",
            f"use at most {rows} micro-batches, or a larger --batch",
        )
    if o.schedule_auto:
        if not costs:
            raise _error("--schedule", "--schedule auto compares schedules by their simulated "
                         "step time, which needs a cost model",
                         f"{_NEEDS_COSTS}, or name a schedule: {', '.join(sorted(SCHEDULES))}")
    elif o.schedule not in SCHEDULES:
        raise _error("--schedule", f"unknown schedule {o.schedule!r}", f"choose one of: {', '.join(sorted(SCHEDULES))}")
    check_slices(o.slices, L)
    if M is None and not (o.slices_auto and costs):
        raise _error("--microbatches", "--microbatches auto lets the optimiser's batch knapsack "
                     "choose micro-batch sizes together with their token slices",
                     f"add --slices auto and {_NEEDS_COSTS}, or give the number of micro-batches")


def _check_random_ltd(o: CompileOptions) -> None:
    """`--random-ltd` with what the executors run it with (rule H8 of the plan it makes): no
    tensor axis, no packed documents, a schedule whose backward is whole."""
    from tpc.compiler.schedules import splits_backward

    if o.random_ltd is None:
        return
    if o.tensor != 1:
        raise _error("--random-ltd", f"--random-ltd with --tensor {o.tensor}: random-LTD does not run on a "
                     "mesh with a tensor axis", "leave out --tensor, or --random-ltd")
    if o.documents is not None:
        raise _error("--random-ltd", "--random-ltd with --documents: a dropped unit's kept tokens would need "
                     "their documents' boundaries gathered too (not built)", "leave out one of them")
    if o.schedule != AUTO and splits_backward(o.schedule):
        raise _error("--schedule", f"--random-ltd with schedule {o.schedule!r}, which splits each backward in "
                     "two: a split backward runs a stage's traced programs, and dropped units run eagerly",
                     "choose a schedule whose backward is whole (seq1f1b, terapipe, 1f1b, gpipe, ...)")


# the default of every field that has one: what a flag left out means
DEFAULTS = {f.name: f.default for f in dataclasses.fields(CompileOptions)
            if f.default is not dataclasses.MISSING}


# -------------------------------------------------------------------- the command line's spelling


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


def parse_tensor(spec) -> int | str:
    """`--tensor`: the tensor-parallel degree, or 'auto' (the plan search picks it)."""
    return _count("--tensor", spec, "give the tensor-parallel ranks of each stage, e.g. --tensor 2, or auto")


def parse_microbatches(spec) -> int | str:
    """`--microbatches`: a count, or 'auto' (the optimiser's batch knapsack chooses)."""
    return _count("--microbatches", spec,
                  "give the number of micro-batches per step, e.g. --microbatches 4, or auto")


def parse_slices(spec, seq_len: int) -> int | tuple[int, ...] | str:
    """`--slices`: 'N' (a count of equal slices), 'l1,l2,...' (lengths) or 'auto'. The values
    are checked against `seq_len` by CompileOptions; here only the spelling. From Python the
    lengths may be a tuple or list of numbers (the library's `tpc.compile(..., slices=(24, 40))`)."""
    if isinstance(spec, (tuple, list)):
        spec = ",".join(str(v) for v in spec)
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


def _check_documents(o: CompileOptions) -> None:
    """--documents and --document-length: a separator id >= 0, a mean length within the row, no
    tensor axis (a tensor rank would hold part of each row's documents)."""
    if o.documents is None:
        if o.document_length is not None:
            raise _error("--document-length", "--document-length without --documents: the rows are one text each",
                         "add --documents eos:ID (the corpus's separator id), or leave out --document-length")
        return
    if isinstance(o.documents, bool) or not isinstance(o.documents, int) or o.documents < 0:
        raise _error("--documents", f"--documents: the separator id {o.documents!r} is not a token id",
                     "give the corpus's end-of-document token, e.g. --documents eos:50256")
    if o.document_length is not None and not (isinstance(o.document_length, int) and
                                              1 <= o.document_length <= o.seq_len):
        raise _error("--document-length", f"--document-length {o.document_length!r}: a mean document length "
                     f"is between 1 and the row's {o.seq_len} tokens",
                     "give the corpus's mean document length in tokens, or its token file to measure it in "
                     "(--document-length FILE); a corpus whose documents are longer than a row needs a longer "
                     "--seq-len, or its documents cut (examples/prepare_corpus.py --max-document)")
    if o.tensor != 1:
        raise _error("--documents", f"--documents with --tensor {o.tensor}: packed documents are not "
                     "supported on a tensor axis", "leave out --tensor, or --documents")


def parse_documents(spec) -> int | None:
    """`--documents eos:ID` -> ID (None stays None)."""
    if spec is None or (isinstance(spec, int) and not isinstance(spec, bool)):
        return spec
    text = str(spec).strip()
    kind, _, value = text.partition(":")
    if kind.strip().lower() != "eos" or not value.strip().lstrip("-").isdigit():
        raise _error("--documents", f"--documents {text!r} is not `eos:ID`",
                     "name the corpus's end-of-document token id, e.g. --documents eos:50256")
    return int(value)


def check_options(**given) -> CompileOptions:
    """The compile options `given`, as the command line spells them (strings: "auto", "5,11",
    "16GiB") or as values, read and checked; every option not given keeps its default
    (`DEFAULTS`). Nothing here needs the model: every mistake is reported before tracing."""
    unknown = sorted(set(given) - {f.name for f in dataclasses.fields(CompileOptions)})
    if unknown:
        raise TypeError(f"check_options: unknown option(s) {', '.join(unknown)}")
    o = dict(given)
    if "stages" in o:
        o["stages"] = parse_stages(o["stages"])
    if "microbatches" in o:
        o["microbatches"] = parse_microbatches(o["microbatches"])
    if "tensor" in o:
        o["tensor"] = parse_tensor(o["tensor"])
    seq_len = o.get("seq_len")
    if "slices" in o and isinstance(seq_len, int) and seq_len >= 1:
        o["slices"] = parse_slices(o["slices"], seq_len)
    if "schedule" in o:
        schedule = str(o["schedule"]).strip()
        o["schedule"] = AUTO if schedule.lower() == AUTO else schedule
    memory = o.get("memory_per_rank")
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, (int, float))):
        o["memory_per_rank"] = parse_memory(memory)
    if "recompute" in o:
        o["recompute"] = str(o["recompute"]).strip().lower()
    if "print_after" in o:
        o["print_after"] = tuple(o["print_after"] or ())
    if isinstance(o.get("exchanges"), str):
        o["exchanges"] = o["exchanges"].strip().lower()
    if "documents" in o:
        o["documents"] = parse_documents(o["documents"])
    return CompileOptions(**o)
