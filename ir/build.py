"""The plan builder: a lark Transformer that builds the frozen dataclasses of `ir/nodes.py`
while lark parses (it runs at each reduction, so no parse tree is made), attaches comments to
the lines they belong to, and checks what the grammar leaves open (header lines in order and
none missing, rank sections numbered 0, 1, 2, ... in order)."""

from __future__ import annotations

from dataclasses import dataclass

from lark import Token, Transformer

from tpc.ir.diagnostics import Diagnostic
from tpc.ir.nodes import (
    FORMAT_VERSION,
    EvalProgram,
    Bundle,
    BundleLine,
    BundleMember,
    FORMAT_VERSIONS,
    DocumentsLine,
    Header,
    Instr,
    Line,
    Loc,
    MeshLine,
    Microbatch,
    ModelLine,
    Op,
    Payload,
    Plan,
    RandomLTDLine,
    RankProgram,
    ScheduleLine,
    ShapeLine,
    Stage,
    Tie,
    UnitsLine,
)
from tpc.ir.syntax import (
    BUNDLE_ORDER,
    BUNDLE_ORDER_HINT,
    BUNDLE_REPEATED,
    HEADER_ORDER,
    OPTIONAL,
    ORDER_HINT,
    REPEATED,
    SYNTAX,
)


def _comment_text(tok: Token) -> str:
    """'# foo' -> 'foo', '#foo' -> 'foo'; trailing blanks are not part of a comment."""
    body = tok.value[1:]
    if body.startswith(" "):
        body = body[1:]
    return body.rstrip()


class Located(Exception):
    """A value error found while building: carries finished diagnostics to `parse`."""

    def __init__(self, diagnostics: list[Diagnostic]):
        super().__init__(diagnostics[0].message)
        self.diagnostics = diagnostics


def _fail(message: str, loc: Loc, hint: str) -> None:
    raise Located([Diagnostic(message, loc, hint)])


# ------------------------------------------------------------------------------ the builder


def _line(method):
    """A builder method: after the first value error the rest of the text is only checked for
    syntax (the error is kept for `parse`), so a method never sees a child that failed."""

    def build(self, children):
        if self.error is not None:
            return None
        try:
            return method(self, children)
        except Located as e:
            self.error = e
            return None

    build.__name__ = method.__name__
    return build


