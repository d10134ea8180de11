"""The house rules of imports (docs/architecture.md): every import points one way along the
layers

    grammar <- ir <- compiler <- executors <- cli <- tpc (the public API, tpc/__init__.py)

and no module imports another that imports it back, directly or through others, lazily inside a
function or at the top: a cycle is a layer that has not been drawn. Read from the source (every
`import` and `from ... import`, wherever it stands), so a new upward or circular import fails
here before anything runs it."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
# a layer imports only those before it; "tpc" is the folder of the package itself (its public API)
LAYERS = ("grammar", "ir", "compiler", "executors", "cli", "tpc")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts and parts[0] == "tpc":  # tpc/__init__.py is the package `tpc`
        parts.pop(0)
    return ".".join(["tpc", *parts])


def _folder(module: str) -> str:
    """The layer (top folder) of a module: `tpc` itself is the folder tpc/."""
    return module.split(".")[1] if "." in module else "tpc"


def _modules() -> dict[str, Path]:
    out = {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            out[_module_name(path)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The tpc modules `name` imports (a `from package import module` counts as the module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if (t.startswith("tpc.") or t == "tpc") and t != name)
    return found


def _layer(module: str) -> int:
    return LAYERS.index(_folder(module))


GRAPH = nx.DiGraph()
for _name, _path in MODULES.items():
    GRAPH.add_node(_name)
    for _target in _imports(_name, _path):
        GRAPH.add_edge(_name, _target)


def test_the_layers_are_read():
    assert all(any(_folder(m) == layer for m in MODULES) for layer in LAYERS)
    assert GRAPH.number_of_edges() > 100  # the reader finds the imports it is meant to find


@pytest.mark.parametrize("layer", LAYERS)
def test_no_import_points_up(layer):
    upward = sorted(f"{a} imports {b}" for a, b in GRAPH.edges
                    if _folder(a) == layer and _layer(b) > _layer(a))
    assert not upward, f"imports against the layer order {' <- '.join(LAYERS)}:\n" + "\n".join(upward)


def test_no_module_imports_itself_back():
    cycles = sorted(sorted(c) for c in nx.simple_cycles(GRAPH))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)
