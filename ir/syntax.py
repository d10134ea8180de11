"""How a plan is written, for messages: the syntax of every line (`SYNTAX`), the order of the
header lines, and the explainer that turns lark's syntax errors into located diagnostics that
say what was expected, in words, with a hint."""

from __future__ import annotations

import difflib
import re
from functools import lru_cache

from lark import Lark
from lark.exceptions import LarkError, UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from tpc.ir.diagnostics import Diagnostic
from tpc.ir.nodes import FORMAT_VERSION, OPERANDS, Loc, Op


_OPERAND_SYNTAX = {"stage": "stage S", "mb": "mb M", "slice": "slice I", "payload": "act|grad",
                   "tie": '"NAME"', "count": "N"}


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
    "model", "shape", "documents", "mesh", "schedule", "units", "random-ltd", "stage", "tie", "microbatch",
)
REPEATED = frozenset({"stage", "tie", "microbatch"})
OPTIONAL = frozenset({"tie", "documents", "random-ltd"})

# How each line is written, by its first word: shown in hints.
SYNTAX: dict[str, str] = {
    "tpir": f"tpir {FORMAT_VERSION}",
    "model": 'model "PATH" sha256 "HEX" factory "NAME"',
    "shape": "shape batch B seq L vocab V dtype D",
    "documents": "documents eos ID mean M",
    "mesh": "mesh pipe P data D [tensor T]",
    "schedule": 'schedule "NAME"',
    "units": "units N",
    "random-ltd": "random-ltd units U1 U2 ... min-value K0 max-value K1 require-steps N seq-per-step Q",
    "stage": 'stage S rank R units LO:HI "LABEL"  (or `ranks R0 R1`: weight replicas)',
    "tie": 'tie "NAME" stages S T ...',
    "microbatch": "microbatch M size N slices A:B ... [replica K]",
    "rank": "rank R",
    "eval": "eval",
    "bundle": "bundle",
    "plan": 'plan "PATH" seq L batch B',
    **{op.value: _instr_syntax(op) for op in Op},
}

ORDER_HINT = ("header lines come in this order: tpir, model, shape, [documents], mesh, schedule, units, "
              "[random-ltd], stage lines, tie lines, microbatch lines")

# A plan bundle's index (format version 2): these lines, in this order; stage, tie and plan repeat.
BUNDLE_ORDER: tuple[str, ...] = ("bundle", "model", "mesh", "units", "stage", "tie", "plan")
BUNDLE_REPEATED = frozenset({"stage", "tie", "plan"})
BUNDLE_ORDER_HINT = ("a plan bundle's index reads: tpir 2, bundle, model, mesh, units, stage lines, "
                     "tie lines, plan lines (and no shape, schedule, microbatch or rank lines)")

_INSTR_WORDS = tuple(op.value for op in Op)
_HEADER_WORDS = HEADER_ORDER


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


def _terminal_word(name: str, lark: Lark) -> str:
    if name in _TERMINAL_WORDS:
        return _TERMINAL_WORDS[name]
    try:
        pattern = lark.get_terminal(name).pattern
    except KeyError:
        return name
    if pattern.type == "str":
        return repr(pattern.value)
    return name


def _keyword(name: str, lark: Lark) -> str | None:
    """The keyword a terminal stands for, if it is a fixed string."""
    try:
        pattern = lark.get_terminal(name).pattern
    except KeyError:
        return None
    return pattern.value if pattern.type == "str" else None


def _describe_expected(names: set[str], at_line_start: bool, lark: Lark) -> str:
    """A reader's summary of what the parser could have taken."""
    keywords = {name: _keyword(name, lark) for name in names}
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
        parts.append(_terminal_word(name, lark))
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


def syntax_diagnostic(e: UnexpectedInput, text: str, file: str, lark: Lark) -> Diagnostic:
    """The located diagnostic for lark's syntax error `e` in `text`: what was expected, in
    words, and a hint (a close keyword, the line's syntax)."""
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
            close = difflib.get_close_matches(word, list(SYNTAX) + list(_all_keywords(lark)), n=1,
                                              cutoff=0.5)
            hint = f"did you mean {close[0]!r}?" if close else _hint(expected, None, first, lark,
                                                                     at_line_start)
            return Diagnostic(f"unknown word {found}", loc, hint)
    if expected <= {"TPIR", "_NL"} and "TPIR" in expected:
        return Diagnostic(f"expected the version line `tpir {FORMAT_VERSION}`, found {found}", loc,
                          f"a plan starts with `tpir {FORMAT_VERSION}` (comments and blank lines "
                          "may come before it)")
    message = f"expected {_describe_expected(expected, at_line_start, lark)}, found {found}"
    return Diagnostic(message, loc, _hint(expected, word, first, lark, at_line_start))


def _accepts(e: UnexpectedCharacters) -> set[str]:
    """The terminals the parser could take there (the lexer's own set is less precise)."""
    try:
        return set(e.interactive_parser.accepts())
    except (AttributeError, LarkError):
        return set(e.allowed)


def _clip(text: str, limit: int = 30) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


@lru_cache(maxsize=1)
def _all_keywords(lark: Lark) -> tuple[str, ...]:
    return tuple(sorted(t.pattern.value for t in lark.terminals if t.pattern.type == "str"))


def _hint(expected: set[str], word: str | None, first: str, lark: Lark, at_line_start: bool) -> str:
    candidates = [k for k in (_keyword(n, lark) for n in expected) if k]
    # a keyword that is merely in the wrong place is not a misspelling of another one
    misspelt = word is not None and word not in _all_keywords(lark)
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.5) if misspelt else []
    if close:
        kw = close[0]
        if at_line_start and kw in SYNTAX:
            return f"did you mean {kw!r}? that line reads: {SYNTAX[kw]}"
        return f"did you mean {kw!r}?"
    if not at_line_start and first in SYNTAX:
        return f"a {first!r} line reads: {SYNTAX[first]}"
    if at_line_start and any(_keyword(n, lark) in _INSTR_WORDS for n in expected):
        if first in _HEADER_WORDS:
            return ("header lines come before the first `rank` line; instructions follow a "
                    "`rank R` line, one per line: " + ", ".join(_INSTR_WORDS))
        return "instructions, one per line: " + ", ".join(_INSTR_WORDS)
    if at_line_start and any(_keyword(n, lark) in _HEADER_WORDS for n in expected):
        if first in _INSTR_WORDS:
            return "instructions go after a `rank R` line"
        return ORDER_HINT
    return "see docs/ir.md for the syntax of a plan"
