"""Text to plan: `parse(text, file) -> Plan`.

The one grammar (`grammar/tpir.lark`) is parsed by one LALR parser built once per process; one
Transformer builds the frozen dataclasses of `ir/nodes.py` while lark parses (lark calls it at
each reduction, so no parse tree is made; a line's location is that of its first token).
Comments are ignored by the grammar and collected through a lexer callback; the Transformer
attaches them by line while it builds the lines in document order (a full-line comment belongs to
the next line, an end-of-line comment to its own line, comments after the last line to the plan).
The lexer is lark's contextual lexer with a faster loop (see `_Lexer`).

Whatever the input, `parse` raises nothing but `TpirError`: lark's syntax errors, the value
checks of the dataclasses, and the rules the grammar leaves to this module (header lines in
order and none missing, rank sections numbered 0, 1, 2, ... in order, format version 1) all
become located diagnostics with a hint.
"""

from __future__ import annotations

import difflib
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

from lark import Lark, Token, Transformer
from lark.common import LexerConf
from lark.lexer import ContextualLexer, Lexer, LexerState
from lark.exceptions import LarkError, UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from tpc.grammar import grammar_text
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import (
    FORMAT_VERSION,
    OPERANDS,
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
    RankProgram,
    ScheduleLine,
    ShapeLine,
    Stage,
    Tie,
    UnitsLine,
)

# --------------------------------------------------------------------------- syntax reference

_OPERAND_SYNTAX = {"stage": "stage S", "mb": "mb M", "slice": "slice I", "payload": "act|grad",
                   "tie": '"NAME"'}


def _instr_syntax(op: Op) -> str:
    parts = [op.value]
    for name in OPERANDS[op]:
        if name == "peer":
            parts.append("to R" if op is Op.SEND else "from R")
        else:
            parts.append(_OPERAND_SYNTAX[name])
    if op is Op.FORWARD:
        parts.append("[checkpoint]")
    return " ".join(parts)


# The header lines in the order a plan writes them; the last three may repeat.
HEADER_ORDER: tuple[str, ...] = (
    "model", "shape", "mesh", "schedule", "units", "stage", "tie", "microbatch",
)
_REPEATED = frozenset({"stage", "tie", "microbatch"})
_OPTIONAL = frozenset({"tie"})

# How each line is written, by its first word: shown in hints.
SYNTAX: dict[str, str] = {
    "tpir": f"tpir {FORMAT_VERSION}",
    "model": 'model "PATH" sha256 "HEX" factory "NAME"',
    "shape": "shape batch B seq L vocab V dtype D",
    "mesh": "mesh pipe P data D",
    "schedule": 'schedule "NAME"',
    "units": "units N",
    "stage": 'stage S rank R units LO:HI "LABEL"',
    "tie": 'tie "NAME" stages S T ...',
    "microbatch": "microbatch M size N slices A:B ...",
    "rank": "rank R",
    **{op.value: _instr_syntax(op) for op in Op},
}

_INSTR_WORDS = tuple(op.value for op in Op)
_HEADER_WORDS = HEADER_ORDER

# ------------------------------------------------------------------------------ the parser

# One parser per process, built on first use. The plan is built while lark parses (the builder is
# lark's in-parser transformer, so no parse tree is made); the builder holds the state of the
# parse in progress, so parses take turns.
_TURN = threading.Lock()


@lru_cache(maxsize=1)
def _lark() -> Lark:
    return Lark(
        grammar_text(),
        parser="lalr",
        strict=True,
        maybe_placeholders=True,
        cache=True,  # the tables, in the temp dir, keyed by grammar, options and lark version
        lexer=_Lexer,
        transformer=_BUILD,
        lexer_callbacks={"COMMENT": _BUILD.collect_comment},
    )


