"""Every library the package imports is one `pip install .` brings: each top-level module that a
module of grammar/, ir/, compiler/, executors/ or cli/ imports, wherever the import stands (at
the top or inside a function), is the standard library's, tpc's own, or a distribution named in
pyproject.toml's `dependencies`. The only exceptions are in OPTIONAL, each with the refusal a
user gets without it. Read from the source, so a new import of an undeclared library fails here
even where the test machine happens to have it installed."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("grammar", "ir", "compiler", "executors", "cli")
# imported only where a feature needs it, refused with a located message when it is missing
OPTIONAL = {
    "transformers": "compiler/frontend/hf.py: a Hugging Face config.json needs the `transformers` package",
}


def _top_level_imports() -> dict[str, set[str]]:
    """top-level module -> the files that import it."""
    out: dict[str, set[str]] = {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    names = [node.module]
                else:
                    continue
                for n in names:
                    out.setdefault(n.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return out


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return {re.split(r"[\s\[<>=!~;]", d, maxsplit=1)[0].lower().replace("_", "-") for d in project["dependencies"]}


def test_every_imported_library_is_a_declared_dependency():
    dists = importlib.metadata.packages_distributions()
    declared = _declared()
    missing = []
    for module, files in sorted(_top_level_imports().items()):
        if module in sys.stdlib_module_names or module in ("tpc", "__future__") or module in OPTIONAL:
            continue
        names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        if not names & declared:
            missing.append(f"{module} (distribution {', '.join(sorted(names))}) imported by {', '.join(sorted(files))}")
    assert not missing, "not in pyproject.toml's dependencies:\n" + "\n".join(missing)


def test_optional_libraries_are_imported_where_they_are_refused():
    imports = _top_level_imports()
    for module, refusal in OPTIONAL.items():
        where, message = refusal.split(": ", 1)
        assert imports.get(module) == {where}, (module, imports.get(module))
        assert message in (ROOT / where).read_text(encoding="utf-8")