class PlanBuilder(Transformer):
    """Builds the plan while lark parses. Every line rule of the grammar is a `!` rule, so its
    first child is its first token, whose line and column are the line's location. Lines are
    built in document order, so comments attach by a moving cursor."""

    def __init__(self):
        super().__init__()
        self.begin("")

    def begin(self, file: str) -> None:
        self.file = file
        self.comments: list[tuple[int, str]] = []  # (line, text), in document order
        self.next_comment = 0
        self.error: Located | None = None

    def collect_comment(self, token: Token) -> Token:
        """Lexer callback: the grammar ignores comments; they are kept here, by line."""
        self.comments.append((token.line, _comment_text(token)))
        return token

    # -- helpers

    def _tok_loc(self, tok: Token) -> Loc:
        return Loc(self.file, tok.line, tok.column)

    def _trivia(self, first: Token) -> dict:
        """Location, full-line comments above this line, and the comment at its end."""
        loc = Loc(self.file, first.line, first.column)
        if self.next_comment == len(self.comments):  # (most lines have no comment)
            return dict(loc=loc)
        line = first.line
        above: list[str] = []
        note = None
        while self.next_comment < len(self.comments):
            at, text = self.comments[self.next_comment]
            if at < line:
                above.append(text)
            elif at == line:
                note = text
            else:
                break
            self.next_comment += 1
        return dict(loc=loc, comments=tuple(above), note=note)

    def _nat(self, tok: Token, what: str) -> int:
        value = int(tok)
        if value < 0:
            _fail(f"{what} must be >= 0, got {value}", self._tok_loc(tok),
                  "indices and sizes in a plan are non-negative; indices count from 0")
        return value

    def _str(self, tok: Token) -> str:
        return _unquote(tok, self._tok_loc(tok))

    def _make(self, cls, word: str, trivia: dict, **fields):
        """Build a line; the dataclass's own checks become located diagnostics."""
        try:
            return cls(**fields, **trivia)
        except ValueError as e:
            _fail(str(e), trivia["loc"], f"a {word!r} line reads: {SYNTAX[word]}")

    # -- header

    @_line
    def version_line(self, children):
        first, tok = children
        trivia = self._trivia(first)
        version = int(tok)
        if version not in FORMAT_VERSIONS:
            _fail(f"unsupported format version {version}", self._tok_loc(tok),
                  f"this tpc reads format versions {_versions()}: write `tpir {FORMAT_VERSION}`")
        return _Version(version, trivia)

    @_line
    def model_line(self, children):
        first, path, _, sha, _, factory = children
        return self._make(ModelLine, "model", self._trivia(first), path=self._str(path),
                          sha256=self._str(sha), factory=self._str(factory))

    @_line
    def shape_line(self, children):
        first, _, batch, _, seq, _, vocab, _, dtype = children
        return self._make(ShapeLine, "shape", self._trivia(first), batch=int(batch),
                          seq=int(seq), vocab=int(vocab), dtype=str(dtype))

    @_line
    def documents_line(self, children):
        first, _, eos, _, mean = children
        return self._make(DocumentsLine, "documents", self._trivia(first), eos=self._nat(eos, "eos"),
                          mean=self._nat(mean, "mean"))

    @_line
    def mesh_line(self, children):
        first, _, pipe, _, data, *rest = children
        tensor = int(rest[1]) if rest else 1
        sequence = len(rest) > 2 and str(rest[2]) == "sequence-parallel"
        return self._make(MeshLine, "mesh", self._trivia(first), pipe=int(pipe), data=int(data), tensor=tensor,
                          sequence=sequence)

    @_line
    def schedule_line(self, children):
        first, name = children
        return self._make(ScheduleLine, "schedule", self._trivia(first), name=self._str(name))

    @_line
    def units_line(self, children):
        first, count = children
        return self._make(UnitsLine, "units", self._trivia(first),
                          count=self._nat(count, "units"))

    @_line
    def range(self, children):
        lo, hi = children
        return (self._nat(lo, "a range bound"), self._nat(hi, "a range bound"))

    @_line
    def random_ltd_line(self, children):
        first, _, *units, _, lo, _, hi, _, steps, _, per = children
        return self._make(RandomLTDLine, "random-ltd", self._trivia(first),
                          units=tuple(self._nat(u, "a random-ltd unit") for u in units), min_value=int(lo),
                          max_value=int(hi), require_steps=int(steps), seq_per_step=int(per))

    @_line
    def stage_line(self, children):
        first, index, _, *ranks, units, label = children
        ranks = [self._nat(r, "rank") for r in ranks[:-1]]  # the last is the `units` keyword
        trivia = self._trivia(first)
        return self._make(Stage, "stage", trivia, index=self._nat(index, "stage"),
                          rank=ranks[0], replicas=tuple(ranks[1:]), units=units,
                          label="" if label is None else self._str(label))

    @_line
    def tie_line(self, children):
        first, name, _, *stages = children
        trivia = self._trivia(first)
        return self._make(Tie, "tie", trivia, name=self._str(name),
                          stages=tuple(self._nat(s, "stage") for s in stages))

    @_line
    def microbatch_line(self, children):
        first, index, _, size, _, *slices = children
        replica = 0
        if slices and isinstance(slices[-1], Token):  # `replica K` (format version 3)
            replica = self._nat(slices[-1], "replica")
            slices = slices[:-2]
        trivia = self._trivia(first)
        return self._make(Microbatch, "microbatch", trivia,
                          index=self._nat(index, "microbatch"), size=self._nat(size, "size"),
                          slices=tuple(slices), replica=replica)

    @_line
    def bundle_line(self, children):
        first, = children
        return self._make(BundleLine, "bundle", self._trivia(first))

    @_line
    def member_line(self, children):
        first, path, _, seq, _, batch = children
        trivia = self._trivia(first)
        return self._make(BundleMember, "plan", trivia, path=self._str(path),
                          seq=self._nat(seq, "seq"), batch=self._nat(batch, "batch"))

    # -- instructions

    @_line
    def rank_line(self, children):
        first, rank, _ = children
        trivia = self._trivia(first)
        return (self._nat(rank, "rank"), trivia)

    @_line
    def rank_section(self, children):
        (rank, trivia), *instrs = children
        return RankProgram(rank=rank, instrs=tuple(instrs), **trivia)

    def _instr(self, op: Op, first: Token, operands: dict[str, Token], **extra) -> Instr:
        trivia = self._trivia(first)
        fields = {name: int(tok) for name, tok in operands.items()}
        if fields and min(fields.values()) < 0:
            for name, tok in operands.items():
                self._nat(tok, name)  # fails at the first negative operand
        try:
            return Instr(op, **fields, **extra, **trivia)
        except ValueError as e:
            _fail(str(e), trivia["loc"], f"a {op.value!r} line reads: {SYNTAX[op.value]}")

    # Each instruction's children are all its tokens, its line end last.

    @_line
    def load(self, children):
        first, _, mb, _ = children
        return self._instr(Op.LOAD, first, {"mb": mb})

    def _slice_op(op: Op):
        @_line
        def build(self, children):
            first, _, stage, _, mb, _, slice_, _ = children
            return self._instr(op, first, {"stage": stage, "mb": mb, "slice": slice_})
        return build

    recompute = _slice_op(Op.RECOMPUTE)
    backward = _slice_op(Op.BACKWARD)
    backward_input = _slice_op(Op.BACKWARD_INPUT)
    backward_weight = _slice_op(Op.BACKWARD_WEIGHT)
    del _slice_op

    @_line
    def forward(self, children):
        first, _, stage, _, mb, _, slice_, checkpoint, _ = children
        return self._instr(Op.FORWARD, first, {"stage": stage, "mb": mb, "slice": slice_},
                           checkpoint=checkpoint is not None)

    def _p2p(op: Op):
        @_line
        def build(self, children):
            first, payload, _, stage, _, mb, _, slice_, _, peer, _ = children
            return self._instr(op, first,
                               {"stage": stage, "mb": mb, "slice": slice_, "peer": peer},
                               payload=_PAYLOADS[payload])
        return build

    send = _p2p(Op.SEND)
    recv = _p2p(Op.RECV)
    del _p2p

    @_line
    def free_kv(self, children):
        first, _, stage, _, mb, _ = children
        return self._instr(Op.FREE_KV, first, {"stage": stage, "mb": mb})

    @_line
    def allreduce(self, children):
        first, _, stage, _ = children
        return self._instr(Op.ALLREDUCE, first, {"stage": stage})

    @_line
    def reduce_tied(self, children):
        first, name, _ = children
        return self._instr(Op.REDUCE_TIED, first, {}, tie=self._str(name))

    @_line
    def step(self, children):
        first, _ = children
        return self._instr(Op.STEP, first, {})

    @_line
    def exchange(self, children):
        first, count, _ = children
        return self._instr(Op.EXCHANGE, first, {"count": count})

    @_line
    def reduce_loss(self, children):
        first, _ = children
        return self._instr(Op.REDUCE_LOSS, first, {})

    @_line
    def reduce_replicas(self, children):
        first, _, stage, _ = children
        return self._instr(Op.REDUCE_REPLICAS, first, {"stage": stage})

    # -- the evaluation program

    @_line
    def eval_line(self, children):
        return self._trivia(children[0])

    @_line
    def eval_program(self, children):
        trivia, *rest = children
        microbatches = tuple(c for c in rest if isinstance(c, Microbatch))
        ranks = [c for c in rest if isinstance(c, RankProgram)]
        diagnostics = _check_rank_order(ranks)
        if not microbatches:
            diagnostics.append(Diagnostic(
                "the evaluation program has no micro-batches", trivia["loc"],
                f"add `{SYNTAX['microbatch']}` lines below `eval`, before its rank sections"))
        if diagnostics:
            raise Located(diagnostics)
        return EvalProgram(microbatches=microbatches, ranks=tuple(ranks), **trivia)

    # -- the file

    @_line
    def start(self, children):
        version, *rest = children
        evaluation = next((c for c in rest if isinstance(c, EvalProgram)), None)
        rest = [c for c in rest if not isinstance(c, EvalProgram)]
        lines = [c for c in rest if not isinstance(c, RankProgram)]
        ranks = [c for c in rest if isinstance(c, RankProgram)]
        if any(isinstance(l, BundleLine) for l in lines):
            return self._bundle(version, lines, ranks)
        foreign = [l for l in lines if _KIND[type(l)] not in HEADER_ORDER]
        if foreign:
            raise Located([Diagnostic(
                f"a {_KIND[type(l)]!r} line belongs to a plan bundle's index, not to a plan", l.loc,
                "an index starts `tpir 2` then `bundle`; " + BUNDLE_ORDER_HINT) for l in foreign])
        diagnostics = _check_header_order(lines, version, ranks, self.file)
        diagnostics += _check_rank_order(ranks)
        if diagnostics:
            raise Located(diagnostics)
        by_kind = {kind: [l for l in lines if _KIND[type(l)] == kind] for kind in HEADER_ORDER}
        header = Header(
            model=by_kind["model"][0],
            shape=by_kind["shape"][0],
            mesh=by_kind["mesh"][0],
            schedule=by_kind["schedule"][0],
            units=by_kind["units"][0],
            stages=tuple(by_kind["stage"]),
            microbatches=tuple(by_kind["microbatch"]),
            ties=tuple(by_kind["tie"]),
            documents=by_kind["documents"][0] if by_kind["documents"] else None,
            random_ltd=by_kind["random-ltd"][0] if by_kind["random-ltd"] else None,
            version=version.number,
            version_comments=version.trivia.get("comments", ()),
            version_note=version.trivia.get("note"),
            version_loc=version.trivia["loc"],
        )
        trailing = tuple(text for _, text in self.comments[self.next_comment:])
        return Plan(header=header, ranks=tuple(ranks), trailing_comments=trailing,
                    source=self.file, eval=evaluation)


    def _bundle(self, version: "_Version", lines: list[Line], ranks: list[RankProgram]) -> Bundle:
        """A plan bundle's index: the bundle lines in BUNDLE_ORDER, no plan-only lines, no ranks."""
        diagnostics = [Diagnostic(f"a plan bundle's index has no {_KIND[type(l)]!r} line", l.loc,
                                  f"each plan of the bundle says its own; {BUNDLE_ORDER_HINT}")
                       for l in lines if _KIND[type(l)] not in BUNDLE_ORDER]
        diagnostics += [Diagnostic("a plan bundle's index has no rank sections", r.loc,
                                   "the instructions are in the plans it lists (`plan \"PATH\" seq L "
                                   "batch B` lines); delete this section") for r in ranks]
        kept = [l for l in lines if _KIND[type(l)] in BUNDLE_ORDER]
        diagnostics += _check_header_order(kept, version, [], self.file, order=BUNDLE_ORDER,
                                           repeated=BUNDLE_REPEATED, optional=frozenset({"tie"}),
                                           hint=BUNDLE_ORDER_HINT)
        if diagnostics:
            diagnostics.sort(key=lambda d: (d.loc.line, d.loc.col))
            raise Located(diagnostics)
        by_kind = {kind: [l for l in kept if _KIND[type(l)] == kind] for kind in BUNDLE_ORDER}
        trailing = tuple(text for _, text in self.comments[self.next_comment:])
        return Bundle(
            bundle=by_kind["bundle"][0], model=by_kind["model"][0], mesh=by_kind["mesh"][0],
            units=by_kind["units"][0], stages=tuple(by_kind["stage"]), ties=tuple(by_kind["tie"]),
            members=tuple(by_kind["plan"]), version=version.number,
            version_comments=version.trivia.get("comments", ()), version_note=version.trivia.get("note"),
            version_loc=version.trivia["loc"], trailing_comments=trailing, source=self.file)


