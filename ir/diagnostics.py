"""Diagnostics: located errors that say what is wrong and what would be right.

Every error a user can cause (a bad .tpir file, a model that cannot be sliced, a plan that does
not fit the world) is a `Diagnostic`; several are raised together as one `TpirError`, and the CLI
prints them with `render` and exits non-zero, never with a Python traceback (unless --debug).

    plan.tpir:14:3: error: backward of slice 1 runs before backward of slice 2
       14 |   backward stage 0 mb 0 slice 1
          |   ^
      hint: slices of a micro-batch are back-propagated in reverse token order; move this line
            below line 17 (backward stage 0 mb 0 slice 2)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tpc.ir.nodes import Loc


# how much of the user's input a message shows: a source line is shown around its caret, a
# quoted word is cut, a message's line is cut, and only the first errors of a long list are
# rendered (a 50 MB line, or a file with a million bad cells, is not echoed whole)
LINE_SHOWN = 200
QUOTE_SHOWN = 60
TEXT_SHOWN = 2000
ERRORS_SHOWN = 100
ELLIPSIS = "…"


def quote(text: str, limit: int = QUOTE_SHOWN) -> str:
    """`text` from the user's input, cut to about `limit` characters for a message."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}{ELLIPSIS} ({len(text)} characters)"


def _clip(text: str, limit: int = TEXT_SHOWN) -> str:
    return text if len(text) <= limit else f"{text[:limit]}{ELLIPSIS} ({len(text) - limit} more characters)"


@dataclass(frozen=True)
class Diagnostic:
    message: str
    loc: Loc | None = None
    hint: str = ""
    # where the error is when there is no source location (a plan built in memory)
    where: str = ""
    severity: str = "error"

    def render(self, source: str | None = None) -> str:
        """Text for a terminal. `source` is the file's text; without it the file is read."""
        head = f"{self.loc}: " if self.loc else (f"{self.where}: " if self.where else "")
        out = [f"{head}{self.severity}: " + "\n".join(_clip(m) for m in self.message.split("\n"))]
        if self.loc is not None:
            line = _source_line(self.loc, source)
            if line is not None:
                shown, before = _window(line.rstrip("\n"), self.loc.col)
                gutter = f"{self.loc.line:>5} | "
                out.append(gutter + shown)
                caret_pad = "".join("\t" if c == "\t" else " " for c in before)
                out.append(" " * (len(gutter) - 2) + "| " + caret_pad + "^")
        if self.hint:
            lines = [_clip(h) for h in self.hint.splitlines()]
            out.append("  hint: " + lines[0])
            out += ["        " + extra for extra in lines[1:]]
        return "\n".join(out)


def _window(line: str, col: int) -> tuple[str, str]:
    """The part of `line` shown (about LINE_SHOWN characters around column `col`, `…` where
    it is cut) and what is shown before the caret."""
    if len(line) <= LINE_SHOWN:
        return line, line[: col - 1]
    start = max(0, min(col - 1 - LINE_SHOWN // 2, len(line) - LINE_SHOWN))
    end = start + LINE_SHOWN
    lead = ELLIPSIS if start else ""
    tail = f"{ELLIPSIS} ({len(line)} characters)" if end < len(line) else ""
    return lead + line[start:end] + tail, lead + line[start: col - 1]


def _source_line(loc: Loc, source: str | None) -> str | None:
    if source is None:
        if not loc.file or not os.path.isfile(loc.file):
            return None
        try:
            with open(loc.file, encoding="utf-8", errors="replace") as f:
                source = f.read()
        except OSError:
            return None
    # count lines as the lexer does: at "\n" only (str.splitlines also breaks at \x0c, \u2028, ...)
    lines = source.split("\n")
    if 1 <= loc.line <= len(lines):
        return lines[loc.line - 1].rstrip("\r")
    return None


class TpirError(Exception):
    """One or more diagnostics. `str()` renders them all."""

    def __init__(self, diagnostics: list[Diagnostic] | Diagnostic, source: str | None = None):
        if isinstance(diagnostics, Diagnostic):
            diagnostics = [diagnostics]
        self.diagnostics = list(diagnostics)
        self.source = source
        super().__init__(self.render())

    def render(self) -> str:
        shown = [d.render(self.source) for d in self.diagnostics[:ERRORS_SHOWN]]
        left = len(self.diagnostics) - ERRORS_SHOWN
        if left > 0:
            shown.append(f"... and {left} more error{'s' if left > 1 else ''} (the first {ERRORS_SHOWN} "
                         "are shown: fix them and run again)")
        return "\n".join(shown)