def parse(text: str, file: str = "<string>") -> Plan:
    """Parse the text of a .tpir file. Raises `TpirError` (and nothing else) on bad input."""
    source = text
    if not text.endswith("\n"):
        text += "\n"  # every line ends with a newline; positions are unchanged
    with _TURN:
        parser = _lark()
        _BUILD.begin(file)
        try:
            plan = parser.parse(text)
            # a value error is reported only when the whole text is well-formed, so that a
            # syntax error anywhere is the one reported, wherever the value error is
            if _BUILD.error is not None:
                raise _BUILD.error
            return plan
        except UnexpectedInput as e:
            raise TpirError(_syntax_diagnostic(e, text, file), source=source) from None
        except _Located as e:
            raise TpirError(e.diagnostics, source=source) from None
        except LarkError as e:  # any other lark error is still the input's fault
            raise TpirError(Diagnostic(f"cannot read the plan: {e}", Loc(file, 1, 1),
                                       hint="see docs/ir.md for the format"),
                            source=source) from None
        finally:
            _BUILD.begin("")


class _Lexer(Lexer):
    """lark's contextual lexer (one BasicLexer per parser state, built by lark from the same
    grammar), driven by a tighter loop: one regular expression per state that also takes the
    blanks before a token, and positions counted here rather than by a LineCounter per token.
    The tokens are the ones lark's own loop makes. Where this loop finds no token it hands the
    rest of the text to lark's loop, so that errors are lark's own, raised at the same place."""

    __future_interface__ = 2  # lex(lexer_state, parser_state), as lark's own lexers

    def __init__(self, conf: LexerConf):
        self.conf = conf
        self.contextual: ContextualLexer | None = None
        self.by_state: dict[int, tuple] = {}

    def _build(self, parse_table) -> ContextualLexer:
        # as lark builds its contextual lexer for an LALR parser
        states = {index: list(actions) for index, actions in parse_table.states.items()}
        return ContextualLexer(self.conf, states)

    def _for_state(self, state: int) -> tuple:
        lexer = self.contextual.lexers[state]
        scanner = lexer.scanner  # (also makes lexer.callback)
        blanks = [t for t in scanner.terminals
                  if t.name in lexer.ignore_types and t.name not in lexer.callback]
        prefix = "".join(f"(?:{t.pattern.to_regexp()})?" for t in blanks)
        # the alternation lark's scanner matches, after optional blanks
        alternation = "|".join(f"(?P<{t.name}>{t.pattern.to_regexp()})" for t in scanner.terminals)
        entry = (re.compile(prefix + "(?:" + alternation + ")", lexer.g_regex_flags).match,
                 lexer.callback, lexer.newline_types, lexer.ignore_types)
        self.by_state[state] = entry
        return entry

    def lex(self, lexer_state: LexerState, parser_state) -> Iterator[Token]:
        if self.contextual is None:
            self.contextual = self._build(parser_state.parse_conf.parse_table)
        by_state = self.by_state
        states = parser_state.state_stack  # the last is the parser's state (its `position`)
        text = lexer_state.text.text
        end = lexer_state.text.end
        counter = lexer_state.line_ctr
        pos, line, line_start = counter.char_pos, counter.line, counter.line_start_pos
        last = lexer_state.last_token
        new_str = str.__new__
        while pos < end:
            state = states[-1]
            entry = by_state.get(state) or self._for_state(state)
            m = entry[0](text, pos, end)
            if m is None:
                break  # lark's loop raises the error
            type_ = m.lastgroup
            start = m.start(type_)
            pos = m.end()
            value = text[start:pos]
            # a Token with every field set, as lark's lexer makes it (without its constructor's
            # two Python calls: most of a plan's parse is making tokens)
            tok = new_str(Token, value)
            tok.type = type_
            tok.value = value
            tok.start_pos = start
            tok.line = line
            tok.column = start - line_start + 1
            tok.end_pos = pos
            if type_ in entry[2] and "\n" in value:  # a token that may hold line ends does
                line += value.count("\n")
                line_start = start + value.rindex("\n") + 1
            tok.end_line = line
            tok.end_column = pos - line_start + 1
            if type_ in entry[1]:
                tok = entry[1][type_](tok)
            if type_ not in entry[3]:
                last = tok
                yield tok
        counter.char_pos, counter.line, counter.line_start_pos = pos, line, line_start
        counter.column = pos - line_start + 1
        lexer_state.last_token = last
        if pos < end:
            yield from self.contextual.lex(lexer_state, parser_state)


