"""What `pip install .` (not editable) puts on the path: setuptools installs only the packages
pyproject.toml lists, so a sub-package folder missing from that list works in an editable checkout
and is absent from a wheel. Read pyproject.toml and the tree, and compare."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]


def _packages_on_disk() -> dict[str, Path]:
    """Every folder with an __init__.py below a package-dir root, by its installed name."""
    found = {}
    for name, folder in SETUPTOOLS["package-dir"].items():
        root = ROOT / folder
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            found[".".join((name, *rel.parts))] = init.parent
    return found


def test_the_roots_are_read():
    assert {"tpc.cli", "tpc.compiler", "tpc.ir", "tpc.grammar", "tpc.executors"} <= set(_packages_on_disk())


def test_every_package_folder_is_listed():
    on_disk = set(_packages_on_disk())
    listed = set(SETUPTOOLS["packages"])
    missing = sorted(on_disk - listed)
    stale = sorted(listed - on_disk)
    assert not missing, f"folders with an __init__.py that pyproject.toml's packages omit: {missing}"
    assert not stale, f"pyproject.toml lists packages with no folder: {stale}"


def test_every_data_file_is_shipped():
    """A file the product reads that is not Python ships only if package-data names its pattern."""
    data = SETUPTOOLS.get("package-data", {})
    for name, folder in _packages_on_disk().items():
        for path in folder.iterdir():
            if path.is_file() and path.suffix not in (".py", ".pyc"):
                patterns = data.get(name, [])
                assert any(path.match(p) for p in patterns), f"{path.relative_to(ROOT)} is not in package-data"