_PAYLOADS = {p.value: p for p in Payload}


@dataclass(frozen=True)
class _Version:
    number: int
    trivia: dict


_KIND: dict[type, str] = {
    ModelLine: "model", ShapeLine: "shape", DocumentsLine: "documents", MeshLine: "mesh", ScheduleLine: "schedule",
    UnitsLine: "units", RandomLTDLine: "random-ltd", Stage: "stage", Tie: "tie", Microbatch: "microbatch",
    BundleLine: "bundle", BundleMember: "plan",
}


def _check_header_order(lines: list[Line], version: _Version, ranks: list[RankProgram],
                        file: str, *, order=HEADER_ORDER, repeated=REPEATED, optional=OPTIONAL,
                        hint=ORDER_HINT) -> list[Diagnostic]:
    """Each header line once (stage/tie/microbatch: in a group), in HEADER_ORDER, none missing
    (a bundle's index: its own order, the same rules)."""
    HEADER_ORDER, REPEATED, OPTIONAL, ORDER_HINT = order, repeated, optional, hint
    out: list[Diagnostic] = []
    first_at: dict[str, Line] = {}
    last_rank = -1
    last_line: Line | None = None
    for line in lines:
        kind = _KIND[type(line)]
        rank = HEADER_ORDER.index(kind)
        if kind in first_at and kind not in REPEATED:
            out.append(Diagnostic(
                f"a second {kind!r} line (the first is at line {first_at[kind].loc.line})",
                line.loc, f"a plan has one {kind!r} line; delete one of them"))
            continue
        if rank < last_rank:
            prev = _KIND[type(last_line)]
            out.append(Diagnostic(
                f"{kind!r} line out of order: it comes after a {prev!r} line "
                f"(line {last_line.loc.line})",
                line.loc, f"{ORDER_HINT}; move this line above line {last_line.loc.line}"))
            continue
        first_at.setdefault(kind, line)
        last_rank, last_line = rank, line
    for kind in HEADER_ORDER:
        if kind in first_at or kind in OPTIONAL:
            continue
        later = [l for l in lines if HEADER_ORDER.index(_KIND[type(l)]) > HEADER_ORDER.index(kind)]
        if later:
            where = min((l.loc for l in later), key=lambda loc: loc.line)
        elif ranks:
            where = ranks[0].loc
        else:
            where = version.trivia["loc"]
        out.append(Diagnostic(
            f"the header has no {kind!r} line", where,
            f"add `{SYNTAX[kind]}` here ({ORDER_HINT})"))
    out.sort(key=lambda d: (d.loc.line, d.loc.col))
    return out