def _comment_text(tok: Token) -> str:
    """'# foo' -> 'foo', '#foo' -> 'foo'; trailing blanks are not part of a comment."""
    body = tok.value[1:]
    if body.startswith(" "):
        body = body[1:]
    return body.rstrip()


class _Located(Exception):
    """A value error found while building: carries finished diagnostics to `parse`."""

    def __init__(self, diagnostics: list[Diagnostic]):
        super().__init__(diagnostics[0].message)
        self.diagnostics = diagnostics


def _fail(message: str, loc: Loc, hint: str) -> None:
    raise _Located([Diagnostic(message, loc, hint)])


# ------------------------------------------------------------------------------ the builder


def _line(method):
    """A builder method: after the first value error the rest of the text is only checked for
    syntax (the error is kept for `parse`), so a method never sees a child that failed."""

    def build(self, children):
        if self.error is not None:
            return None
        try:
            return method(self, children)
        except _Located as e:
            self.error = e
            return None

    build.__name__ = method.__name__
    return build


class _Build(Transformer):
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
        self.error: _Located | None = None

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
        if version != FORMAT_VERSION:
            _fail(f"unsupported format version {version}", self._tok_loc(tok),
                  f"this tpc reads format version {FORMAT_VERSION}: write `tpir {FORMAT_VERSION}`")
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
    def mesh_line(self, children):
        first, _, pipe, _, data = children
        return self._make(MeshLine, "mesh", self._trivia(first), pipe=int(pipe), data=int(data))

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
    def stage_line(self, children):
        first, index, _, rank, _, units, label = children
        trivia = self._trivia(first)
        return self._make(Stage, "stage", trivia, index=self._nat(index, "stage"),
                          rank=self._nat(rank, "rank"), units=units,
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
        trivia = self._trivia(first)
        return self._make(Microbatch, "microbatch", trivia,
                          index=self._nat(index, "microbatch"), size=self._nat(size, "size"),
                          slices=tuple(slices))

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

    # -- the file

    @_line
    def start(self, children):
        version, *rest = children
        lines = [c for c in rest if not isinstance(c, RankProgram)]
        ranks = [c for c in rest if isinstance(c, RankProgram)]
        diagnostics = _check_header_order(lines, version, ranks, self.file)
        diagnostics += _check_rank_order(ranks)
        if diagnostics:
            raise _Located(diagnostics)
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
            version=version.number,
            version_comments=version.trivia.get("comments", ()),
            version_note=version.trivia.get("note"),
            version_loc=version.trivia["loc"],
        )
        trailing = tuple(text for _, text in self.comments[self.next_comment:])
        return Plan(header=header, ranks=tuple(ranks), trailing_comments=trailing,
                    source=self.file)


_PAYLOADS = {p.value: p for p in Payload}
_BUILD = _Build()


@dataclass(frozen=True)
class _Version:
    number: int
    trivia: dict


_KIND: dict[type, str] = {
    ModelLine: "model", ShapeLine: "shape", MeshLine: "mesh", ScheduleLine: "schedule",
    UnitsLine: "units", Stage: "stage", Tie: "tie", Microbatch: "microbatch",
}

_ORDER_HINT = ("header lines come in this order: tpir, model, shape, mesh, schedule, units, "
               "stage lines, tie lines, microbatch lines")


