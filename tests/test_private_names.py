"""The house rule on private names: a module reads only its own.

A name that starts with one underscore is its module's business. Whoever else needs what it
holds gets a public, documented accessor, so the module can change how it keeps it. Read from
the source: every module under compiler/, executors/ and cli/ is scanned for

- a private attribute of the front end's shared types (`SlicedModel`, `PassContext`, the
  `StageModule`) read outside the module that defines the type (`sliced._units`, or
  `getattr(sliced, "_units")`);
- a private name imported from another tpc module (`from tpc.compiler.frontend.partition import
  _is_residual`).

Each scanner is also run on a snippet that breaks the rule, so a scanner that finds nothing
cannot pass unnoticed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("compiler", "executors", "cli")
# the module that defines each guarded type: only it may read the type's private attributes
GUARDED = {
    "compiler/frontend/sliced.py": ("SlicedModel",),
    "compiler/frontend/context.py": ("PassContext",),
    "compiler/frontend/stage.py": ("StageModule",),
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_members(source: str, classes) -> set[str]:
    """The private names the classes `classes` of `source` define: methods and class attributes,
    and attributes their methods set on `self`."""
    found: set[str] = set()
    for cls in ast.walk(ast.parse(source)):
        if not (isinstance(cls, ast.ClassDef) and cls.name in classes):
            continue
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.add(item.name)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                found.add(item.target.id)
            elif isinstance(item, ast.Assign):
                found.update(t.id for t in item.targets if isinstance(t, ast.Name))
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self":
                found.add(node.attr)
    return {n for n in found if _is_private(n)}


def private_reads(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, expression) of each use of one of `names` as an attribute of anything but `self`
    or `cls`: `x._name`, or `getattr(x, "_name")` / `setattr` / `hasattr` with the name spelled out."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in names:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in names:
            out.append((node.lineno, ast.unparse(node)))
    return sorted(out)


def private_imports(source: str) -> list[tuple[int, str]]:
    """(line, statement) of each `from tpc.... import _name`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tpc") \
                and any(_is_private(a.name) for a in node.names):
            out.append((node.lineno, ast.unparse(node)))
    return sorted(out)


def _sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
            for top in SCANNED for p in sorted((ROOT / top).rglob("*.py"))}


SOURCES = _sources()


def test_the_guarded_types_are_read():
    for path, classes in GUARDED.items():
        assert private_members(SOURCES[path], classes) or classes == ("PassContext",), path
    assert {"_units", "_fetch", "_original"} <= private_members(SOURCES["compiler/frontend/sliced.py"],
                                                                ("SlicedModel",))


@pytest.mark.parametrize("owner", sorted(GUARDED))
def test_no_module_reads_the_privates_of_another(owner):
    names = private_members(SOURCES[owner], GUARDED[owner])
    reads = [f"{path}:{line}: {text}" for path, source in SOURCES.items() if path != owner
             for line, text in private_reads(source, names)]
    assert not reads, (f"private attributes of {', '.join(GUARDED[owner])} ({owner}) read elsewhere; "
                       "give them a public accessor:\n" + "\n".join(reads))


def test_no_module_imports_a_private_name():
    found = [f"{path}:{line}: {text}" for path, source in SOURCES.items()
             for line, text in private_imports(source)]
    assert not found, "private names imported from another module:\n" + "\n".join(found)


# ---------------------------------------------------------------- the scanners find what they should

_CLASS = '''
class SlicedModel:
    kind = "x"
    _cache = {}

    def __init__(self):
        self._units = []
        self.public = 1

    def _helper(self):
        return self._units, cls._cache
'''


def test_private_members_finds_methods_class_and_instance_attributes():
    assert private_members(_CLASS, ("SlicedModel",)) == {"_cache", "_units", "_helper"}
    assert private_members(_CLASS, ("Other",)) == set()


def test_private_reads_flags_other_objects_only():
    snippet = ("def f(sliced, stage):\n"
               "    a = sliced._units\n"
               "    b = getattr(stage, '_helper')\n"
               "    return self._units, cls._cache, sliced.units, sliced._other\n")
    assert private_reads(snippet, {"_units", "_helper", "_cache"}) == [
        (2, "sliced._units"), (3, "getattr(stage, '_helper')")]


def test_private_imports_flags_tpc_privates_only():
    snippet = ("from tpc.compiler.frontend.partition import _is_residual, make_units\n"
               "from torch.fx.experimental import _config\n"
               "from tpc.compiler.frontend.axes import is_residual_stream\n")
    assert private_imports(snippet) == [(1, "from tpc.compiler.frontend.partition import _is_residual, make_units")]
