"""Source locations in the user's model file, for diagnostics.

An fx node remembers the Python stack that created it (`node.meta["stack_trace"]`); an exception
remembers its traceback. Either names frames in torch and in the model file; the user can act only
on the model file, so we report the innermost frame that lies in it.
"""

from __future__ import annotations

import functools
import os
import re
import sysconfig
import traceback
from types import TracebackType

from tpc.ir.diagnostics import Diagnostic, TpirError
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


# Not the user's code and not a library's: the standard library and tpc's own installed folders
# (compiler/, ir/, executors/, not the folders beside them); torch is found from its package.
_STDLIB_DIRS = tuple(
    os.path.abspath(p) + os.sep
    for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")}
)
_TPC_DIRS = tuple(
    os.path.abspath(os.path.join(os.path.dirname(__file__), *rel)) + os.sep
    for rel in ((os.pardir,), (os.pardir, os.pardir, "ir"), (os.pardir, os.pardir, "executors"))
)
_PACKAGE_DIRS = ("site-packages", "dist-packages")


def _torch_dir() -> str:
    import torch

    return os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


@functools.lru_cache(maxsize=4096)
def _frame_kind(path: str) -> str:
    """"user" (code the user wrote), "library" (an installed package other than torch, such as
    transformers) or "skip" (torch, the standard library, tpc itself)."""
    p = os.path.abspath(path)
    if path.startswith("<") or p.startswith(_TPC_DIRS) or p.startswith(_torch_dir()):
        return "skip"
    if any(d in p.split(os.sep) for d in _PACKAGE_DIRS):
        return "library"
    return "skip" if p.startswith(_STDLIB_DIRS) else "user"


def is_model_code(path: str) -> bool:
    """Code of the user's model or of a library it uses (transformers): not torch, not the
    standard library, not tpc itself."""
    return _frame_kind(path) != "skip"


def _is_user_file(path: str) -> bool:
    """Not torch, not the standard library, not an installed package, not tpc itself."""
    return _frame_kind(path) == "user"


_BLOCK = re.compile(r'File "(?P<file>[^"]+)", line \d+, in [^\n]*(?:\n(?![ ]*File ")[^\n]*)*')


def compact_stack_trace(stack_trace: str | None) -> str | None:
    """The frames of a node's stack trace that are model code (the user's or a library's), each
    with its source line; torch's and the standard library's frames dropped."""
    if not stack_trace:
        return stack_trace
    keep = [m.group(0).strip() for m in _BLOCK.finditer(stack_trace) if _frame_kind(m["file"]) != "skip"]
    return "\n".join("  " + b for b in keep) if keep else None


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


def module_of_node(node) -> tuple[str, str]:
    """(path of the innermost module the node was made in, relative to the captured model;
    its class name), e.g. ("model.layers.0.self_attn", "LlamaAttention"); ("", "") if unknown."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, kind = list(stack.values())[-1]
    kind = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    return path, kind.rsplit(".", 1)[-1]


def node_diagnostics(node, model_file: str | None, message: str, hint: str) -> list[Diagnostic]:
    """A refusal located at the construct that made `node`.

    In the user's own code: at that line. Inside a library (a Hugging Face model): at the
    library's file and line, with a note at the user's own line that led there. Either way the
    message names the module of the model the node belongs to (`model.layers.0.self_attn`)."""
    frames = [(m["file"], int(m["line"])) for m in _FRAME.finditer(node.meta.get("stack_trace") or "")]
    kinds = [_frame_kind(f) for f, _ in frames]
    mine = [f for f, k in zip(frames, kinds) if k != "skip"]
    path, kind = module_of_node(node)
    in_module = f" (in `{path}`, {kind})" if path else (f" (in the model's top module, {kind})" if kind else "")
    if mine and _frame_kind(mine[-1][0]) == "library":
        out = [Diagnostic(message + in_module, loc=loc_at(*mine[-1]), hint=hint)]
        users = [f for f, k in zip(frames, kinds) if k == "user"]
        if users:
            out.append(Diagnostic("the model's own code that leads there", loc=loc_at(*users[-1]),
                                  severity="note"))
        return out
    loc = loc_of_node(node, model_file)
    if loc is None:
        return [Diagnostic(message + in_module, where=where_of_node(node), hint=hint)]
    out = [Diagnostic(message + in_module, loc=loc, hint=hint)]
    if model_file and not _same_file(loc.file, model_file):  # in a helper the model file calls
        theirs = [f for f in frames if _same_file(f[0], model_file)]
        if theirs:
            out.append(Diagnostic("the model's own code that leads there", loc=loc_at(*theirs[-1]),
                                  severity="note"))
    return out


def refuse(node, model_file: str | None, message: str, hint: str) -> TpirError:
    """The `TpirError` of `node_diagnostics` (raise it)."""
    return TpirError(node_diagnostics(node, model_file, message, hint))


def where_of_node(node) -> str:
    """A readable name for a node when there is no file location: op and module path."""
    stack = node.meta.get("nn_module_stack") or {}
    path = ""
    if stack:
        path = list(stack.values())[-1][0]
    op = getattr(node.target, "__name__", str(node.target))
    return f"{path or '<model>'}: {op} ({node.name})"
