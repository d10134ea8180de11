"""Source locations in the user's model file, for diagnostics.

An fx node remembers the Python stack that created it (`node.meta["stack_trace"]`); an exception
remembers its traceback. Either names frames in torch and in the model file; the user can act only
on the model file, so we report the innermost frame that lies in it.
"""

from __future__ import annotations

import os
import re
import sysconfig
import traceback
from types import TracebackType

from tpc.ir.nodes import Loc

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def loc_at(file: str, line: int) -> Loc:
    """A location at the first non-blank column of `line` (the caret points at the code)."""
    col = 1
    try:
        with open(file, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        if 1 <= line <= len(lines):
            text = lines[line - 1]
            col = len(text) - len(text.lstrip()) + 1
    except OSError:
        pass
    return Loc(file, line, col)


_LIBRARY_DIRS = tuple(
    os.path.abspath(p) + os.sep
    for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
) + tuple(
    # tpc's own installed folders (compiler/, ir/, executors/), not the folders beside them
    os.path.abspath(os.path.join(os.path.dirname(__file__), *rel)) + os.sep
    for rel in ((os.pardir,), (os.pardir, os.pardir, "ir"), (os.pardir, os.pardir, "executors"))
)


def _is_user_file(path: str) -> bool:
    """Not torch, not the standard library, not tpc itself: code the user wrote."""
    p = os.path.abspath(path)
    return not p.startswith(_LIBRARY_DIRS) and not p.startswith("<")


def loc_from_stack_trace(stack_trace: str | None, model_file: str | None) -> Loc | None:
    """The innermost user frame of an fx node's stack trace (the model file, or a helper module
    it imports), so the caret lands on the line that built the offending value."""
    if not stack_trace:
        return None
    frames = [(m["file"], int(m["line"])) for m in _FRAME.finditer(stack_trace)]
    user = [f for f in frames if _is_user_file(f[0])]
    if user:
        return loc_at(*user[-1])
    if model_file:
        mine = [f for f in frames if _same_file(f[0], model_file)]
        if mine:
            return loc_at(*mine[-1])
    return None


def loc_from_traceback(tb: TracebackType | None, model_file: str | None) -> Loc | None:
    """The innermost traceback frame in the model file."""
    if tb is None or not model_file:
        return None
    best = None
    for fs in traceback.extract_tb(tb):
        if _same_file(fs.filename, model_file):
            best = fs
    if best is None or best.lineno is None:
        return None
    col = (best.colno + 1) if getattr(best, "colno", None) is not None else None
    loc = loc_at(best.filename, best.lineno)
    return Loc(loc.file, loc.line, col) if col else loc


def loc_of_node(node, model_file: str | None) -> Loc | None:
    return loc_from_stack_trace(node.meta.get("stack_trace"), model_file)


def where_of_node(node) -> str:
    """A readable name for a node when there is no file location: op and module path."""
    stack = node.meta.get("nn_module_stack") or {}
    path = ""
    if stack:
        path = list(stack.values())[-1][0]
    op = getattr(node.target, "__name__", str(node.target))
    return f"{path or '<model>'}: {op} ({node.name})"