def _check_rank_order(ranks: list[RankProgram]) -> list[Diagnostic]:
    """Rank sections are numbered 0, 1, 2, ... in order, one per pipeline rank."""
    out: list[Diagnostic] = []
    seen: dict[int, RankProgram] = {}
    for position, section in enumerate(ranks):
        if section.rank in seen:
            out.append(Diagnostic(
                f"a second 'rank {section.rank}' section (the first is at line "
                f"{seen[section.rank].loc.line})",
                section.loc, "each pipeline rank has one section; merge the two"))
        elif section.rank != position:
            out.append(Diagnostic(
                f"rank sections out of order: expected 'rank {position}' here, "
                f"found 'rank {section.rank}'",
                section.loc, "rank sections are numbered 0, 1, 2, ... in order, one per "
                             "pipeline rank"))
        seen.setdefault(section.rank, section)
    return out


_ESCAPES = {"\\": "\\", '"': '"', "n": "\n", "t": "\t", "r": "\r"}


def _unquote(tok: Token, loc: Loc) -> str:
    body = tok.value[1:-1]
    out: list[str] = []
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == "\\":
            nxt = body[i + 1]  # the grammar guarantees a character after a backslash
            if nxt not in _ESCAPES:
                _fail(f"unknown escape '\\{nxt}' in a string",
                      Loc(loc.file, loc.line, loc.col + 1 + i),
                      'inside quotes write \\" for a quote and \\\\ for a backslash '
                      "(\\n, \\t, \\r also work)")
            out.append(_ESCAPES[nxt])
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _versions() -> str:
    """The readable format versions in words: "1 and 2", "1, 2 and 3"."""
    vs = [str(v) for v in sorted(FORMAT_VERSIONS)]
    return vs[0] if len(vs) == 1 else ", ".join(vs[:-1]) + " and " + vs[-1]