def _check_header_order(lines: list[Line], version: _Version, ranks: list[RankProgram],
                        file: str) -> list[Diagnostic]:
    """Each header line once (stage/tie/microbatch: in a group), in HEADER_ORDER, none missing."""
    out: list[Diagnostic] = []
    first_at: dict[str, Line] = {}
    last_rank = -1
    last_line: Line | None = None
    for line in lines:
        kind = _KIND[type(line)]
        rank = HEADER_ORDER.index(kind)
        if kind in first_at and kind not in _REPEATED:
            out.append(Diagnostic(
                f"a second {kind!r} line (the first is at line {first_at[kind].loc.line})",
                line.loc, f"a plan has one {kind!r} line; delete one of them"))
            continue
        if rank < last_rank:
            prev = _KIND[type(last_line)]
            out.append(Diagnostic(
                f"{kind!r} line out of order: it comes after a {prev!r} line "
                f"(line {last_line.loc.line})",
                line.loc, f"{_ORDER_HINT}; move this line above line {last_line.loc.line}"))
            continue
        first_at.setdefault(kind, line)
        last_rank, last_line = rank, line
    for kind in HEADER_ORDER:
        if kind in first_at or kind in _OPTIONAL:
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
            f"add `{SYNTAX[kind]}` here ({_ORDER_HINT})"))
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


# --------------------------------------------------------------------------- syntax errors

# What a terminal is called in a message.
_TERMINAL_WORDS = {
    "INT": "a number",
    "STRING": "a quoted string",
    "NAME": "a name (e.g. float32)",
    "PAYLOAD": "'act' or 'grad'",
    "_NL": "the end of the line",
    "$END": "the end of the file",
}

_WORD = re.compile(r"[A-Za-z0-9_.\-]")


def _terminal_word(name: str) -> str:
    if name in _TERMINAL_WORDS:
        return _TERMINAL_WORDS[name]
    try:
        pattern = _lark().get_terminal(name).pattern
    except KeyError:
        return name
    if pattern.type == "str":
        return repr(pattern.value)
    return name


def _keyword(name: str) -> str | None:
    """The keyword a terminal stands for, if it is a fixed string."""
    try:
        pattern = _lark().get_terminal(name).pattern
    except KeyError:
        return None
    return pattern.value if pattern.type == "str" else None


def _describe_expected(names: set[str], at_line_start: bool) -> str:
    """A reader's summary of what the parser could have taken."""
    keywords = {name: _keyword(name) for name in names}
    present = set(keywords.values())
    parts: list[str] = []
    grouped: set[str] = set()
    instrs = [w for w in _INSTR_WORDS if w in present]
    headers = [w for w in _HEADER_WORDS if w in present]
    if len(instrs) >= 3:
        parts.append("an instruction (" + ", ".join(instrs[:4]) + ", ...)")
        grouped |= set(instrs)
    if len(headers) >= 3:
        parts.append("a header line (" + ", ".join(headers[:4]) + ", ...)")
        grouped |= set(headers)
    for name in sorted(names):
        if keywords[name] is not None and keywords[name] in grouped:
            continue
        if at_line_start and name in ("_NL", "$END") and len(names) > 1:
            continue  # a blank line or the end of the file is always possible there
        parts.append(_terminal_word(name))
    parts = list(dict.fromkeys(parts))
    if not parts:
        return "something else"
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


def _word_at(text: str, pos: int) -> tuple[str, int]:
    """The word around offset `pos` (for 'forwardd' the lexer stops inside it) and its start."""
    if pos >= len(text) or not _WORD.match(text[pos]):
        ch = text[pos] if pos < len(text) else ""
        return ch, pos
    start = pos
    while start > 0 and _WORD.match(text[start - 1]):
        start -= 1
    end = pos
    while end < len(text) and _WORD.match(text[end]):
        end += 1
    return text[start:end], start


def _line_start(text: str, pos: int) -> int:
    return text.rfind("\n", 0, pos) + 1


