"""Text to plan: `parse(text, file) -> Plan`, or `PlanParser().parse(...)`.

The one grammar (`grammar/tpir.lark`) is parsed by an LALR parser (`PlanParser`; `parse` uses
one built on first use). The builder (`ir/build.py`) makes the frozen dataclasses of
`ir/nodes.py` while lark parses (lark calls it at each reduction, so no parse tree is made; a
line's location is that of its first token). Comments are ignored by the grammar and collected
through a lexer callback; the builder attaches them by line while it builds the lines in
document order (a full-line comment belongs to the next line, an end-of-line comment to its own
line, comments after the last line to the plan). The lexer is lark's contextual lexer with a
faster loop (`ir/lexer.py`).

Whatever the input, `parse` raises nothing but `TpirError`: lark's syntax errors (explained by
`ir/syntax.py`), the value checks of the dataclasses, and the rules the grammar leaves to the
builder (header lines in order and none missing, rank sections numbered 0, 1, 2, ... in order,
format version 1) all become located diagnostics with a hint.
"""

from __future__ import annotations

import threading
from functools import lru_cache

from lark import Lark
from lark.exceptions import LarkError, UnexpectedInput

from tpc.grammar import grammar_text
from tpc.ir.build import Located, PlanBuilder
from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.lexer import FastContextualLexer
from tpc.ir.nodes import Bundle, Loc, Plan
from tpc.ir.syntax import SYNTAX, syntax_diagnostic

__all__ = ["PlanParser", "parse", "parse_bundle", "parse_document", "SYNTAX"]


class PlanParser:
    """One LALR parser of the grammar with its own builder. The plan is built while lark
    parses (the builder is lark's in-parser transformer), so the builder holds the state of
    the parse in progress: one parser parses one text at a time (its lock says so); use one
    parser per thread to parse in parallel."""

    def __init__(self):
        self.builder = PlanBuilder()
        self.lark = Lark(
            grammar_text(),
            parser="lalr",
            strict=True,
            maybe_placeholders=True,
            cache=True,  # the tables, in the temp dir, keyed by grammar, options and lark version
            lexer=FastContextualLexer,
            transformer=self.builder,
            lexer_callbacks={"COMMENT": self.builder.collect_comment},
        )
        self.lock = threading.Lock()

    def parse(self, text: str, file: str = "<string>") -> Plan:
        """Parse the text of a .tpir plan. Raises `TpirError` (and nothing else) on bad input,
        a plan bundle's index included."""
        return _expect(self.parse_document(text, file), Plan, text, file)

    def parse_document(self, text: str, file: str = "<string>") -> Plan | Bundle:
        """Parse a .tpir file: a plan, or a plan bundle's index (`bundle` after the version)."""
        source = text
        if not text.endswith("\n"):
            text += "\n"  # every line ends with a newline; positions are unchanged
        with self.lock:
            self.builder.begin(file)
            try:
                plan = self.lark.parse(text)
                # a value error is reported only when the whole text is well-formed, so that a
                # syntax error anywhere is the one reported, wherever the value error is
                if self.builder.error is not None:
                    raise self.builder.error
                return plan
            except UnexpectedInput as e:
                raise TpirError(syntax_diagnostic(e, text, file, self.lark), source=source) from None
            except Located as e:
                raise TpirError(e.diagnostics, source=source) from None
            except LarkError as e:  # any other lark error is still the input's fault
                raise TpirError(Diagnostic(f"cannot read the plan: {e}", Loc(file, 1, 1),
                                           hint="see docs/ir.md for the format"),
                                source=source) from None
            finally:
                self.builder.begin("")


@lru_cache(maxsize=1)
def default_parser() -> PlanParser:
    """The parser `parse` uses, built on first use (building one reads the cached tables)."""
    return PlanParser()


def parse(text: str, file: str = "<string>") -> Plan:
    """Parse the text of a .tpir file with the default parser (see `PlanParser.parse`)."""
    return default_parser().parse(text, file)


def parse_document(text: str, file: str = "<string>") -> Plan | Bundle:
    """A plan or a plan bundle's index, whichever the text is."""
    return default_parser().parse_document(text, file)


def parse_bundle(text: str, file: str = "<string>") -> Bundle:
    """A plan bundle's index; a plan is refused (located at its version line)."""
    return _expect(default_parser().parse_document(text, file), Bundle, text, file)


def _expect(doc, kind, text: str, file: str):
    if isinstance(doc, kind):
        return doc
    loc = doc.version_loc if isinstance(doc, Bundle) else doc.header.version_loc
    if kind is Plan:
        message = "this is a plan bundle's index (its second line is `bundle`), not a plan"
        hint = ("give it to `tpc verify`, `show`, `simulate` or `run` whole, or one of the plans "
                "its `plan` lines name")
    else:
        message = "this is a plan, not a plan bundle's index"
        hint = "a bundle's index starts `tpir 2` then `bundle` (`tpc compile --seq-len 64,128 ...` writes one)"
    raise TpirError(Diagnostic(message, loc or Loc(file, 1, 1), hint), source=text)