def _syntax_diagnostic(e: UnexpectedInput, text: str, file: str) -> Diagnostic:
    """Turn a lark error into 'expected X, found Y' at the place, with a hint."""
    word = None  # the word found, when a word was found
    if isinstance(e, UnexpectedToken) and e.token.type not in ("$END", "_NL"):
        expected = set(e.accepts or e.expected)
        pos = e.token.start_pos
        if _WORD.match(text[pos]):
            word, start = _word_at(text, pos)
        else:
            start = pos
            found = repr(_clip(e.token.value))
    elif isinstance(e, UnexpectedToken) and e.token.type == "_NL":
        expected = set(e.accepts or e.expected)
        start = e.token.start_pos
        found = "the end of the line"
    elif isinstance(e, UnexpectedCharacters):
        expected = _accepts(e)
        pos = e.pos_in_stream
        if _WORD.match(text[pos]):
            word, start = _word_at(text, pos)
        elif text[pos] == '"' and "STRING" in expected:
            return Diagnostic("a string with no closing quote",
                              Loc(file, e.line, e.column),
                              'a string ends with " on the same line; write \\" for a quote '
                              "inside it")
        else:
            start = pos
            found = repr(text[pos])
    else:  # the end of the file ($END token, or lark's UnexpectedEOF)
        expected = set(getattr(e, "accepts", None) or getattr(e, "expected", None) or ())
        start = len(text.rstrip("\n"))
        found = "the end of the file"
    line = text.count("\n", 0, start) + 1
    col = start - _line_start(text, start) + 1
    loc = Loc(file, line, col)
    line_text = text[_line_start(text, start):].split("\n", 1)[0]
    first = line_text.split()[0] if line_text.split() else ""
    at_line_start = line_text[: col - 1].strip() == ""

    if word is not None:
        found = repr(_clip(word))
        if start < e.pos_in_stream:
            # the lexer took a keyword off the front of a longer word ('stepx', 'forwardd')
            close = difflib.get_close_matches(word, list(SYNTAX) + list(_all_keywords()), n=1,
                                              cutoff=0.5)
            hint = f"did you mean {close[0]!r}?" if close else _hint(expected, None, first,
                                                                     at_line_start)
            return Diagnostic(f"unknown word {found}", loc, hint)
    if expected <= {"TPIR", "_NL"} and "TPIR" in expected:
        return Diagnostic(f"expected the version line `tpir {FORMAT_VERSION}`, found {found}", loc,
                          f"a plan starts with `tpir {FORMAT_VERSION}` (comments and blank lines "
                          "may come before it)")
    message = f"expected {_describe_expected(expected, at_line_start)}, found {found}"
    return Diagnostic(message, loc, _hint(expected, word, first, at_line_start))


def _accepts(e: UnexpectedCharacters) -> set[str]:
    """The terminals the parser could take there (the lexer's own set is less precise)."""
    try:
        return set(e.interactive_parser.accepts())
    except (AttributeError, LarkError):
        return set(e.allowed)


def _clip(text: str, limit: int = 30) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


@lru_cache(maxsize=1)
def _all_keywords() -> tuple[str, ...]:
    return tuple(sorted(t.pattern.value for t in _lark().terminals if t.pattern.type == "str"))


def _hint(expected: set[str], word: str | None, first: str, at_line_start: bool) -> str:
    candidates = [k for k in (_keyword(n) for n in expected) if k]
    # a keyword that is merely in the wrong place is not a misspelling of another one
    misspelt = word is not None and word not in _all_keywords()
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.5) if misspelt else []
    if close:
        kw = close[0]
        if at_line_start and kw in SYNTAX:
            return f"did you mean {kw!r}? that line reads: {SYNTAX[kw]}"
        return f"did you mean {kw!r}?"
    if not at_line_start and first in SYNTAX:
        return f"a {first!r} line reads: {SYNTAX[first]}"
    if at_line_start and any(_keyword(n) in _INSTR_WORDS for n in expected):
        if first in _HEADER_WORDS:
            return ("header lines come before the first `rank` line; instructions follow a "
                    "`rank R` line, one per line: " + ", ".join(_INSTR_WORDS))
        return "instructions, one per line: " + ", ".join(_INSTR_WORDS)
    if at_line_start and any(_keyword(n) in _HEADER_WORDS for n in expected):
        if first in _INSTR_WORDS:
            return "instructions go after a `rank R` line"
        return _ORDER_HINT
    return "see docs/ir.md for the syntax of a plan"
